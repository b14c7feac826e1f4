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

from .. import interpreter, protocol, settings
from ..command import PythonTarget
from ..zygote import deferral, learn
from . import import_effects, module_table, program_exit, runtime, script, stdio
from .rerun import FreshRun

__all__ = ["run_python_step"]

_real_executable = sys.executable  # the zygote's: the interpreter a fresh run executes


def _path0(target: PythonTarget) -> Optional[str]:
    if target.kind == "script" and script.is_main_importer(script.script_path(target.value)):
        return script.script_path(target.value)  # where __main__ is imported from, even with -P
    if target.run_path_from is not None:
        return target.run_path_from
    if os.environ.get("PYTHONSAFEPATH") and hasattr(sys.flags, "safe_path"):  # 3.11+ reads it
        return None
    if target.kind == "script":
        return os.path.dirname(os.path.realpath(target.value))
    return os.getcwd() if target.kind == "module" else ""


def _fresh_main(target: PythonTarget) -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=__import__("builtins"), __annotations__={},
                         __spec__=None, __package__=None)
    if target.run_path_from is not None and not script.is_main_importer(target.value):
        # runpy.run_path's globals for a file: the path as given, no loader
        main.__dict__.update(__file__=target.value, __cached__=None, __doc__=None,
                             __loader__=None, __package__="")
    elif target.kind == "script":
        script.set_up_main(main, script.script_path(target.value))
    else:
        main.__loader__ = importlib.machinery.BuiltinImporter
    sys.modules["__main__"] = main
    return main


def apply_interpreter_options(target: PythonTarget, base_path: list[str]) -> None:
    path0 = _path0(target)
    base_path = interpreter.step_base_path(base_path, os.environ.get("PYTHONPATH", ""),
                                           interpreter.ZYGOTE_CWD, os.getcwd())
    sys.path[:] = ([path0] if path0 is not None else []) + list(base_path)
    # A fresh interpreter finds what is on disk when it starts; the zygote's finders hold the
    # folders and zips as they were when it imported (a folder missing then is cached as having
    # no finder, and never searched again). importlib's own reset first (its finders' caches, a
    # zip's table of contents, metadata's), then no finder at all, as at a fresh start.
    importlib.invalidate_caches()
    sys.path_importer_cache.clear()
    interpreter.take_user_base()
    sys.argv = [target.value if target.kind == "script" else f"-{target.kind[0]}", *target.args]
    if target.executable:
        sys.executable = target.executable
    sys.dont_write_bytecode = target.dont_write_bytecode or (
        interpreter.env_flag(os.environ, "PYTHONDONTWRITEBYTECODE") > 0)
    import_effects.start_fresh()  # no preloaded registrations; then the step's own options
    for option in target.warnoptions:
        sys.warnoptions.append(option)
        warnings._setoption(option)  # type: ignore[attr-defined]
    for option in target.xoptions:
        name, _, value = option.partition("=")
        sys._xoptions[name] = value or True  # type: ignore[attr-defined]
    if "faulthandler" in sys._xoptions or os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    _start_tracemalloc(sys._xoptions.get("tracemalloc"), os.environ.get("PYTHONTRACEMALLOC"))


def _start_tracemalloc(xoption, env_value: Optional[str]) -> None:
    """``-X tracemalloc[=N]`` or ``PYTHONTRACEMALLOC=N`` (the option wins), from here on."""
    if xoption is None and not env_value:
        return
    frames = xoption if xoption is not None else env_value
    frames = 1 if frames is True else int(frames)
    if frames > 0:  # PYTHONTRACEMALLOC=0: off
        import tracemalloc
        tracemalloc.start(frames)


def _show_code_in_tracebacks(code: str) -> None:
    """Python 3.13+ keeps ``-c``'s code in linecache so tracebacks show its lines: there the
    zygote's own start-up code sits, and the step's takes its place."""
    linecache = sys.modules.get("linecache")
    entry = linecache.cache.get("<string>") if linecache else None
    if entry is not None and len(entry) == 4:
        linecache.cache["<string>"] = (len(code), entry[1],
                                       [line + "\n" for line in code.splitlines()], entry[3])


def run_target(target: PythonTarget) -> int:
    """Run the target as python's main would; returns the exit code (or ends by signal)."""
    main = _fresh_main(target)
    uncaught: Optional[BaseException] = None
    try:
        if target.kind == "module" or (target.kind == "script"
                                       and script.is_main_importer(main.__file__)):
            # -m, or a directory/zip whose __main__ python runs from sys.path[0]
            import runpy
            runpy._run_module_as_main(  # type: ignore[attr-defined]
                target.value if target.kind == "module" else "__main__",
                alter_argv=target.kind == "module")
        elif target.kind == "script":
            try:
                code = script.code_of(main.__file__)
            except OSError as err:
                print(f"{target.prog}: can't open file {main.__file__!r}: "
                      f"[Errno {err.errno}] {err.strerror}", file=sys.stderr)
                return 2
            except SyntaxError as err:  # python reports it with no traceback: nothing ran
                raise err.with_traceback(None)  # (this frame only, which the handler drops)
            exec(code, main.__dict__)
        else:
            _show_code_in_tracebacks(target.value)
            # dont_inherit: the program's code gets none of this module's __future__ features
            exec(compile(target.value, "<string>", "exec", dont_inherit=True), main.__dict__)
    except BaseException as exc:
        uncaught = exc
    # The program's code is over: what it left tracing is held from here, inline, before any
    # call of ours (``program_exit.tracing``).
    program_exit.tracing = (sys.gettrace(), sys.getprofile())
    sys.settrace(None)
    sys.setprofile(None)
    if uncaught is None:
        return 0
    if isinstance(uncaught, SystemExit):
        return runtime.exit_status_of(uncaught)
    # Drop this frame so the traceback reads as python's own.
    uncaught.__traceback__ = uncaught.__traceback__.tb_next if uncaught.__traceback__ else None
    # python hands it to sys.excepthook with no exception being handled
    status, hook_exited = program_exit.report_uncaught(uncaught)
    if isinstance(uncaught, KeyboardInterrupt) and not hook_exited:
        return -signal.SIGINT
    return status


def start_coverage_if_requested() -> set[str]:
    """What coverage's .pth hook does at interpreter start-up, which a forked child skips;
    returns the modules it imported (a fresh interpreter has them at start-up too).

    ``finish`` runs ``atexit``, where coverage saves this step's data."""
    if not (os.environ.get("COVERAGE_PROCESS_START") or os.environ.get("COVERAGE_PROCESS_CONFIG")):
        return set()
    before = set(sys.modules)
    try:
        import coverage
    except ImportError:
        return set()
    coverage.process_startup()
    return set(sys.modules) - before


def only_a_fresh_start_applies(target: PythonTarget) -> str:
    """Settings python takes while it starts that a forked step cannot take on ('' = none):
    import-time profiling prints every import, the preloaded ones too; another bytecode cache
    folder than the zygote's holds what the preloaded modules' imports cache."""
    xoptions = dict(o.partition("=")[::2] for o in target.xoptions)
    if "importtime" in xoptions or os.environ.get("PYTHONPROFILEIMPORTTIME"):
        return "import-time profiling (-X importtime, PYTHONPROFILEIMPORTTIME) profiles every import"
    asked = [key for key in settings.FRESH_START_ENV if os.environ.get(key)]
    if asked:  # the zygote started without them (settings.FRESH_START_ENV)
        return f"{asked[0]} takes effect only as python starts"
    prefix = xoptions.get("pycache_prefix") or os.environ.get("PYTHONPYCACHEPREFIX") or None
    if prefix is not None:
        prefix = os.path.abspath(prefix)
    if prefix != sys.pycache_prefix:
        return f"its bytecode cache folder ({prefix}) is not the zygote's ({sys.pycache_prefix})"
    return ""


def start_fresh_module_table(target: PythonTarget, started: set[str]) -> None:
    """From here on the step's ``sys.modules`` is a fresh interpreter's (``module_table``); a
    step that changes what a preloaded module read before importing it runs fresh (``rerun``),
    and so does one that asks for what only a fresh start applies."""
    if faulthandler.is_enabled():  # -X faulthandler: python imports it at start-up
        started = started | {"faulthandler"}
    executable = target.executable or _real_executable
    fresh = FreshRun(executable, sys.orig_argv, runtime.start_env)
    reason = only_a_fresh_start_applies(target)
    if reason:
        runtime.become_fresh(executable, sys.orig_argv, runtime.start_env, reason)
    module_table.start_fresh(started, fresh, target.runner_env)


def run_python_step(target: PythonTarget, state: runtime.ZygoteState,
                    conn_fd: Optional[int]) -> int:
    """Apply interpreter options, announce the start, run the target, shut down like python;
    returns the exit code. ``conn_fd``: the caller's connection (None for a rank, which already
    reports to its agent)."""
    stdio.install_fresh_streams(
        target.unbuffered or interpreter.env_flag(os.environ, "PYTHONUNBUFFERED") > 0, os.environ)
    apply_interpreter_options(target, state.base_path)
    before = set(sys.modules)
    importers = deferral.replay_eager()  # with the step's sys.path, so its own modules are found
    module_table.attach(importers, set(sys.modules) - before)  # they come back with importers
    started = start_coverage_if_requested()
    sys.orig_argv = target.command_line()
    if conn_fd is not None:
        protocol.send_event(conn_fd, "exec", t=time.time())
        runtime.keep_for_exit_report(conn_fd)
    start_fresh_module_table(target, started)
    modules_before = module_table.known_modules()
    code = run_target(target)
    module_table.stop_checking()
    program_threads = "threading" in sys.modules  # before the report below can import it
    learn.report_step_imports(modules_before, state.learn_reports_dir, state.project,
                              state.base_path)
    return runtime.finish(code, program_threads)
