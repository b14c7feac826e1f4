"""Which environment variables imports read: the preload's as a whole (a zygote serves only
steps whose environment agrees with it on those, ``interpreter.import_env_mismatch``), and each
module's own (``module_table``: a step that changes one before importing the module runs fresh).

A variable that stayed unset, and that every read took with the same default
(``os.getenv("NVTE_FLASH_ATTN", "1")``), gave its readers that default: a step holding exactly
that value reads the same (``read_default``). One read that could tell unset from the default
(``[]``, ``in``, a default of None or another), one that found it set, or an import that set or
deleted it ends that for the variable, in this process and every process forked from it after:
a step holding the default would then read, or be left with, what a fresh interpreter is not.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import os
import threading
from typing import Callable, Iterator, Optional

from ..settings import IMPORT_ENV_KEYS, NATIVE_ENV, THREAD_ENV
from ..step.native_env import REREAD

__all__ = ["note_reads_elsewhere", "read_default", "recording_env_reads", "reporting_reads",
           "same_to_readers"]


class _RecordingEnviron(type(os.environ)):  # type: ignore[misc]
    """``os.environ`` that remembers which keys were looked up one by one (get, [], in, getenv).

    Copies and scans (``dict(os.environ)``, ``.items()``, ``.copy()``) read every key right after
    iterating them, in order: those reads are not recorded, or every variable, down to
    ``PYTEST_CURRENT_TEST``, would look import-relevant."""

    read_keys: set = set()
    defaults: dict = {}  # an unset variable -> the one default every read of it took
    tellers: set = set()  # variables no default stands for (a read could tell, it was set)
    _getting = threading.local()  # inside ``get`` (this thread): not a teller yet
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
            if value is not None or not getattr(_RecordingEnviron._getting, "on", False):
                _RecordingEnviron.tellers.add(key)  # found set, or told apart from unset
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if isinstance(key, str):  # what was read before or after is not what a default gives
            _RecordingEnviron.tellers.add(key)

    def __delitem__(self, key):
        super().__delitem__(key)
        if isinstance(key, str):
            _RecordingEnviron.tellers.add(key)

    def get(self, key, default=None):
        _RecordingEnviron._getting.on = True
        try:
            return self[key]
        except KeyError:
            if isinstance(key, str):
                seen = _RecordingEnviron.defaults.setdefault(key, default)
                if not isinstance(default, str) or seen != default:
                    _RecordingEnviron.tellers.add(key)
            return default
        finally:
            _RecordingEnviron._getting.on = False


def read_default(key: str) -> Optional[str]:
    """The value a step may hold for ``key`` where the recorded imports saw it unset: the one
    default all their reads took, if none could tell the difference; else None. Never for a
    variable native code also reads (python's own, the C library's, ``settings.NATIVE_ENV``):
    ``getenv`` in C has no default to agree with."""
    if key in _RecordingEnviron.tellers or _read_natively(key):
        return None
    return _RecordingEnviron.defaults.get(key)


def note_reads_elsewhere(reads: dict[str, Optional[str]]) -> None:
    """Take in reads recorded in another process with this one's environment (python's
    start-up code, ``startup_code``): each variable with what ``read_default`` gave there."""
    for key, default in reads.items():
        seen = _RecordingEnviron.defaults.setdefault(key, default)
        if default is None or seen != default:
            _RecordingEnviron.tellers.add(key)


# What native code reads: python's start-up and the loader, the locale, the thread pools, the
# libraries' own (``settings.NATIVE_ENV``, families as ``X*``), those a step reads again.
_NATIVE_PATTERNS = (*IMPORT_ENV_KEYS, "PYTHON*", "LC_*", "LANG", "LANGUAGE", *THREAD_ENV,
                    *NATIVE_ENV, *REREAD)


def _read_natively(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in _NATIVE_PATTERNS)


def same_to_readers(key: str, a: Optional[str], b: Optional[str]) -> bool:
    """Whether the recorded reads of ``key`` get the same from the values ``a`` and ``b``
    (None: unset)."""
    if a == b:
        return True
    default = read_default(key)
    return default is not None and {a, b} <= {None, default}


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
