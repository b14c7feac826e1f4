"""What a step gives back: a ``CompletedProcess`` with provenance, rank failures and errors.

Callers written against ``subprocess.run`` keep working: results are ``CompletedProcess``
instances and failures raise the stdlib ``CalledProcessError`` / ``TimeoutExpired`` types.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Optional

__all__ = ["StepResult", "RankFailure", "LauncherError"]


class StepResult(subprocess.CompletedProcess):
    """``CompletedProcess`` plus how the step ran.

    ``via`` is ``"zygote"`` (forked from a preloaded zygote) or ``"subprocess"`` (a plain
    process); ``reason`` says why a step did not go through the zygote; ``failures`` lists
    failed ranks of a multi-rank step, root cause first.
    """

    def __init__(self, args, returncode, stdout=None, stderr=None, *, via="subprocess",
                 reason: str = "", failures: Optional[list["RankFailure"]] = None):
        super().__init__(args, returncode, stdout, stderr)
        self.via = via
        self.reason = reason
        self.failures = failures or []

    def __repr__(self) -> str:
        return (f"StepResult(args={self.args!r}, returncode={self.returncode!r}, "
                f"via={self.via!r}, stdout_len={len(self.stdout or '')})")


@dataclass
class RankFailure:
    """One failed rank of a multi-rank step (torch elastic's ``ProcessFailure``)."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    timestamp: float
    error_file: str = ""
    message: str = ""
    traceback: str = ""


class LauncherError(RuntimeError):
    """The launcher itself failed (zygote died, protocol fault); the step's fate is unknown."""
