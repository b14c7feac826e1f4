"""Stage 4: inside a forked child, become ``python [opts] script|-m mod|-c code …`` and run it.

Everything a test can observe of the interpreter is reset to what a fresh one that imported
the preloaded modules would show: ``sys.argv``, ``sys.path[0]``, a new ``__main__``, stdio
buffering, ``-W``/``-X`` options, coverage's start-up hook. The process itself was set up by
``runtime.set_up`` and ends through ``runtime.finish``.
"""

from __future__ import annotations

import faulthandler
import importlib.machinery
import os
import signal
import sys
import time
import types
import warnings
from typing import Optional

from . import deferral, learn, protocol, runtime, shadowing
from .command import PythonTarget

__all__ = ["run_python_step"]


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
        path = target.value if target.file_as_given else os.path.abspath(target.value)
        main.__file__ = path
        main.__cached__ = None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    else:
        main.__loader__ = importlib.machinery.BuiltinImporter
    sys.modules["__main__"] = main
    return main


def apply_interpreter_options(target: PythonTarget, base_path: list[str]) -> None:
    path0 = _path0(target)
    sys.path[:] = ([path0] if path0 is not None else []) + list(base_path)
    sys.argv = [target.value if target.kind == "script" else f"-{target.kind[0]}", *target.args]
    if target.executable:
        sys.executable = target.executable
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


def run_python_step(target: PythonTarget, state: runtime.ZygoteState,
                    conn_fd: Optional[int]) -> int:
    """Apply interpreter options, announce the start, run the target, shut down like python;
    returns the exit code. ``conn_fd``: the caller's connection (None for a rank, which already
    reports to its agent)."""
    configure_stdio(target, dict(os.environ))
    apply_interpreter_options(target, state.base_path)
    shadowing.drop_shadowed(sys.path)  # the step's own modules win, as in a fresh interpreter
    deferral.replay_eager()  # with the step's sys.path, so its own modules are found
    start_coverage_if_requested()
    sys.orig_argv = [target.prog] + _python_flags(target) + _target_argv(target)
    if conn_fd is not None:
        protocol.send_event(conn_fd, "exec", t=time.time())
        runtime.keep_for_exit_report(conn_fd)
    modules_before = set(sys.modules)
    code = run_target(target)
    learn.report_step_imports(modules_before, state.learn_reports_dir, state.project,
                              state.base_path)
    return runtime.finish(code)


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
