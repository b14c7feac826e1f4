"""The process attributes a ``subprocess`` child inherits from its caller: umask, resource
limits, CPU affinity, nice value, ignored signals and the blocked-signal mask.

A forked step would have the zygote's; the caller captures its own at call time (``capture``,
sent in the ``StepSpec``) and the child takes them on before user code (``apply``).
"""

from __future__ import annotations

import os
import resource
import signal
from typing import Optional

__all__ = ["capture", "apply", "affinity_change"]

RLIMITS = sorted(name for name in dir(resource) if name.startswith("RLIMIT_"))
# Signals subprocess resets to the default before exec (restore_signals=True): python itself
# ignores them, so ignoring them says nothing about the caller's wishes.
RESTORED = {signal.SIGPIPE, getattr(signal, "SIGXFSZ", signal.SIGPIPE)}


def _status_field(name: str) -> Optional[str]:
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split()[1]
    except OSError:
        pass
    return None


def _umask() -> int:
    value = _status_field("Umask")
    if value is not None:
        return int(value, 8)
    mask = os.umask(0)  # no /proc: the classic dance (briefly 0 for other threads)
    os.umask(mask)
    return mask


def _ignored_signals() -> list[int]:
    mask = int(_status_field("SigIgn") or "0", 16)
    return [s for s in range(1, 65) if mask >> (s - 1) & 1 and s not in RESTORED]


def capture() -> dict:
    """This process's (this thread's, for the signal mask) attributes, as plain data."""
    return {
        "umask": _umask(),
        "rlimits": {name: list(resource.getrlimit(getattr(resource, name))) for name in RLIMITS},
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "ignored_signals": _ignored_signals(),
        "blocked_signals": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    }


def affinity_change(attrs: dict) -> Optional[list[int]]:
    """The caller's CPU set when it differs from this process's (None: the same, or unknown)."""
    cpus = attrs.get("affinity")
    return cpus if cpus and set(cpus) != os.sched_getaffinity(0) else None


def _quietly(call, *args) -> None:
    """A limit the zygote cannot grant (a hard limit above its own, a nice value below its
    own, CPUs outside its set) stays the zygote's: a fork cannot gain privileges."""
    try:
        call(*args)
    except (OSError, ValueError):
        pass


def apply(attrs: dict) -> None:
    """Take on the caller's attributes (a fresh interpreter's start-up keeps them all; python
    then sets SIGINT's handler unless SIGINT was ignored)."""
    if not attrs:
        return
    os.umask(attrs["umask"])
    for name, (soft, hard) in attrs["rlimits"].items():
        if hasattr(resource, name):
            _quietly(resource.setrlimit, getattr(resource, name), (soft, hard))
    _quietly(os.sched_setaffinity, 0, attrs["affinity"])
    _quietly(os.setpriority, os.PRIO_PROCESS, 0, attrs["nice"])
    for signum in attrs["ignored_signals"]:
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            _quietly(signal.signal, signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, attrs["blocked_signals"])
