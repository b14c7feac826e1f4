"""Stage 4: inside a forked child, become ``python script.py …`` and run it to the end.

The zygote calls ``become_step`` right after ``fork``; it never returns. Everything a test can
observe is reset to what a fresh interpreter that imported the preloaded modules would show;
the exit path runs what a program can observe (threads joined, ``atexit``, flush) and then
``os._exit``, skipping the seconds of module teardown a loaded stack costs.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import fcntl
import importlib.machinery
import os
import signal
import sys
import threading
import time
import traceback
import types
import warnings
from dataclasses import dataclass, field
from typing import Optional

from . import learn, protocol
from .command import PythonTarget, StepSpec, Unsupported, parse_python_argv

__all__ = ["ZygoteState", "become_step", "prepare_process", "run_target", "finish"]

PR_SET_PDEATHSIG = 1
REPORT_FD_MIN = 100  # the exit report's fd sits above the fds a program usually opens

_report_fd: Optional[int] = None  # where this process reports its exit code (see report_exit)
_report_pid = 0  # the process that owns it: a fork of the step inherits the fd, not the duty


@dataclass
class ZygoteState:
    """What the child needs from the zygote to look like a fresh interpreter."""

    base_path: list[str]  # sys.path of a fresh interpreter, without sys.path[0]
    signal_handlers: dict[int, object]  # dispositions right after preload
    zygote_fds: list[int] = field(default_factory=list)  # to close in the child
    # Variables the preloaded modules set while importing (a fresh import would set them too).
    env_set_by_preload: dict[str, str] = field(default_factory=dict)
    learn_reports_dir: str = ""  # where a step reports the modules it imported ("" = off)
    project: str = ""
    spawn_executable: str = ""  # the spawn proxy multiprocessing runs instead of python


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the forking process dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
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
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    # Out of the way first: a received fd may sit on another one's target number.
    floor = max([*fds, *targets]) + 1
    parked = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]
    for fd in set(fds):
        os.close(fd)
    for fd, target in zip(parked, targets):
        os.dup2(fd, target)
    for fd in parked:
        os.close(fd)


def attach_stdio(stdin_fd: int, out_fd: int) -> None:
    """Point fds 0, 1, 2 at the step's stdin and its output (stdout and stderr interleaved)."""
    attach_fds([stdin_fd, out_fd, out_fd], [0, 1, 2])


def use_spawn_proxy(executable: str) -> None:
    """Interpreters this step's multiprocessing starts are forked by the zygote (spawn_proxy)."""
    if executable and os.environ.get("PRELOAD_LAUNCHER_SPAWN", "1") != "0":
        import multiprocessing.spawn
        multiprocessing.spawn.set_executable(executable)


def configure_stdio(target: PythonTarget, env: dict[str, str]) -> None:
    """Buffering as a fresh interpreter sets it. The zygote runs with ``-u`` (raw binary
    layer), so a write-through text layer is truly unbuffered and a buffered one is not."""
    unbuffered = target.unbuffered or bool(env.get("PYTHONUNBUFFERED"))
    encoding, _, errors = env.get("PYTHONIOENCODING", "").partition(":")
    for stream, is_err in ((sys.stdout, False), (sys.stderr, True)):
        if stream is None:
            continue
        if unbuffered:
            options = {"line_buffering": False, "write_through": True}
        else:
            options = {"line_buffering": is_err or os.isatty(stream.fileno()),
                       "write_through": False}
        if encoding:
            options["encoding"] = encoding
        if errors and not is_err:
            options["errors"] = errors
        try:
            stream.reconfigure(**options)
        except (AttributeError, ValueError, LookupError):
            pass


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


def coerce_c_locale() -> None:
    """PEP 538: under the C/POSIX locale a fresh interpreter sets ``LC_CTYPE=C.UTF-8``."""
    env = os.environ
    if env.get("LC_ALL") or env.get("PYTHONCOERCECLOCALE") == "0":
        return
    ctype = env.get("LC_CTYPE") or env.get("LANG") or "C"
    if ctype in ("C", "POSIX"):
        env["LC_CTYPE"] = "C.UTF-8"


def prepare_process(spec: StepSpec, state: ZygoteState, fds: list[int]) -> None:
    """Everything between fork and user code; raises OSError for cwd/stdio problems."""
    die_with_parent()
    restore_signals(state.signal_handlers)
    for fd in state.zygote_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if spec.fd_targets:
        attach_fds(fds, spec.fd_targets)
    else:
        attach_stdio(*fds)
    os.environ.clear()
    os.environ.update(spec.env)
    for key, value in state.env_set_by_preload.items():
        os.environ.setdefault(key, value)
    coerce_c_locale()
    os.chdir(spec.cwd)
    reseed_random_generators()
    use_spawn_proxy(state.spawn_executable)


def _path0(target: PythonTarget) -> Optional[str]:
    if os.environ.get("PYTHONSAFEPATH"):
        return None
    if target.kind == "script":
        return os.path.dirname(os.path.realpath(target.value))
    return os.getcwd() if target.kind == "module" else ""


def _fresh_main(target: PythonTarget) -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=__import__("builtins"), __annotations__={},
                         __spec__=None, __package__=None)
    if target.kind == "script":
        path = os.path.abspath(target.value)
        main.__file__ = path
        main.__cached__ = None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    else:
        main.__loader__ = importlib.machinery.BuiltinImporter
    sys.modules["__main__"] = main
    return main


def apply_interpreter_options(target: PythonTarget, state: ZygoteState) -> None:
    path0 = _path0(target)
    sys.path[:] = ([path0] if path0 is not None else []) + list(state.base_path)
    sys.argv = [target.value if target.kind == "script" else f"-{target.kind[0]}", *target.args]
    sys.dont_write_bytecode = target.dont_write_bytecode or bool(
        os.environ.get("PYTHONDONTWRITEBYTECODE"))
    for option in target.warnoptions:
        sys.warnoptions.append(option)
        warnings._setoption(option)  # type: ignore[attr-defined]
    for option in target.xoptions:
        name, _, value = option.partition("=")
        sys._xoptions[name] = value or True  # type: ignore[attr-defined]
    if "faulthandler" in sys._xoptions or os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    if "tracemalloc" in sys._xoptions:
        import tracemalloc
        tracemalloc.start(int(sys._xoptions["tracemalloc"]) if sys._xoptions["tracemalloc"] is not True else 1)


def run_target(target: PythonTarget) -> int:
    """Run the target as python's main would; returns the exit code (or ends by signal)."""
    main = _fresh_main(target)
    try:
        if target.kind == "module":
            import runpy
            runpy._run_module_as_main(target.value, alter_argv=True)  # type: ignore[attr-defined]
        else:
            if target.kind == "script":
                try:
                    with open(target.value, "rb") as f:
                        source = f.read()
                except OSError as err:
                    print(f"{target.prog}: can't open file {os.path.abspath(target.value)!r}: "
                          f"[Errno {err.errno}] {err.strerror}", file=sys.stderr)
                    return 2
                filename = main.__file__
            else:
                source, filename = target.value, "<string>"
            code = compile(source, filename, "exec")
            exec(code, main.__dict__)
        return 0
    except SystemExit as exc:
        return _system_exit_code(exc)
    except BaseException as exc:
        # Drop this frame so the traceback reads as python's own.
        exc.__traceback__ = exc.__traceback__.tb_next if exc.__traceback__ else None
        sys.excepthook(type(exc), exc, exc.__traceback__)
        if isinstance(exc, KeyboardInterrupt):
            return -signal.SIGINT
        return 1


def _system_exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def keep_for_exit_report(fd: int) -> None:
    """Keep ``fd`` (the caller's connection, or a rank's line to its agent) to report the exit
    code on: moved out of the program's way and closed on exec, so spawned programs lack it."""
    global _report_fd, _report_pid
    if _report_fd is not None:  # a rank forked by its agent: the agent's line is not ours
        os.close(_report_fd)
    _report_fd = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, REPORT_FD_MIN)
    _report_pid = os.getpid()
    os.close(fd)


def report_exit(code: int) -> None:
    """Report the exit code now, before the kernel tears the process down (with a CUDA context,
    ~0.2 s the caller need not wait for). The step's output is closed first, so the caller has
    all of it once the report arrives. A process that dies without reporting is reported by
    whoever reaps it."""
    global _report_fd
    if _report_fd is None or os.getpid() != _report_pid:
        return
    fd, _report_fd = _report_fd, None
    close_step_output(keep=fd)
    protocol.send_event(fd, "exit", returncode=code)
    os.close(fd)


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


def finish(code: int) -> None:
    """Python's shutdown minus module teardown: join threads, atexit, flush, report, _exit."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BaseException:
            if code == 0:
                code = 120  # what python exits with when flushing stdout fails
    report_exit(code)
    exit_with(code)


def exit_with(code: int) -> None:
    """``os._exit`` for codes >= 0; a negative code -N ends the process by signal N, as the
    parent's ``waitpid`` then reports it (python itself does this for KeyboardInterrupt)."""
    if code < 0:
        signum = -code
        try:
            if signum not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(signum, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
            os.kill(os.getpid(), signum)
            time.sleep(5)
        except (OSError, ValueError):
            pass
        code = 128 + signum
    os._exit(code & 0xFF)


def become_step(spec_data: dict, fds: list[int], conn_fd: int, state: ZygoteState,
                warm_ranks: Optional[dict] = None) -> None:
    """The child's whole life after fork: set up, report, run, exit. Never returns."""
    code = 1
    try:
        spec = StepSpec.from_json_dict(spec_data)
        # Above every fd number the program gets, so installing those cannot replace it.
        floor = max([REPORT_FD_MIN, *(spec.fd_targets or [])]) + 1
        conn_fd, old_conn_fd = fcntl.fcntl(conn_fd, fcntl.F_DUPFD_CLOEXEC, floor), conn_fd
        os.close(old_conn_fd)
        try:
            prepare_process(spec, state, fds)
        except OSError as err:
            protocol.send_event(conn_fd, "error", type=type(err).__name__, errno=err.errno,
                                strerror=err.strerror, filename=err.filename)
            os._exit(255)
        if spec.torchrun_args is not None:
            from . import agent  # the multi-rank supervisor
            code = agent.run_agent(spec, state, conn_fd, warm_ranks)
        elif spec.target is None:  # a spawned interpreter's raw command line
            target = parse_python_argv(spec.args)
            if isinstance(target, Unsupported):
                protocol.send_event(conn_fd, "fallback", reason=target.reason, retire=False)
                os._exit(0)
            run_python_step(target, state, conn_fd)
        else:
            run_python_step(spec.target, state, conn_fd)
    except BaseException:
        traceback.print_exc()
    finally:
        exit_with(code)


def start_coverage_if_requested() -> None:
    """What coverage's .pth hook does at interpreter start-up, which a forked child skips.

    ``finish`` runs ``atexit``, where coverage saves this step's data."""
    if not (os.environ.get("COVERAGE_PROCESS_START") or os.environ.get("COVERAGE_PROCESS_CONFIG")):
        return
    try:
        import coverage
    except ImportError:
        return
    coverage.process_startup()


def warm_cuda_context(device: int = 0) -> None:
    """Make the CUDA context of ``device`` now, before a step needs it.

    ``PRELOAD_LAUNCHER_PREWARM_CUDA``: ``context`` (the default) makes only the driver's
    primary context, which torch adopts at first use, so ``torch.cuda`` and its allocator read
    as in a fresh process; ``kernels`` also pays the per-process first uses through torch (see
    ``warm_first_use``; ``torch.cuda.is_initialized()`` then reads True at the step's start);
    ``0`` makes nothing (the warm child still saves the fork)."""
    torch = sys.modules.get("torch")
    level = os.environ.get("PRELOAD_LAUNCHER_PREWARM_CUDA", "context")
    if torch is None or level == "0":
        return
    from .preload import nvml_device_count, retain_primary_context
    if nvml_device_count() <= device:
        return  # no NVML or no such GPU
    try:
        if level == "kernels":
            torch.cuda.set_device(device)
            warm_first_use(torch, device)
        else:
            retain_primary_context(device)
    except Exception:
        traceback.print_exc()


def warm_first_use(torch, device: int) -> None:
    """The first uses a step would otherwise pay on its critical path: cuBLAS/cuBLASLt handles
    and the lazily loaded kernels of a small transformer-like forward, backward and Adam step
    (fp32 and bf16). Nothing random is drawn; afterwards the allocator is emptied and its
    statistics reset, so memory counters read as in a fresh process."""
    import torch.nn.functional as F
    with torch.cuda.device(device):
        for dtype in (torch.float32, torch.bfloat16):
            weight = torch.ones(256, 256, device=device, dtype=dtype, requires_grad=True)
            table = torch.ones(64, 256, device=device, dtype=dtype, requires_grad=True)
            tokens = torch.arange(32, device=device) % 64
            x = F.embedding(tokens, table)
            x = F.layer_norm(x, (256,))
            x = F.gelu(x @ weight)
            x = torch.softmax(x.float(), dim=-1).to(dtype) @ weight.t()
            loss = F.cross_entropy(x.float()[:, :64], tokens)
            loss.backward()
            optimizer = torch.optim.Adam([weight, table], lr=1e-3)
            optimizer.step()
            del weight, table, tokens, x, loss, optimizer
        torch.cuda.synchronize(device)
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)


def wait_as_warm_child(sock, state: ZygoteState) -> None:
    """A pre-warmed child: make the context, wait for one step, become it. Never returns."""
    code = 0
    try:
        die_with_parent()
        warm_cuda_context()
        try:
            spec, fds = protocol.recv_request_blocking(sock)
        except (OSError, ValueError):
            os._exit(0)  # the zygote went away or restarted: nothing to serve
        *step_fds, conn_fd = fds
        state.zygote_fds = [sock.fileno()]
        become_step(spec, step_fds, conn_fd, state)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def run_python_step(target: PythonTarget, state: ZygoteState, conn_fd: Optional[int]) -> None:
    """Apply interpreter options, announce the start, run the target and exit like python."""
    configure_stdio(target, dict(os.environ))
    apply_interpreter_options(target, state)
    start_coverage_if_requested()
    sys.orig_argv = [target.prog] + _python_flags(target) + _target_argv(target)
    if conn_fd is not None:
        protocol.send_event(conn_fd, "exec", t=time.time())
        keep_for_exit_report(conn_fd)
    modules_before = set(sys.modules)
    code = run_target(target)
    learn.report_step_imports(modules_before, state.learn_reports_dir, state.project)
    finish(code)


def _python_flags(target: PythonTarget) -> list[str]:
    flags = (["-u"] if target.unbuffered else []) + (["-B"] if target.dont_write_bytecode else [])
    for w in target.warnoptions:
        flags += ["-W", w]
    for x in target.xoptions:
        flags += ["-X", x]
    return flags


def _target_argv(target: PythonTarget) -> list[str]:
    lead = [] if target.kind == "script" else [f"-{target.kind[0]}"]
    return lead + [target.value, *target.args]
