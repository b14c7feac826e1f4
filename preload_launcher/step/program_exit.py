"""How a fresh interpreter ends a program, for the parts a program can observe.

``runtime.finish`` skips the preloaded stack's module teardown (seconds with torch loaded) but
gives the program's own objects the end python gives them: ``__main__``'s globals cleared (so
``__del__`` runs, files it left open are flushed and closed, temporary files removed), its
cycles collected, unraisable errors printed, and the exit status python's rules give.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback

__all__ = ["exit_status_of", "flush_std_streams", "end_main_module", "restore_std_streams",
           "tracing"]

FLUSH_FAILED = 120  # python's status when flushing sys.stdout/sys.stderr at exit fails

# The trace and profile functions the program left set when its code ended. Python keeps them
# for the Python code it runs at exit (the excepthook, thread shutdown, atexit callbacks,
# ``__del__`` methods), never for the launcher's own code, which runs in Python here: they are
# taken away as the program's code ends (``child.run_target``) and given back, inline, around
# those parts (a function called to do it would be traced as the program's own).
tracing: tuple = (None, None)


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
    # As python's _Py_HandleSystemExit: the code's text to sys.stderr (to fd 2 without one),
    # then a newline through sys.stderr, to fd 2 where that fails.
    stderr = getattr(sys, "stderr", None)
    try:
        if stderr is not None:
            stderr.write(str(code))
        else:
            _write_fd2(str(code).encode("utf-8", "backslashreplace"))
    except Exception:
        pass
    try:
        stderr.write("\n")  # (None has no write: fd 2)
    except Exception:
        _write_fd2(b"\n")
    return 1


def _write_fd2(data: bytes) -> None:
    try:
        os.write(2, data)
    except OSError:
        pass


def report_uncaught(exc: BaseException) -> tuple[int, bool]:
    """What python does with an exception that ends the program (``_PyErr_PrintEx``): hand it
    to ``sys.excepthook``; a hook that raises gets "Error in sys.excepthook:", its own error and
    the original; a missing one gets "sys.excepthook is missing"; a hook that raises
    ``SystemExit`` sets the exit status. Returns the status and whether the hook exited.
    Before the hook, ``sys.last_exc`` (3.12) and ``sys.last_type``, ``last_value`` and
    ``last_traceback`` are set, as python's ``PyErr_Print`` does."""
    global tracing
    tb = exc.__traceback__
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    hook = getattr(sys, "excepthook", _MISSING)
    if hook is _MISSING:
        _say("sys.excepthook is missing")
        sys.__excepthook__(type(exc), exc, tb)
        return 1, False
    try:
        sys.settrace(tracing[0])  # python calls the hook traced
        sys.setprofile(tracing[1])
        try:
            hook(type(exc), exc, tb)
        finally:
            tracing = (sys.gettrace(), sys.getprofile())
            sys.settrace(None)
            sys.setprofile(None)
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
        if err is not None:  # (a closed one raises, and python's hook then says nothing)
            err.write(head + "\n" + "".join(traceback.format_exception_only(type(exc), exc)))
            err.flush()
    except Exception:
        pass


def _is_closed(stream) -> bool:
    """python's ``file_is_closed``: a stream without a ``closed`` that answers is open (a
    replacement of ``sys.stdout`` need not have one)."""
    try:
        return bool(stream.closed)
    except Exception:
        return False


def flush_std_streams(report: bool = False) -> bool:
    """Flush ``sys.stdout`` and ``sys.stderr`` as python does at exit: a closed stream is left
    alone; False when one could not be flushed (``report``: say so on stderr, as python does)."""
    ok = True
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        try:
            if stream is None or _is_closed(stream):
                continue
            stream.flush()
        except Exception as exc:
            ok = False
            if report:
                _report_flush_failure(name, stream, exc)
    return ok


def restore_std_streams() -> None:
    """``sys.stdin``, ``stdout`` and ``stderr`` back to the ones the interpreter started with,
    as python's finalisation does before it flushes them again: what a program wrote to
    ``sys.__stdout__`` behind a replacement of its own reaches the output."""
    for name in ("stdin", "stdout", "stderr"):
        setattr(sys, name, getattr(sys, f"__{name}__", None))


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
    leave. ``__del__`` errors go to ``sys.unraisablehook`` as in a fresh interpreter; the
    program's trace and profile functions see the ``__del__`` methods, as in python."""
    global tracing
    main = sys.modules.get("__main__")
    namespace = getattr(main, "__dict__", None)
    if namespace is None:
        return
    default_hook = sys.unraisablehook is sys.__unraisablehook__
    if default_hook:
        sys.unraisablehook = _print_unraisable_while_finalising
    try:
        names = [n for n in namespace if n != "__builtins__"]
        order = ([n for n in names if n.startswith("_") and not n.startswith("__")]
                 + [n for n in names if not n.startswith("_") or n.startswith("__")])
        # python's own collections at exit call no gc.callbacks (the program's callbacks would
        # find its globals cleared, as here)
        callbacks, gc.callbacks[:] = gc.callbacks[:], []
        sys.settrace(tracing[0])  # from here to the collection's end, no call of ours
        sys.setprofile(tracing[1])
        try:
            for name in order:
                if name in namespace:
                    namespace[name] = None
            gc.collect()
        finally:
            tracing = (sys.gettrace(), sys.getprofile())
            sys.settrace(None)
            sys.setprofile(None)
            gc.callbacks[:] = callbacks
    finally:
        if default_hook:
            sys.unraisablehook = sys.__unraisablehook__
