"""Which environment variables the preload's imports read: a zygote serves only steps whose
environment agrees with it on those (``settings.import_env_mismatch``)."""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Iterator

__all__ = ["recording_env_reads"]


class _RecordingEnviron(type(os.environ)):  # type: ignore[misc]
    """``os.environ`` that remembers which keys were looked up one by one (get, [], in, getenv).

    Copies and scans (``dict(os.environ)``, ``.items()``, ``.copy()``) read every key right after
    iterating them, in order: those reads are not recorded, or every variable, down to
    ``PYTEST_CURRENT_TEST``, would look import-relevant."""

    read_keys: set = set()
    _scan: collections.deque = collections.deque()  # keys a scan is about to read, in order

    def __iter__(self):
        keys = list(super().__iter__())
        _RecordingEnviron._scan = collections.deque(keys)
        return iter(keys)

    def __getitem__(self, key):
        scan = _RecordingEnviron._scan
        if scan and scan[0] == key:
            scan.popleft()
        else:
            scan.clear()
            if isinstance(key, str):
                _RecordingEnviron.read_keys.add(key)
        return super().__getitem__(key)


@contextlib.contextmanager
def recording_env_reads() -> Iterator[set]:
    original = os.environ.__class__
    _RecordingEnviron.read_keys = set()
    os.environ.__class__ = _RecordingEnviron
    try:
        yield _RecordingEnviron.read_keys
    finally:
        os.environ.__class__ = original
