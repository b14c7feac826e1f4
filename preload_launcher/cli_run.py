"""``preload-launcher run``: the command through the daemon for its preload set, or, with none,
as a plain process that may start one for the next run.

Without a daemon, this module runs the command with the standard library only (the client is
imported when a zygote runs the step: ``cli_step``), so a one-off ``run`` costs little more
than the command itself.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import subprocess
import sys
from typing import Optional, Sequence

from . import settings
from .daemon_files import daemon_paths, list_daemons, pid_alive
from .result import LauncherError

__all__ = ["cmd_run", "exit_status", "worth_a_daemon", "MIN_CPU_S"]

# A command that used less CPU than this (its own and its children's) gains little from a
# preload, and one that failed to start gains nothing: no daemon is started after either.
MIN_CPU_S = 1.0
NOT_STARTED = (126, 127)  # a shell's codes for a command that could not be executed


def exit_status(returncode: int) -> int:
    """A shell's convention: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


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
            return _run_plain_first(args, modules, wanted)
        step = importlib.import_module(f"{__package__}.cli_step")
        return exit_status(step.run_forked(args, modules, settings.preload_source(args.preload)))
    except LauncherError as err:  # no private directory, a daemon that cannot start
        print(f"preload-launcher run: {err}; running the command as a plain process",
              file=sys.stderr)
        return exit_status(run_plain(args.command, args.timeout)[0])


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
    code, cpu_s = run_plain(args.command, args.timeout)
    listed = ",".join(modules)
    worth, why_not = worth_a_daemon(code, cpu_s)
    if not worth:
        say(args, f"a plain process: no daemon preloads {listed}; none started ({why_not})")
        return exit_status(code)
    daemon = importlib.import_module(f"{__package__}.daemon")
    if daemon.spawn_daemon(modules):
        print(f"preload-launcher: started a daemon preloading {listed} in the background; the "
              f"next runs are forked from it. {_lifetime(wanted.idle_timeout_s)}", file=sys.stderr)
        say(args, f"a plain process: no daemon preloaded {listed} yet")
    else:
        say(args, f"a plain process: no daemon preloads {listed}; one is starting already")
    return exit_status(code)


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
    """The command as the shell would run it: same terminal, same process group (Ctrl-C
    reaches it), but killed with its group after ``timeout``. Returns its exit status and the
    CPU time it (and the children it waited for) used."""
    before = _children_cpu_s()
    try:
        proc = subprocess.Popen(command)
    except OSError as err:
        print(f"preload-launcher run: {command[0]}: {err.strerror}", file=sys.stderr)
        return (127 if isinstance(err, FileNotFoundError) else 126), 0.0
    try:
        code = proc.wait(timeout=timeout)
    except KeyboardInterrupt:
        code = proc.wait()
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        print(f"preload-launcher run: timed out after {timeout} s", file=sys.stderr)
        code = 124
    return code, _children_cpu_s() - before


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime

