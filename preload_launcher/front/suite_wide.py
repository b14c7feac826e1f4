"""Suite-wide serving: every interpreter a test process starts, however it starts it, is forked
by the session's zygote (``PRELOAD_LAUNCHER=suite``, ``--preload-launcher-suite`` or the
``preload_launcher_suite`` ini key; the pytest plugin installs it).

The test process keeps its own ``sys.executable``, ``PATH`` and environment; only where its
launches go changes, and each goes through a stand-in (``standin``), which asks the zygote to
fork the command or runs the real program, fds, exit status and signals included:

* ``subprocess`` (and what is built on it: ``os.popen``, ``asyncio``, any helper): a program
  that starts this interpreter, under any name (``sys.executable``, ``python3``, a console
  script such as ``torchrun`` or ``accelerate``), runs the stand-in told the real program and
  its ``argv[0]``; any other program but another python (a shell script, ``sh -c``, ``make``)
  gets the stand-ins first on its ``PATH``, as a shell step of ``run()`` does;
* ``os.system``: its shell gets the stand-ins first on its ``PATH``;
* ``multiprocessing`` ``spawn``/``forkserver`` children and its resource tracker run the
  stand-in (as inside steps), so a worker pool started by a test costs a fork.

The launcher's own launches (a plain step of ``run()``, a zygote, a probe) are never redirected.
"""

from __future__ import annotations

import inspect
import os
import shlex
import subprocess
import sys
import threading
from typing import Optional

from .. import settings, standin
from ..command import _same_file_and_dir, _shebang_interpreter, console_script_interpreter

__all__ = ["install", "uninstall", "counts"]

_original_execute_child = subprocess.Popen._execute_child
# Its parameters after ``env``, by name (``shell``, ``gid``, ``gids``, ``uid``, …).
_REST_PARAMETERS = list(inspect.signature(_original_execute_child).parameters)[8:]
_original_system = os.system
_lock = threading.Lock()
_launcher = None  # the session's Launcher while installed
_spawn_executable_before: Optional[str] = None
_counts = {"interpreters": 0, "with_standins": 0}


def install(launcher) -> None:
    """Redirect this process's launches to ``launcher``'s zygote until ``uninstall``."""
    global _launcher, _spawn_executable_before
    import multiprocessing.resource_tracker
    import multiprocessing.spawn
    with _lock:
        _launcher = launcher
        subprocess.Popen._execute_child = _execute_child
        os.system = _system
        program = _standin_program(dict(os.environ))
        if program and _spawn_executable_before is None:
            # The test process's resource tracker is the real interpreter: it must outlive the
            # session's zygote, to unlink the shared memory and semaphores the tests leaked
            # once the test process ends (as it does without the launcher).
            multiprocessing.resource_tracker.ensure_running()
            _spawn_executable_before = multiprocessing.spawn.get_executable()
            multiprocessing.spawn.set_executable(program)


def uninstall() -> None:
    global _launcher, _spawn_executable_before
    import multiprocessing.spawn
    with _lock:
        _launcher = None
        subprocess.Popen._execute_child = _original_execute_child
        os.system = _original_system
        if _spawn_executable_before is not None:
            multiprocessing.spawn.set_executable(_spawn_executable_before)
            _spawn_executable_before = None


def counts() -> dict:
    """How many launches this process redirected: interpreters handed to a stand-in, and other
    programs given stand-ins on their PATH."""
    return dict(_counts)


def _count(kind: str) -> None:
    with _lock:
        _counts[kind] += 1


# ---------------------------------------------------------------- what a launch becomes

def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                   *rest):
    """``Popen._execute_child`` with the program, or its PATH, redirected (its positional
    parameters up to ``env`` are the same in Python 3.10-3.13; the rest are read by name). A
    launch that changes its identity (``user=``, ``group=``, ``extra_groups=``) runs the real
    program: the zygote's child would keep the zygote's, and a stand-in run as another user
    could not reach the zygote (its files are ours alone)."""
    named = dict(zip(_REST_PARAMETERS, rest))
    changes_identity = any(named.get(name) is not None for name in ("gid", "gids", "uid"))
    if _launcher is not None and not changes_identity and not _launched_by_launcher():
        try:
            executable, env = _redirect(args, executable, cwd, env, shell=named["shell"])
        except Exception:  # never the launch's undoing: it runs as it would have
            pass
    return _original_execute_child(self, args, executable, preexec_fn, close_fds, pass_fds,
                                   cwd, env, *rest)


def _system(command):
    """``os.system`` whose shell finds the stand-ins first on its PATH: the command runs in a
    shell started with that PATH, with the same status and signal handling as before."""
    if _launcher is None or _launched_by_launcher():
        return _original_system(command)
    path = _path_with_standins(dict(os.environ), os.getcwd())
    if path is None:
        return _original_system(command)
    _count("with_standins")
    text = os.fsdecode(command)
    # The shell that runs the command is /bin/sh called `sh`, as os.system's is (its messages
    # name it so); the PATH is set on the command's own first line (its line numbers stay).
    inner = f"PATH={shlex.quote(path)}; export PATH; {text}"
    return _original_system(f"PATH=/bin; exec sh -c {shlex.quote(inner)}")


def _redirect(args, executable, cwd, env, shell: bool):
    """(executable, env) for this launch: unchanged, the stand-in told the real program, or
    the program's PATH with stand-ins first."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if not argv:
        return executable, env
    program = executable or ("/bin/sh" if shell else argv[0])
    launch_env = dict(os.environ if env is None else env)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in launch_env.items()):
        return executable, env  # a bytes environment: left alone
    try:
        if not settings.Settings.from_env(launch_env).enabled:
            return executable, env  # PRELOAD_LAUNCHER=0 for this program: plain
    except settings.SettingsError:
        return executable, env  # the program's own business
    where = os.fsdecode(cwd) if cwd is not None else os.getcwd()
    found = _find(os.fsdecode(program), launch_env, where)
    if not found:
        return executable, env  # subprocess raises its own error
    kind = _kind_of(found)
    if kind == "this interpreter":
        runner = _standin_program(launch_env)
        if runner:
            _count("interpreters")
            launch_env[standin.STANDS_IN_FOR] = f"{found}\n{os.fsdecode(argv[0])}"
            return runner, launch_env
    elif kind == "other program":
        path = _path_with_standins(launch_env, where)
        if path is not None:
            _count("with_standins")
            return executable, {**launch_env, "PATH": path}
    return executable, env


def _find(program: str, env: dict, cwd: str) -> str:
    """The file ``subprocess`` would execute: a path taken from ``cwd``, a name from the
    launch's PATH (the first executable file, as ``execvpe`` tries them)."""
    if os.sep in program:
        found = os.path.join(cwd, program)
        return found if os.path.isfile(found) and os.access(found, os.X_OK) else ""
    for entry in os.get_exec_path(env):
        candidate = os.path.join(cwd, entry, program)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return ""


def _kind_of(path: str) -> str:
    """"this interpreter" (the same executable in the same folder, or a console script of it,
    by the rule the zygote serves them by), "another python" (left alone: its programs are not
    ours to serve), or "other program"."""
    if _same_file_and_dir(path, sys.executable) or console_script_interpreter(path):
        return "this interpreter"
    name = os.path.basename(_shebang_interpreter(path) or path)
    return "another python" if name.startswith("python") else "other program"


def _standin_program(env: dict) -> str:
    """The stand-in of the zygote that serves ``env``'s interpreters ("" when none may run)."""
    try:
        zygote = _launcher.zygote_for_standins(env)
    except Exception:  # no zygote (no private directory, a failed start): the real program
        return ""
    program = zygote.standins
    return program if program and standin.trusted(program) else ""


def _path_with_standins(env: dict, cwd: str) -> Optional[str]:
    try:
        return _launcher.zygote_for_standins(env).path_for(env, cwd)
    except Exception:
        return None


def _launched_by_launcher() -> bool:
    """Whether this launch comes from the launcher's own code (a plain step, a zygote, a probe)
    or starts pytest-xdist's workers (execnet): never redirected. A worker is the suite's own
    machinery, a long-lived pytest process, not a program a test starts; it uses the
    controller's zygote for its tests' launches. The first caller outside the standard
    library's launching modules decides (the whole stack would not: in a forked program it
    starts in the zygote's code)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if name not in LAUNCHING_MODULES and not name.startswith("asyncio."):
            return name.startswith(NEVER_REDIRECTED)
        frame = frame.f_back
    return False


NEVER_REDIRECTED = ("preload_launcher.", "execnet.")


LAUNCHING_MODULES = ("subprocess", "os", __name__)  # and asyncio's
