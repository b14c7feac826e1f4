"""The verdict cache: what each preload entry did to a zygote, per installed package set.

Keys are preload entries (quarantined), ``defer:<package>`` (deferred culprits),
``learned:<package>`` (learned modules that dirtied a zygote) and ``scouted:<entry>`` (entries
known to import cleanly); one file, holding only the current package set's verdicts.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Optional

from ..files import read_json, update_json
from ..identity import interpreter_identity

__all__ = ["VerdictCache", "package_fingerprint", "LEARNED", "DEFER", "SCOUTED"]

LEARNED = "learned:"  # verdict-cache prefix for learned packages
DEFER = "defer:"  # verdict-cache prefix for deferred packages
SCOUTED = "scouted:"  # verdict-cache prefix for entries known to import cleanly


def package_fingerprint(path: Optional[list[str]] = None) -> str:
    """A hash of every distribution installed on ``path`` (default ``sys.path``: in the zygote,
    a fresh interpreter's without ``sys.path[0]``), and the interpreter (any of its names)."""
    import importlib.metadata  # here, not at module level: `preload-launcher run` starts faster

    items = sorted(f"{d.metadata['Name']}=={d.version}"
                   for d in importlib.metadata.distributions(path=sys.path if path is None else path))
    return hashlib.sha256("\n".join([interpreter_identity(), *items]).encode()).hexdigest()[:16]


class VerdictCache:
    """Quarantine verdicts per (interpreter, packages, probe), kept on disk."""

    def __init__(self, directory: str, fingerprint: str) -> None:
        self.path = os.path.join(directory, "verdicts.json")
        self.fingerprint = fingerprint

    def get(self) -> dict[str, dict]:
        return (read_json(self.path) or {}).get(self.fingerprint, {})

    def put(self, entry: str, verdict: dict) -> None:
        self.update({entry: verdict})

    def update(self, verdicts: dict[str, dict]) -> None:
        if not verdicts:
            return

        def change(data: dict) -> None:
            # Only the current package set's verdicts are worth keeping: versions changed
            # otherwise. Read under the lock: another zygote's verdicts of this set are kept.
            current = {**data.get(self.fingerprint, {}), **verdicts}
            data.clear()
            data[self.fingerprint] = current

        update_json(self.path, change)  # a read-only or full cache: warned once, not fatal
