"""The caller's fds 0-2, which may be closed (``<&-``, ``>&-``).

A socket or pipe the launcher creates while one of them is closed would take its number: the
zygote's listener would then be replaced by its /dev/null stdin, a step's output pipe would be
passed as its stdin. ``subprocess`` moves its own pipes out of 0-2 for the same reason. Here the
closed numbers are held by /dev/null only while the launcher creates its fds, then closed again:
the caller's own fds stay as they were, and a step gets exactly the caller's open ones."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

__all__ = ["open_stdio", "guarded_stdio"]

STDIO = (0, 1, 2)
_lock = threading.RLock()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def open_stdio() -> list[int]:
    """Which of the caller's fds 0, 1, 2 are open."""
    return [fd for fd in STDIO if _is_open(fd)]


@contextlib.contextmanager
def guarded_stdio() -> Iterator[list[int]]:
    """Within: fds created land above 2. Yields which of 0-2 the caller has open (three fstat
    calls are the whole cost when all are)."""
    caller_open = open_stdio()
    if len(caller_open) == len(STDIO):
        yield caller_open
        return
    with _lock:
        held = []
        try:
            for fd in STDIO:
                if not _is_open(fd):
                    placeholder = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                    if placeholder != fd:  # another thread took the number meanwhile
                        os.close(placeholder)
                        continue
                    held.append(fd)
            yield caller_open
        finally:
            for fd in held:
                os.close(fd)
