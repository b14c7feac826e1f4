"""Which interpreter this is, for the keys of everything kept per interpreter (the verdict
cache, learned profiles, portable profiles' fingerprints, daemons).

``python``, ``python3``, ``python3.X`` and a console script of one environment are one
interpreter: the same real executable under the same ``sys.prefix``. Two virtual environments
made from one base interpreter share the real executable but never the prefix, so they never
share a key. ``sys.executable`` alone is the name the interpreter was started by, and splits one
environment into as many keys as it has names.
"""

from __future__ import annotations

import hashlib
import os
import sys

__all__ = ["interpreter_identity", "interpreter_key"]


def interpreter_identity() -> str:
    """This interpreter as one text: its prefix, its real executable and its version."""
    return "\n".join([sys.prefix, os.path.realpath(sys.executable), sys.version])


def interpreter_key(*parts: str, length: int = 16) -> str:
    """A short hash of this interpreter's identity and ``parts``."""
    text = "\n".join([interpreter_identity(), *parts])
    # A path that is not valid UTF-8 (a folder named in another encoding) keys by its bytes.
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:length]
