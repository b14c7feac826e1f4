"""The processes a lane's pytest session leaves, read from /proc (the GPU image has no gdb or
strace; py-spy, for Python stacks, travels in .whl-tools): what each was doing at the session's
limit, and ending those it left.

A step's own children can outlive it: megatron_bridge's distill.py left a process forked from
its rank (parent init, in the rank's process group, waiting on a futex) that held the test's
output pipe, so pytest waited for that pipe's end forever, in both ways' sessions
(docs/modelopt-lane.md, 2026-12-04). Such a process is an orphan the session made; the
lane ends it at the limit (then pytest reports the test as it would have, with the rank's
output) and after every session (so the next way starts on an idle machine). A process is the
session's when it did not exist before the session and carries the session's mark in its
environment (``MARK``), which every process started from the session inherits: a machine's
other processes are never touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from typing import NamedTuple


MARK = "MODELOPT_LANE_SESSION"


class Process(NamedTuple):
    pid: int
    ppid: int
    pgid: int
    state: str
    wchan: str
    threads: int
    command: str


def processes() -> dict[int, Process]:
    """Every user-space process now (kernel threads, which have no command line, left out)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            try:
                with open(f"/proc/{name}/wchan") as f:
                    wchan = f.read().strip() or "-"
            except OSError:
                wchan = "?"
        except OSError:
            continue  # gone meanwhile
        state, ppid, pgid, threads = fields[0], int(fields[1]), int(fields[2]), int(fields[17])
        if command or state == "Z":
            found[int(name)] = Process(int(name), ppid, pgid, state, wchan, threads, command)
    return found


def snapshot(path: str) -> None:
    """Every process's pid, parent, group, state, kernel wait channel, threads and command."""
    rows = ["pid ppid pgid state wchan threads command"]
    for p in sorted(processes().values()):
        rows.append(f"{p.pid} {p.ppid} {p.pgid} {p.state} {p.wchan} {p.threads} {p.command[:400]}")
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")


def _marked(pid: int, session: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{MARK}={session}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def made_by(session: str, before: set[int]) -> list[Process]:
    """The session's processes still alive: new since ``before``, carrying its mark."""
    return [p for p in processes().values()
            if p.pid not in before and p.state != "Z" and _marked(p.pid, session)]


def orphans_of(session: str, before: set[int]) -> list[Process]:
    """Of those, the ones whose parent is init: nothing of the session will wait for them."""
    return [p for p in made_by(session, before) if p.ppid == 1]


def end(found: list[Process]) -> list[str]:
    """SIGKILL each; one line for each that was running: its pid, state, wait channel, command."""
    lines = []
    for p in found:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        lines.append(f"pid {p.pid} (parent {p.ppid}, group {p.pgid}, {p.state} in {p.wchan}): "
                     f"{' '.join(p.command.split())[:160]}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p.pid) for p in found):
        time.sleep(0.1)
    return lines


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------- Python stacks (py-spy)

def py_spy() -> str:
    """py-spy's binary: on PATH (lanes.sh puts /tmp/site-tools/bin there), else beside a
    PYTHONPATH folder it was installed into with ``pip --target``; empty when there is none."""
    found = shutil.which("py-spy")
    if found:
        return found
    for folder in os.environ.get("PYTHONPATH", "").split(":"):
        candidate = os.path.join(folder, "bin", "py-spy")
        if folder and os.access(candidate, os.X_OK):
            return candidate
    return ""


def dump_stacks(found: list[Process], path: str) -> None:
    """Every Python thread's stack of each process, as py-spy reads it from outside."""
    spy = py_spy()
    with open(path, "w") as f:
        if not spy:
            f.write("no py-spy here: no stacks\n")
            return
        for p in found:
            if "python" not in p.command.split(" ", 1)[0]:
                continue
            f.write(f"=== pid {p.pid} (parent {p.ppid}, {p.state} in {p.wchan})\n")
            f.flush()
            done = subprocess.run([spy, "dump", "--pid", str(p.pid)], stdout=f,
                                  stderr=subprocess.STDOUT, timeout=30, check=False)
            if done.returncode:
                f.write(f"(py-spy exit {done.returncode})\n")


def runs_script(command: str, script: str) -> bool:
    """Whether a command line runs ``script`` itself: its first word after the interpreter and
    its options ends with it. Launchers that merely pass the script on (``accelerate launch ...
    main.py``, the launcher's stand-ins) hold it too, but only as a later word, and they sleep
    while the step trains."""
    words = command.split()
    first = next((w for w in words[1:] if not w.startswith("-")), "")
    return first == script or first.endswith("/" + script)


class Sampler(threading.Thread):
    """Samples one step's Python stacks for a while: the first process of the session that runs
    the script ``pattern`` (see ``runs_script``), from ``delay`` s after it appears, for
    ``seconds`` s (``py-spy record --format raw``: one line per distinct stack and its sample
    count)."""

    def __init__(self, session: str, before: set[int], pattern: str, delay: float,
                 seconds: float, out: str) -> None:
        super().__init__(daemon=True)
        self.session, self.before, self.pattern = session, before, pattern
        self.delay, self.seconds, self.out = delay, seconds, out
        self.stopped = threading.Event()
        self.note = ""

    def run(self) -> None:
        spy = py_spy()
        if not spy:
            self.note = "no py-spy here: nothing sampled"
            return
        while not self.stopped.wait(1):
            step = next((p for p in made_by(self.session, self.before)
                         if runs_script(p.command, self.pattern)), None)
            if step is not None:
                break
        else:
            return
        if self.stopped.wait(self.delay):
            return
        done = subprocess.run([spy, "record", "--pid", str(step.pid), "--duration",
                               f"{self.seconds:.0f}", "--rate", "50", "--format", "raw",
                               "--nonblocking", "--output", self.out],
                              capture_output=True, text=True, check=False)
        self.note = (f"pid {step.pid} ({' '.join(step.command.split())[:80]}), from "
                     f"{self.delay:.0f} s after it appeared, {self.seconds:.0f} s"
                     + (f"; py-spy exit {done.returncode}: {done.stderr.strip()[-200:]}"
                        if done.returncode else ""))


def top_frames(raw: str, count: int = 15) -> list[str]:
    """From py-spy's raw output: the functions most samples were in (the innermost frame) and
    the functions most samples passed through, each with its share of the samples."""
    own: dict[str, int] = {}
    through: dict[str, int] = {}
    total = 0
    with open(raw) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            samples = int(n)
            total += samples
            frames = stack.split(";")
            own[frames[-1]] = own.get(frames[-1], 0) + samples
            for frame in set(frames):
                through[frame] = through.get(frame, 0) + samples
    if not total:
        return ["no samples"]
    lines = [f"{total} samples; innermost frames:"]
    lines += [f"  {n / total:6.1%}  {frame[:150]}" for frame, n in
              sorted(own.items(), key=lambda kv: -kv[1])[:count]]
    lines.append("frames the samples passed through:")
    lines += [f"  {n / total:6.1%}  {frame[:150]}" for frame, n in
              sorted(through.items(), key=lambda kv: -kv[1])[:count]]
    return lines
