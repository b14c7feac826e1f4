"""``preload-launcher run``: the command through the daemon for its preload set, or, with none,
as a plain process that may start one for the next run.

Without a daemon, this module runs the command with the standard library only (the client is
imported when a zygote runs the step: ``cli_step``), so a one-off ``run`` costs little more
than the command itself.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
from typing import Optional, Sequence

from .. import settings
from ..mirroring import Mirror, die_like
from ..result import LauncherError
from .daemon_files import daemon_paths, list_daemons, pid_alive

__all__ = ["cmd_run", "worth_a_daemon", "MIN_CPU_S"]

# A command that used less CPU than this (its own and its children's) gains little from a
# preload, and one that failed to start gains nothing: no daemon is started after either.
MIN_CPU_S = 1.0
NOT_STARTED = (126, 127)  # a shell's codes for a command that could not be executed
WATCH_S = 0.05  # how often the watcher of a command run in its place reads its CPU time
# (the last moments of a command may go uncounted: its entry is gone once its caller reaps it)
# What a terminal sends to its whole foreground process group: a command in our group gets
# them itself, so they are not relayed to it (it would get them twice).
TERMINAL_SIGNALS = {signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGTTIN,
                    signal.SIGTTOU, signal.SIGCONT, signal.SIGWINCH}


def say(args: argparse.Namespace, how: str) -> None:
    if args.verbose:
        print(f"[preload-launcher] ran through {how}", file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    if not args.command:
        print("preload-launcher run: no command given (use: run -- python script.py …)",
              file=sys.stderr)
        return 2
    modules = settings.preload_modules(args.preload)
    wanted = settings.Settings.from_env()
    try:
        if not args.no_daemon and wanted.autoserve and not _daemon_known(modules):
            return end_as(_run_plain_first(args, modules, wanted))
        step = importlib.import_module(f"{__package__}.cli_step")
        return end_as(step.run_forked(args, modules, settings.preload_source(args.preload)))
    except LauncherError as err:  # no private directory, a daemon that cannot start
        print(f"preload-launcher run: {err}; running the command as a plain process",
              file=sys.stderr)
        if args.timeout is None:
            return become(args.command)
        return end_as(run_plain(args.command, args.timeout)[0])


def end_as(returncode: int) -> int:
    """The command's exit code, or, when a signal ended it, the same death for this process:
    its caller (a shell's loop, ``subprocess``) sees what it would have seen of the command."""
    if returncode < 0:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        die_like(returncode)
    return returncode


def _daemon_known(modules: Sequence[str]) -> bool:
    """A daemon of this interpreter and preload set was started (it may be gone: ``cli_step``
    replaces it)."""
    return os.path.exists(daemon_paths(modules)[1])


def other_daemons(modules: Sequence[str]) -> str:
    """'pid N preloads a,b; …' for this user's live daemons of another preload set or
    interpreter."""
    mine = daemon_paths(modules)[0]
    found = [(meta["pid"], meta["modules"]) for meta in list_daemons()
             if meta.get("socket") != mine and pid_alive(meta["pid"])]
    return "; ".join(f"pid {pid} preloads {','.join(mods)}" for pid, mods in found)


def _run_plain_first(args: argparse.Namespace, modules: Sequence[str],
                     wanted: settings.Settings) -> int:
    """No daemon: the step first, alone (a daemon preloading beside it would slow it down),
    then a daemon for the next run when the step was worth one."""
    others = other_daemons(modules)
    if others:
        print(f"preload-launcher: no daemon preloads {','.join(modules)}; running: {others} "
              "(use --preload to pick one)", file=sys.stderr)
    if args.timeout is None and hasattr(os, "pidfd_open"):
        return _become_watched(args, modules, wanted)
    code, cpu_s = run_plain(args.command, args.timeout)
    _after_plain(args, modules, wanted.idle_timeout_s, code, cpu_s)
    return code


def _after_plain(args: argparse.Namespace, modules: Sequence[str], idle_timeout_s: float,
                 code: int, cpu_s: float) -> None:
    """After a plain run: a daemon for the next one, when this one was worth it."""
    listed = ",".join(modules)
    worth, why_not = worth_a_daemon(code, cpu_s)
    if not worth:
        say(args, f"a plain process: no daemon preloads {listed}; none started ({why_not})")
        return
    daemon = importlib.import_module(f"{__package__}.daemon")
    if daemon.spawn_daemon(modules, args.command):
        print(f"preload-launcher: started a daemon preloading {listed} in the background; the "
              f"next runs are forked from it. {_lifetime(idle_timeout_s)}", file=sys.stderr)
        say(args, f"a plain process: no daemon preloaded {listed} yet")
    else:
        say(args, f"a plain process: no daemon preloads {listed}; one is starting already")


def become(command: list[str]) -> int:
    """Run the command in this process (``exec``), as a shell's ``exec`` would: its pid, its
    signals, its stops and its death are this process's own. Returns only when it could not
    be started (127 or 126, with the shell's one-line message)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # Python ignores these for itself; a command started from a shell has them at default.
    for signum in (signal.SIGPIPE, getattr(signal, "SIGXFSZ", signal.SIGPIPE)):
        signal.signal(signum, signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except OSError as err:
        for signum in (signal.SIGPIPE, getattr(signal, "SIGXFSZ", signal.SIGPIPE)):
            signal.signal(signum, signal.SIG_IGN)
        print(f"preload-launcher run: {command[0]}: {err.strerror}", file=sys.stderr)
        return 127 if isinstance(err, FileNotFoundError) else 126


def _become_watched(args: argparse.Namespace, modules: Sequence[str],
                    wanted: settings.Settings) -> int:
    """The command replaces this process (``become``); a watcher started beside it, in a
    session of its own and holding none of the caller's fds but stderr, measures the CPU the
    command uses and starts a daemon once it ended, when it was worth one."""
    pid = os.getpid()
    program = os.pidfd_open(pid)  # taken now: the pid cannot be reused while it is open
    failed_r, failed_w = os.pipe()  # close-on-exec: EOF tells the watcher the exec succeeded
    job = {"pid": pid, "program": program, "failed": failed_r, "before": _cpu_ticks(pid) or 0,
           "modules": list(modules), "verbose": args.verbose, "command": args.command,
           "idle_timeout_s": wanted.idle_timeout_s}
    # `sh -c '… &'` leaves the watcher in the background and ends at once: the watcher is never
    # the command's child (a command waiting for all its children would wait for it forever).
    subprocess.run(["/bin/sh", "-c", '"$@" &', "sh", sys.executable, "-m", __name__,
                    json.dumps(job)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   pass_fds=(program, failed_r), start_new_session=True)
    os.close(program)
    os.close(failed_r)
    code = become(args.command)
    os.write(failed_w, b"x")
    return code


def _watch(job: dict) -> None:
    """The watcher: until the command ends, its CPU time (its own and its waited-for
    children's) read every ``WATCH_S``; then a daemon when it was worth one."""
    if os.read(job["failed"], 1):
        return  # it could not be started: nothing to measure
    ticks = job["before"]
    while True:
        ended = select.select([job["program"]], [], [], WATCH_S)[0]
        ticks = _cpu_ticks(job["pid"]) or ticks  # a reaped command has no /proc entry left
        if ended:
            break
    cpu_s = (ticks - job["before"]) / os.sysconf("SC_CLK_TCK")
    _after_plain(argparse.Namespace(verbose=job["verbose"], command=job["command"]),
                 job["modules"], job["idle_timeout_s"], 0, cpu_s)


def _cpu_ticks(pid: int) -> Optional[int]:
    """utime + stime + cutime + cstime of ``pid``, in clock ticks (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return sum(int(field) for field in fields[11:15])


def _lifetime(idle_timeout_s: float) -> str:
    stop = "`preload-launcher stop` stops it now"
    if not idle_timeout_s:
        return f"It runs until stopped: {stop}."
    idle = (f"{idle_timeout_s / 60:g} idle minutes" if idle_timeout_s >= 60
            else f"{idle_timeout_s:g} idle seconds")
    return f"It stops after {idle}; {stop}."


def worth_a_daemon(returncode: int, cpu_s: float) -> tuple[bool, str]:
    """(start a daemon after this command?, why not)."""
    if returncode in NOT_STARTED:
        return False, "the command could not be started"
    if cpu_s < MIN_CPU_S:
        return False, f"the command used {cpu_s:.2f} s of CPU: a preload would not pay"
    return True, ""


def run_plain(command: list[str], timeout: Optional[float]) -> tuple[int, float]:
    """The command as a child in this process's group (a terminal's signals reach it there),
    killed after ``timeout``; any other signal this process gets is relayed to it. Returns its
    exit status and the CPU time it (and the children it waited for) used."""
    before = _children_cpu_s()
    mirror = Mirror()  # in place before the command runs: it may say it is ready at once
    mirror.install(skip=TERMINAL_SIGNALS)
    try:
        proc = subprocess.Popen(command)
    except OSError as err:
        mirror.uninstall()
        print(f"preload-launcher run: {command[0]}: {err.strerror}", file=sys.stderr)
        return (127 if isinstance(err, FileNotFoundError) else 126), 0.0
    mirror.relay_to(proc.send_signal)
    quit_before = signal.signal(signal.SIGQUIT, signal.SIG_IGN)  # the command's to act on
    try:
        code = proc.wait(timeout=timeout)
    except KeyboardInterrupt:
        code = proc.wait()
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        print(f"preload-launcher run: timed out after {timeout} s", file=sys.stderr)
        code = 124
    finally:
        mirror.uninstall()
        signal.signal(signal.SIGQUIT, quit_before)
    return code, _children_cpu_s() - before


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":  # the watcher of a command run in the CLI's place
    _watch(json.loads(sys.argv[1]))
