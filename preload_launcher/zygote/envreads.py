"""Which environment variables imports read: the preload's as a whole (a zygote serves only
steps whose environment agrees with it on those, ``interpreter.import_env_mismatch``), and each
module's own (``module_table``: a step that changes one before importing the module runs fresh).
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Callable, Iterator, Optional

__all__ = ["recording_env_reads", "reporting_reads"]


class _RecordingEnviron(type(os.environ)):  # type: ignore[misc]
    """``os.environ`` that remembers which keys were looked up one by one (get, [], in, getenv).

    Copies and scans (``dict(os.environ)``, ``.items()``, ``.copy()``) read every key right after
    iterating them, in order: those reads are not recorded, or every variable, down to
    ``PYTEST_CURRENT_TEST``, would look import-relevant."""

    read_keys: set = set()
    on_read: Optional[Callable[[str, Optional[str]], None]] = None  # (key, value) per read
    on_scan: Optional[Callable[[], None]] = None  # per scan of the whole environment
    _scan: collections.deque = collections.deque()  # keys a scan is about to read, in order

    def __iter__(self):
        if _RecordingEnviron.on_scan is not None:  # first: it may scan the environment itself
            _RecordingEnviron.on_scan()
        keys = list(super().__iter__())
        _RecordingEnviron._scan = collections.deque(keys)
        return iter(keys)

    def __getitem__(self, key):
        scan = _RecordingEnviron._scan
        if scan and scan[0] == key:
            scan.popleft()
            return super().__getitem__(key)
        scan.clear()
        try:
            value = super().__getitem__(key)
        except KeyError:
            value = None
        if isinstance(key, str):
            _RecordingEnviron.read_keys.add(key)
            if _RecordingEnviron.on_read is not None:
                _RecordingEnviron.on_read(key, value)
        if value is None:
            raise KeyError(key)
        return value


@contextlib.contextmanager
def _recording_environ() -> Iterator[None]:
    """``os.environ`` records reads inside (nested uses keep the outermost's)."""
    original = os.environ.__class__
    os.environ.__class__ = _RecordingEnviron
    try:
        yield
    finally:
        os.environ.__class__ = original


@contextlib.contextmanager
def recording_env_reads() -> Iterator[set]:
    _RecordingEnviron.read_keys = set()
    with _recording_environ():
        yield _RecordingEnviron.read_keys


@contextlib.contextmanager
def reporting_reads(on_read: Callable[[str, Optional[str]], None],
                    on_scan: Callable[[], None]) -> Iterator[None]:
    """Call ``on_read(key, value)`` for each variable read one by one inside, and ``on_scan()``
    when the whole environment is iterated."""
    previous = _RecordingEnviron.on_read, _RecordingEnviron.on_scan
    _RecordingEnviron.on_read, _RecordingEnviron.on_scan = on_read, on_scan
    try:
        with _recording_environ():
            yield
    finally:
        _RecordingEnviron.on_read, _RecordingEnviron.on_scan = previous
