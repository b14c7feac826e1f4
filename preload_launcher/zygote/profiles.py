"""Portable profiles: what one machine learned, for a fresh one to start from.

``preload-launcher profile --write FILE`` saves the verdicts (quarantined entries, deferred
packages) and the learned modules for this interpreter and package set. A zygote started with
``PRELOAD_LAUNCHER_PROFILE=FILE`` (or the ini key ``preload_launcher_profile``) begins from it:

- same package fingerprint and probe: the verdicts are trusted, as if they were in the cache;
- otherwise they are hints: applied (so the zygote does not dirty itself finding them again),
  then re-verified in a forked child after the zygote is ready, and the verdict cache keeps
  what the check found (a hint that no longer holds is cleared for the next zygote).

Learned modules are used either way: they are imported under the usual CUDA-clean rules.
"""

from __future__ import annotations

import sys
from typing import Optional

from ..files import read_json, write_json

__all__ = ["write_profile", "read_profile", "FORMAT"]

FORMAT = 1


def write_profile(path: str, fingerprint: str, probe: str, verdicts: dict, learned: list[str],
                  pinned: list[str]) -> dict:
    profile = {"format": FORMAT, "python": sys.version.split()[0], "fingerprint": fingerprint,
               "probe": probe, "verdicts": verdicts, "learned": learned, "pinned": pinned}
    write_json(path, profile)
    return profile


def read_profile(path: str) -> Optional[dict]:
    """The profile in ``path``; None when it is missing or not one."""
    profile = read_json(path) if path else None
    if not profile or profile.get("format") != FORMAT:
        return None
    return profile
