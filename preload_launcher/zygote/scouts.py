"""Scouts: on a package set seen for the first time, one forked child per preload entry imports
that entry alone, ahead of the zygote, and streams what it passed.

A scout reports a checkpoint at the start and at the end of every import that runs new code
(``s <key>`` / ``e <key>``), each only after checking that the process is still fit to fork;
at the first checkpoint where it is not (the driver initialised, a Python thread started) it
stops and sends its report (``r <json>``), naming the culprit and its chain. The zygote imports
the same entry at the same time and trails its scout checkpoint by checkpoint
(``Follower``): it runs code only once the scout has run it cleanly, and it enters a new
top-level package of another distribution only once the scout finished importing it — so a
culprit to defer is found before the zygote ever starts it, and the zygote blocks it instead.
Without streaming, the zygote waited for the whole entry (the culprit included) before
starting it. A scout that dies without a report (a segfault at import) quarantines its entry.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import sys
import threading
from dataclasses import asdict
from typing import Callable, Optional

from ..result import signal_name
from ..step import runtime
from .crashes import crash_verdict

__all__ = ["Scouts", "ScoutStream", "Reporter", "Follower", "Abandon", "new_code", "checkpoint_key"]

TIMEOUT_S = 300.0  # a scout that says nothing for this long is killed, and not waited for
PIPE_SIZE = 1 << 20  # room for a whole entry's checkpoints: a scout never waits for the zygote


class Abandon(BaseException):
    """Raised in the zygote inside an entry's import: its scout found that the entry must go
    (a culprit the zygote can no longer block, or a crash). Not an ``Exception``: library
    guards (``except Exception``) must not swallow it."""

    def __init__(self, key: str, verdict: dict) -> None:
        super().__init__(key)
        self.key, self.verdict = key, verdict


class _Stop(BaseException):
    """Raised in a scout at its first unfit checkpoint: nothing after it needs importing."""


def checkpoint_key(label: str, fromlist) -> str:
    return f"{label}:{','.join(fromlist)}" if fromlist else label


def _modules_of(key: str) -> list[str]:
    """The modules an import statement's checkpoint key names (``pkg:a,b``: pkg, pkg.a, pkg.b;
    a name that is an attribute, not a module, is harmless here)."""
    label, _, names = key.partition(":")
    return [label] + [f"{label}.{name}" for name in names.split(",") if name and name != "*"]


def new_code(label: str, fromlist) -> bool:
    """Would ``__import__(label, fromlist=...)`` run module code not run before?"""
    module = sys.modules.get(label)
    if module is None:
        return True
    return any(name != "*" and not hasattr(module, name) and f"{label}.{name}" not in sys.modules
               for name in fromlist or ())


class Reporter:
    """The scout's side: a checkpoint is reported once the process is still fit at it."""

    def __init__(self, fd: int, probe) -> None:
        self.fd = fd
        self.probe = probe

    def checkpoint(self, kind: str, key: str, hook) -> None:
        if self.probe.initialized() or threading.active_count() > 1:
            if not hook.culprit:  # dirtied by module code between two imports
                hook.culprit = hook.stack[-1] if hook.stack else key.split(":")[0]
                hook.chain = list(hook.stack) or [hook.culprit]
            raise _Stop()
        os.write(self.fd, f"{kind} {key}\n".encode())


class ScoutStream:
    """The zygote's view of one scout: the checkpoints it passed (in order), its report."""

    def __init__(self, module: str, pid: int, fd: int) -> None:
        self.module, self.pid, self.fd = module, pid, fd
        self.seen: dict[str, int] = {}  # "s key"/"e key" -> order of its first report
        self.ended: set[str] = set()  # modules whose import the scout finished cleanly
        self.count = 0
        self.report: Optional[dict] = None  # the EntryReport, as sent
        self.verdict: Optional[dict] = None  # set when it died without a report
        self.finished = False
        self._buffer = b""

    def passed(self, checkpoint: str, beyond: bool) -> bool:
        """Has the scout passed ``checkpoint`` (and, with ``beyond``, the next one too)?"""
        index = self.seen.get(checkpoint)
        return index is not None and (not beyond or index < self.count - 1)

    def read(self, wait: Optional[float]) -> None:
        """Take in what the scout sent; ``wait``: seconds to wait for something (0: none)."""
        if self.finished:
            return
        if wait != 0 and not select.select([self.fd], [], [], wait)[0]:
            self.end(killed=True)  # silent for too long
            return
        try:
            chunk = os.read(self.fd, PIPE_SIZE)
        except BlockingIOError:
            return
        if not chunk:
            self.end(killed=False)
            return
        lines = (self._buffer + chunk).split(b"\n")
        self._buffer = lines.pop()
        for line in lines:
            kind, _, rest = line.decode().partition(" ")
            if kind == "r":
                self.report = json.loads(rest)
            else:
                self.seen.setdefault(line.decode(), self.count)
                self.count += 1
                if kind == "e":
                    self.ended.update(_modules_of(rest))

    def end(self, killed: bool) -> None:
        """Reap the scout; one that died without a report, not killed by us, crashed."""
        if self.finished:
            return
        self.finished = True
        os.close(self.fd)
        runtime.signal_group(self.pid, signal.SIGKILL)
        _, status = os.waitpid(self.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if self.report is None and not killed and code != 0:
            how = (f"{signal_name(-code)}: {signal.strsignal(-code)}" if code < 0
                   else f"exit status {code}")
            self.verdict = crash_verdict(self.module, how)


class Scouts:
    """One scout per entry, forked before the zygote imports any of them."""

    def __init__(self, modules: list[str], import_entry: Callable, probe, blocker) -> None:
        self.streams: dict[str, ScoutStream] = {}
        for module in modules:
            report_r, report_w = os.pipe()
            try:
                fcntl.fcntl(report_w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
            except OSError:
                pass  # the default size: a scout may wait for the zygote to read

            def scout(module=module, report_r=report_r, report_w=report_w) -> int:
                os.close(report_r)
                runtime.die_with_parent()
                entry = import_entry(module, probe, blocker, Reporter(report_w, probe))
                os.write(report_w, b"r " + json.dumps(asdict(entry)).encode() + b"\n")
                return 0

            pid = runtime.fork(scout)
            os.close(report_w)
            os.set_blocking(report_r, False)
            self.streams[module] = ScoutStream(module, pid, report_r)

    def stream(self, module: str) -> Optional[ScoutStream]:
        return self.streams.get(module)

    def drain(self) -> None:
        """Read what every scout sent so far, so none waits on a full pipe."""
        for stream in self.streams.values():
            stream.read(0)

    def close(self) -> None:
        for stream in self.streams.values():
            stream.end(killed=True)


class Follower:
    """The zygote's side of one entry's import: each checkpoint waits for the scout to have
    passed it (``Reporter``); the scout's report, when it comes, goes to ``on_report``, which
    blocks a culprit the zygote has not reached, or raises ``Abandon``."""

    def __init__(self, scouts: Scouts, stream: ScoutStream, entry_package: str,
                 on_report: Callable[[ScoutStream], None]) -> None:
        self.scouts, self.stream = scouts, stream
        self.entry_package = entry_package
        self.on_report = on_report
        self.settled = False  # the scout is done; the zygote imports on its own from here

    def checkpoint(self, kind: str, key: str, hook) -> None:
        if self.settled:
            return
        modules = _modules_of(key)
        top = modules[0].partition(".")[0]
        if kind == "s" and top != self.entry_package and top not in sys.modules:
            ready = lambda: self.stream.ended.issuperset(modules)  # noqa: E731
        elif kind == "s":  # (the scout may have reached the modules by another statement)
            ready = lambda: (self.stream.passed(f"s {key}", beyond=True)  # noqa: E731
                             or self.stream.ended.issuperset(modules))
        else:
            ready = lambda: self.stream.passed(f"e {key}", beyond=True)  # noqa: E731
        self.scouts.drain()
        while not ready() and not self.stream.finished and self.stream.report is None:
            self.stream.read(TIMEOUT_S)
        if self.stream.report is not None or self.stream.finished:
            self.settle()

    def settle(self) -> None:
        """The scout reported (or died): act on it once, then follow no more."""
        if not self.settled:
            self.settled = True
            self.stream.end(killed=self.stream.report is not None)
            self.on_report(self.stream)
