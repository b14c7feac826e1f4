"""The standard streams a fresh interpreter builds for fds 0-2, built anew in a forked child.

The zygote's own ``sys.stdout``/``sys.stderr`` were built for its log file (and with ``-u``): a
step gets new objects exactly as python's start-up makes them (``create_stdio``): a
``BufferedWriter`` under a ``TextIOWrapper``, line-buffered on a terminal (stderr always),
unbuffered only with ``-u``/``PYTHONUNBUFFERED``, the encoding and errors from
``PYTHONIOENCODING`` or the locale. Log handlers made during preload that hold the zygote's
stream objects are pointed at the new ones, as a fresh import would have made them.
"""

from __future__ import annotations

import codecs
import io
import locale
import os
import sys
from typing import Mapping, Optional

from .. import interpreter

__all__ = ["install_fresh_streams"]

NAMES = ("stdin", "stdout", "stderr")


def _locale_encoding() -> str:
    getencoding = getattr(locale, "getencoding", None)  # 3.11+; the older call warns there
    return getencoding() if getencoding else locale.getpreferredencoding(False)


def _encoding_and_errors(env: Mapping[str, str]) -> tuple[str, str]:
    encoding, _, errors = (env.get("PYTHONIOENCODING") or "").partition(":")
    if encoding and not errors:
        errors = "strict"  # python: PYTHONIOENCODING=latin1 means latin1:strict
    if not encoding:
        encoding = "utf-8" if sys.flags.utf8_mode else _locale_encoding()
    if not errors:
        errors = ("surrogateescape" if sys.flags.utf8_mode or interpreter.ctype_is_c_like()
                  else "strict")
    return codecs.lookup(encoding).name, errors


def _open_stream(fd: int, unbuffered: bool, encoding: str, errors: str) -> Optional[io.TextIOWrapper]:
    """``create_stdio`` for one fd; None when the fd is not open (python's sys.stdout is None)."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    write = fd != 0
    buffer = io.open(fd, "wb" if write else "rb", buffering=0 if unbuffered and write else -1,
                     closefd=False)
    raw = buffer if isinstance(buffer, io.FileIO) else buffer.raw
    raw.name = f"<{NAMES[fd]}>"
    line_buffering = not unbuffered and (raw.isatty() or fd == 2)
    stream = io.TextIOWrapper(buffer, encoding, "backslashreplace" if fd == 2 else errors,
                              "\n", line_buffering, unbuffered)
    stream.mode = "w" if write else "r"
    return stream


def _repoint_log_handlers(replaced: dict[int, object]) -> None:
    """``logging`` handlers made during preload write to the stream object they were given
    (``sys.stderr`` at the time): hand them the step's new object for the same stream."""
    logging = sys.modules.get("logging")
    if logging is None:
        return
    for ref in list(getattr(logging, "_handlerList", [])):
        handler = ref()
        stream = getattr(handler, "stream", None)
        if stream is not None and id(stream) in replaced and isinstance(handler, logging.StreamHandler):
            with handler.lock:
                handler.stream = replaced[id(stream)]


def install_fresh_streams(unbuffered: bool, env: Mapping[str, str]) -> None:
    """Replace ``sys.stdin/stdout/stderr`` and their ``__x__`` twins with new objects on fds
    0-2, built as a fresh interpreter would build them."""
    encoding, errors = _encoding_and_errors(env)
    replaced: dict[int, object] = {}
    old_streams = []  # kept alive until the handlers are repointed: ids must stay unique
    for fd, name in enumerate(NAMES):
        new = _open_stream(fd, unbuffered, encoding, errors)
        for stream in (getattr(sys, name, None), getattr(sys, f"__{name}__", None)):
            if stream is not None:
                old_streams.append(stream)
                replaced[id(stream)] = new
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)
    _repoint_log_handlers(replaced)
