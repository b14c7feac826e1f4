"""What a step gives back: a ``CompletedProcess`` that says how it ran, and the launcher's error.

Callers written against ``subprocess.run`` keep working: results are ``CompletedProcess``
instances and failures raise the stdlib ``CalledProcessError`` / ``TimeoutExpired`` types.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Optional

__all__ = ["StepResult", "LauncherError", "ZygoteDied", "signal_name"]


class StepResult(subprocess.CompletedProcess):
    """``CompletedProcess`` plus how the step ran.

    ``via`` is ``"zygote"`` (forked from a preloaded zygote) or ``"subprocess"`` (a plain
    process); ``reason`` says why a step did not go through the zygote; ``seconds`` is how long
    the step took, from its request (or start) to its result (a wait for GPUs included:
    ``gpus`` and ``gpu_wait_s`` under GPU packing).
    """

    def __init__(self, args, returncode, stdout=None, stderr=None, *, via="subprocess",
                 reason: str = ""):
        super().__init__(args, returncode, stdout, stderr)
        self.via = via
        self.reason = reason
        self.seconds = 0.0
        self.gpus: Optional[list[str]] = None  # with GPU packing: the GPUs the step was granted
        self.gpu_wait_s = 0.0  # how long it waited for them

    def __repr__(self) -> str:
        return (f"StepResult(args={self.args!r}, returncode={self.returncode!r}, "
                f"via={self.via!r}, stdout_len={len(self.stdout or '')})")


class LauncherError(RuntimeError):
    """The launcher itself failed (zygote died, protocol fault); the step's fate is unknown."""


class ZygoteDied(LauncherError):
    """The zygote ended (stopped, killed) while it ran a step; the step was killed with it."""

    def __init__(self, pid, args, output: Optional[str]) -> None:
        super().__init__(f"zygote {pid} died while running {args!r}"
                         + (f"; output so far:\n{output}" if output is not None else ""))
        self.pid = pid


def signal_name(signum: int) -> str:
    """"SIGSEGV" for 11; "signal 40" for a signal ``signal.Signals`` has no name for (the
    real-time ones between SIGRTMIN and SIGRTMAX), which it refuses with a ValueError."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
