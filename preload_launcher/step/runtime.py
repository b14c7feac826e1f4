"""The forked-process runtime: one way to fork, one set-up, one way to end.

Every process the zygote family forks (a step, a pre-warmed child, a torchrun agent, a rank)
starts in ``fork``, becomes its step through ``set_up`` and ends through ``exit_with`` — after
``finish`` for a process that ran user code: what a program can observe of its own shutdown
(threads joined, ``atexit``, output flushed), an exit report to whoever waits for it, then
``os._exit``, skipping the seconds of module teardown a loaded stack costs.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import gc
import os
import resource
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable, NoReturn, Optional

from .. import interpreter, mirroring, process_attrs, protocol
from ..command import StepSpec
from ..settings import Settings
from ..zygote import deferral, threads
from . import import_effects, native_env, proc_view, program_exit
from .program_exit import exit_status_of

__all__ = ["ZygoteState", "fork", "set_up", "keep_for_exit_report", "report_exit", "finish",
           "become_fresh", "tell_caller",
           "exit_with", "exit_status_of", "die_with_parent", "close_fds"]

PR_SET_PDEATHSIG = 1
REPORT_FD_MIN = 100  # the exit report's fd sits above the fds a program usually opens
REPORT_FD_CAP = 1024  # ... at the top of the fd range, or of the first 1024 numbers (select's)

_report_fd: Optional[int] = None  # where this process reports its exit code (see report_exit)
_report_pid = 0  # the process that owns it: a fork of the step inherits the fd, not the duty
_report_identity = (0, 0)  # its (st_dev, st_ino): the program may have replaced the fd since
# The environment the step was started with, as its caller gave it (``rerun`` starts a fresh
# interpreter with it).
start_env: dict[str, str] = {}


@dataclass
class ZygoteState:
    """What a forked process needs from the zygote to look like a fresh interpreter."""

    base_path: list[str]  # sys.path of a fresh interpreter, without sys.path[0]
    signal_handlers: dict[int, object]  # dispositions right after preload
    zygote_fds: list[int] = field(default_factory=list)  # to close in the child
    # Variables the preloaded modules set while importing (a fresh import would set them too).
    env_set_by_preload: dict[str, str] = field(default_factory=dict)
    learn_reports_dir: str = ""  # where a step reports the modules it imported ("" = off)
    project: str = ""
    spawn_executable: str = ""  # the spawn proxy multiprocessing runs instead of python
    prewarm_cuda: str = "context"  # what a pre-warmed child makes ahead (settings)
    deferred: dict[str, list[dict]] = field(default_factory=dict)  # package -> cut imports
    socket_path: str = ""  # the zygote's own: where this process's programs find it again
    # What python's start-up code (.pth files, sitecustomize) set (None: deleted) in the zygote;
    # it agreed with the step on every variable that code read, so a fresh start does the same.
    env_set_at_startup: dict[str, Optional[str]] = field(default_factory=dict)


# ---------------------------------------------------------------- fork and exit

def fork(body: Callable[[], int], new_group: bool = True, new_session: bool = False) -> int:
    """Fork; the child runs ``body`` and ends with its exit code, whatever happens. Returns the
    child's pid. ``new_group``: the child leads its own process group, set on both sides so a
    ``killpg`` right after the fork cannot miss it (ranks stay in their agent's group).
    ``new_session``: it leads a session of its own instead (and so a group): set by the child
    alone, as a group leader cannot start a session."""
    flush_std_streams()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if new_session:
                os.setsid()
            elif new_group:
                os.setpgid(0, 0)
            code = body()
        except BaseException:
            traceback.print_exc()
        finally:
            exit_with(code)
    if new_group and not new_session:
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
    return pid


def exit_with(code: int) -> NoReturn:
    """``os._exit`` for codes >= 0; a negative code -N ends the process by signal N, as the
    parent's ``waitpid`` then reports it (``mirroring.die_like``: a process standing for a
    program ends the same way)."""
    mirroring.die_like(code)


def flush_std_streams() -> bool:
    """Flush ``sys.stdout`` and ``sys.stderr`` (closed ones left alone); False when one could
    not be flushed."""
    return program_exit.flush_std_streams()


def finish(code: int, program_threads: Optional[bool] = None) -> int:
    """Python's shutdown minus the preloaded modules' teardown: join threads, atexit, flush,
    end ``__main__``'s objects, flush again, report. Returns the exit code for ``exit_with``:
    120 when flushing the output failed, as python does (a code < 0, death by signal, wins).
    ``program_threads``: whether the program had imported threading when it ended (read then,
    before the launcher's own work at exit could import it; default: now)."""
    # python runs these traced (``program_exit``); it waits for threads only where the
    # program imported threading (its _shutdown is then the program's to see)
    if program_threads is None:
        program_threads = "threading" in sys.modules
    if program_threads:
        sys.settrace(program_exit.tracing[0])
        sys.setprofile(program_exit.tracing[1])
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        sys.settrace(None)
        sys.setprofile(None)
        traceback.print_exc()
    sys.settrace(program_exit.tracing[0])
    sys.setprofile(program_exit.tracing[1])
    atexit._run_exitfuncs()
    program_exit.tracing = (sys.gettrace(), sys.getprofile())
    sys.settrace(None)
    sys.setprofile(None)
    flushed = program_exit.flush_std_streams(report=True)
    program_exit.end_main_module()
    program_exit.restore_std_streams()
    flushed = program_exit.flush_std_streams(report=flushed) and flushed  # python says it once
    if not flushed and code >= 0:
        code = program_exit.FLUSH_FAILED
    report_exit(code)
    return code


# ---------------------------------------------------------------- the exit report

def keep_for_exit_report(fd: int) -> None:
    """Keep ``fd`` (the caller's connection, or a rank's line to its agent) to report the exit
    code on: moved to the top of the fd range, out of the program's way, and closed on exec,
    so spawned programs lack it. A program that closes or replaces it anyway (``dup2`` onto
    it, ``closerange``) is noticed at exit: its file is left alone and the reaper reports."""
    global _report_fd, _report_pid, _report_identity
    if _report_fd is not None:  # a rank forked by its agent: the agent's line is not ours
        os.close(_report_fd)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    top = min(soft if soft != resource.RLIM_INFINITY else REPORT_FD_CAP, REPORT_FD_CAP) - 1
    try:
        _report_fd = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, max(top, REPORT_FD_MIN))
    except OSError:  # the top is taken: the lowest free number above the usual ones
        _report_fd = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, REPORT_FD_MIN)
    _report_identity = _identity(_report_fd)
    _report_pid = os.getpid()
    os.close(fd)


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def report_exit(code: int) -> None:
    """Report the exit code now, before the kernel tears the process down (with a CUDA context,
    ~0.2 s the caller need not wait for). The step's output is closed first, so the caller has
    all of it once the report arrives. A process that dies without reporting (or whose report
    fd the program replaced) is reported by whoever reaps it."""
    global _report_fd
    if _report_fd is None or os.getpid() != _report_pid:
        return
    fd, _report_fd = _report_fd, None
    try:
        ours = _identity(fd) == _report_identity
    except OSError:
        ours = False
    if not ours:
        return
    close_step_output(keep=fd)
    protocol.send_event(fd, "exit", returncode=code)
    os.close(fd)


def tell_caller(event: str, **fields) -> None:
    """An event for whoever waits for this process's exit report (``fresh``)."""
    if _report_fd is not None and os.getpid() == _report_pid:
        try:
            protocol.send_event(_report_fd, event, **fields)
        except OSError:
            pass


def become_fresh(executable: str, argv: list[str], env: dict[str, str], reason: str) -> NoReturn:
    """Become a fresh interpreter (``rerun``): say so to whoever waits for the exit report,
    then ``execve``. The report fd closes on exec; the reaper reports the exit."""
    tell_caller("fresh", reason=reason)
    os.execve(executable, argv, env)


def close_step_output(keep: int) -> None:
    """Close fds 0-2 and every other fd on the same pipes, so the reader sees EOF now."""
    pipes = set()
    for fd in (0, 1, 2):
        try:
            st = os.fstat(fd)
            pipes.add((st.st_dev, st.st_ino))
            os.close(fd)
        except OSError:
            pass
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if fd != keep and (st.st_dev, st.st_ino) in pipes:
            os.close(fd)


# ---------------------------------------------------------------- set-up

def signal_group(pgid: int, signum: int) -> None:
    """``killpg`` that does not mind a group already gone (or not ours any more)."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the forking process dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def restore_signals(handlers: dict[int, object]) -> None:
    signal.set_wakeup_fd(-1)
    for signum, handler in handlers.items():
        try:
            signal.signal(signum, handler)
        except (OSError, ValueError, TypeError):
            pass


def attach_fds(fds: list[int], targets: list[int]) -> None:
    """Install received fds at the numbers the program expects (``targets``; 0-2 are stdio),
    keeping the Python stream objects: loggers created during preload hold ``sys.stderr``."""
    flush_std_streams()
    if not fds:
        return
    # Out of the way first: a received fd may sit on another one's target number.
    floor = max([*fds, *targets]) + 1
    parked = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]
    close_fds(set(fds))
    for fd, target in zip(parked, targets):
        os.dup2(fd, target)
    close_fds(parked)


def close_unpassed_stdio(targets: list[int]) -> None:
    """Fds 0-2 the caller had closed are closed in the step too, and their streams are None,
    as in a fresh interpreter started without them."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        if fd not in targets:
            close_fds([fd])
            setattr(sys, name, None)
            setattr(sys, f"__{name}__", None)


def redirect_to_files(stdout_file: str, stderr_file: str) -> None:
    """torchrun's ``--redirects``/``--tee``: a rank writes to its log files ('' = the console)."""
    for fd, path in ((1, stdout_file), (2, stderr_file)):
        if path:
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            os.dup2(target, fd)
            os.close(target)


def coerce_c_locale() -> bool:
    """PEP 538: under the C/POSIX locale a fresh interpreter sets ``LC_CTYPE=C.UTF-8``."""
    if os.environ.get("LC_ALL") or os.environ.get("PYTHONCOERCECLOCALE") == "0":
        return False
    os.environ["LC_CTYPE"] = "C.UTF-8"
    return True


def reseed_random_generators() -> None:
    """Forked children share the zygote's RNG state; a fresh interpreter draws its own."""
    import random
    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "default_generator"):
        torch.default_generator.seed()  # CPU only; CUDA generators are created lazily
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        current = mp_process.current_process()
        current.authkey = os.urandom(32)


def use_spawn_proxy(executable: str) -> None:
    """Interpreters this step's multiprocessing starts are forked by the zygote (spawn_proxy)."""
    if executable:
        import multiprocessing.spawn
        multiprocessing.spawn.set_executable(executable)


def set_up(spec: StepSpec, state: ZygoteState, fds: list[int]) -> str:
    """Everything between fork and user code, for a step and for each rank alike: signals,
    fds, environment, locale, cwd, random seeds. Raises OSError for cwd and stdio problems,
    ``process_attrs.Unforkable`` for a caller's attribute this process cannot take on.
    Returns the LC_CTYPE locale the environment selects (before PEP 538's coercion)."""
    global start_env
    die_with_parent()
    # What ps and /proc show: the step's command line and environment (before anything here
    # can start a native thread: proc_view rewrites the memory map only single-threaded)
    proc_view.show(spec.target.command_line() if spec.target else spec.args, spec.env)
    # The zygote's objects made since its image was frozen join it: a collection in the step
    # (its own, or at exit) then never writes to their pages (a copy-on-write fault each).
    gc.freeze()
    # python's fork handling keeps the zygote's thread id as the main thread's native_id
    threading.main_thread()._set_native_id()  # type: ignore[attr-defined]
    restore_signals(state.signal_handlers)
    cpus = process_attrs.affinity_change(spec.process)  # before taking the caller's on
    process_attrs.apply(spec.process)
    close_fds(state.zygote_fds)
    state.zygote_fds = []  # closed: their numbers may be reused from here on
    if spec.fd_targets is not None:
        attach_fds(fds, spec.fd_targets)
        close_unpassed_stdio(spec.fd_targets)
    else:  # stdin, then one output for stdout and stderr (interleaved, as with stderr=STDOUT)
        attach_fds([fds[0], fds[1], fds[1]], [0, 1, 2])
    start_env = dict(spec.env)
    os.environ.clear()
    os.environ.update(spec.env)
    for key, value in state.env_set_at_startup.items():  # it ran before any import
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    for key, value in state.env_set_by_preload.items():  # those no preloaded module's import
        if key not in import_effects.env_set_by_modules:  # set (which arrive with it)
            os.environ.setdefault(key, value)
    startup_locale = interpreter.apply_locale(coerce_c_locale)
    os.chdir(spec.cwd)
    reseed_random_generators()
    native_env.reapply()
    # a launcher (torchrun's agent, accelerate) leaves the pools to the programs it forks
    launcher = spec.torchrun_args is not None or spec.accelerate_args is not None
    threads.apply_fresh_counts(spec.thread_counts, cpus, pools_too=not launcher)
    wanted = Settings.from_env()  # the step's own environment asks
    deferral.install_for_step(state.deferred, wanted.deferred)
    use_spawn_proxy(state.spawn_executable if wanted.spawn else "")
    redirect_to_files(spec.stdout_file, spec.stderr_file)
    return startup_locale
