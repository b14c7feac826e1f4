"""How a fresh interpreter ends a program, for the parts a program can observe.

``runtime.finish`` skips the preloaded stack's module teardown (seconds with torch loaded) but
gives the program's own objects the end python gives them: ``__main__``'s globals cleared (so
``__del__`` runs, files it left open are flushed and closed, temporary files removed), its
cycles collected, unraisable errors printed, and the exit status python's rules give.
"""

from __future__ import annotations

import gc
import sys
import traceback

__all__ = ["exit_status_of", "flush_std_streams", "end_main_module"]

FLUSH_FAILED = 120  # python's status when flushing sys.stdout/sys.stderr at exit fails


def exit_status_of(exc: SystemExit) -> int:
    """The process exit status (0-255) python gives for an uncaught ``SystemExit``: None -> 0,
    an int (a bool too) -> its low byte as C's ``exit`` takes it (-1 -> 255, 256 -> 0, an int
    too large for a C long -> 255), anything else is printed to ``sys.stderr`` -> 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        if not -(1 << 63) <= code < (1 << 63):
            return 255  # PyLong_AsLong overflows: python exits with -1
        return int(code) & 0xFF
    try:
        if sys.stderr is not None:  # python prints nowhere without one (print would use stdout)
            print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def report_uncaught(exc: BaseException) -> tuple[int, bool]:
    """What python does with an exception that ends the program (``_PyErr_PrintEx``): hand it
    to ``sys.excepthook``; a hook that raises gets "Error in sys.excepthook:", its own error and
    the original; a missing one gets "sys.excepthook is missing"; a hook that raises
    ``SystemExit`` sets the exit status. Returns the status and whether the hook exited."""
    tb = exc.__traceback__
    hook = getattr(sys, "excepthook", _MISSING)
    if hook is _MISSING:
        _say("sys.excepthook is missing")
        sys.__excepthook__(type(exc), exc, tb)
        return 1, False
    try:
        hook(type(exc), exc, tb)
    except SystemExit as hook_exit:
        return exit_status_of(hook_exit), True
    except BaseException as hook_error:  # its frames from the hook's own on, as python shows
        hook_error.with_traceback(hook_error.__traceback__.tb_next)  # not this frame
        if hook_error.__context__ is exc:  # python calls the hook outside any handler
            hook_error.__context__ = None
        _say("Error in sys.excepthook:")
        sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
        _say("\nOriginal exception was:")
        sys.__excepthook__(type(exc), exc, tb)
    return 1, False


_MISSING = object()


def _say(line: str) -> None:
    if sys.stderr is not None:  # python writes nowhere without it
        print(line, file=sys.stderr)


def _report_flush_failure(name: str, stream, exc: BaseException) -> None:
    """What python prints when flushing a standard stream at exit fails."""
    if name == "stderr":
        return  # python clears that error silently
    head = (f"Exception ignored on flushing sys.{name}:" if sys.version_info >= (3, 13)
            else f"Exception ignored in: {stream!r}")
    try:
        err = sys.stderr
        if err is not None and not err.closed:
            err.write(head + "\n" + "".join(traceback.format_exception_only(type(exc), exc)))
            err.flush()
    except Exception:
        pass


def flush_std_streams(report: bool = False) -> bool:
    """Flush ``sys.stdout`` and ``sys.stderr`` as python does at exit: a closed stream is left
    alone; False when one could not be flushed (``report``: say so on stderr, as python does)."""
    ok = True
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        try:
            if stream is None or stream.closed:
                continue
            stream.flush()
        except Exception as exc:
            ok = False
            if report:
                _report_flush_failure(name, stream, exc)
    return ok


def _print_unraisable_while_finalising(unraisable) -> None:
    """Python's own hook as it prints while finalising: no source lines (it cannot import
    ``io`` to read them any more)."""
    head = unraisable.err_msg or "Exception ignored in"
    lines = [f"{head}: {unraisable.object!r}\n" if unraisable.object is not None else f"{head}\n"]
    if unraisable.exc_traceback is not None:
        lines.append("Traceback (most recent call last):\n")
        lines += [f'  File "{frame.filename}", line {frame.lineno}, in {frame.name}\n'
                  for frame in traceback.extract_tb(unraisable.exc_traceback)]
    lines += traceback.format_exception_only(unraisable.exc_type, unraisable.exc_value)
    try:
        sys.stderr.write("".join(lines))
        sys.stderr.flush()
    except Exception:
        pass


def end_main_module() -> None:
    """Clear ``__main__``'s globals as python's finalisation does (names with one leading
    underscore first, then the rest; ``__builtins__`` kept), then collect the cycles they
    leave. ``__del__`` errors go to ``sys.unraisablehook`` as in a fresh interpreter."""
    main = sys.modules.get("__main__")
    namespace = getattr(main, "__dict__", None)
    if namespace is None:
        return
    default_hook = sys.unraisablehook is sys.__unraisablehook__
    if default_hook:
        sys.unraisablehook = _print_unraisable_while_finalising
    try:
        names = list(namespace)
        for first_pass in (True, False):
            for name in names:
                single_underscore = name.startswith("_") and not name.startswith("__")
                if name != "__builtins__" and single_underscore == first_pass and name in namespace:
                    namespace[name] = None
        # python's own collections at exit call no gc.callbacks (the program's callbacks would
        # find its globals cleared, as here)
        callbacks, gc.callbacks[:] = gc.callbacks[:], []
        try:
            gc.collect()
        finally:
            gc.callbacks[:] = callbacks
    finally:
        if default_hook:
            sys.unraisablehook = sys.__unraisablehook__
