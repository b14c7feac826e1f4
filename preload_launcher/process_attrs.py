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

__all__ = ["capture", "place", "apply", "affinity_change"]

RLIMITS = sorted(name for name in dir(resource) if name.startswith("RLIMIT_"))
# Signals subprocess resets to the default before exec (restore_signals=True): python itself
# ignores them, so ignoring them says nothing about the caller's wishes.
RESTORED = {signal.SIGPIPE, getattr(signal, "SIGXFSZ", signal.SIGPIPE)}


def _status() -> dict[str, str]:
    """This thread's ``/proc`` status fields ({} without ``/proc``)."""
    try:
        with open("/proc/thread-self/status") as f:
            return dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}


def _umask(status: dict[str, str]) -> int:
    if "Umask" in status:
        return int(status["Umask"], 8)
    mask = os.umask(0)  # no /proc: the classic dance (briefly 0 for other threads)
    os.umask(mask)
    return mask


def _ignored_signals(status: dict[str, str]) -> list[int]:
    mask = int(status.get("SigIgn", "0"), 16)
    return [s for s in range(1, 65) if mask >> (s - 1) & 1 and s not in RESTORED]


def capture() -> dict:
    """This process's (this thread's, for the signal mask) attributes, as plain data."""
    status = _status()
    return {
        "umask": _umask(status),
        "rlimits": {name: list(resource.getrlimit(getattr(resource, name))) for name in RLIMITS},
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "ignored_signals": _ignored_signals(status),
        "blocked_signals": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    }


def place() -> dict:
    """Where the process standing for a program (a stand-in, the CLI) stands: a session
    leader (its caller's ``start_new_session``, ``setsid``) has its program lead a session of
    its own too. Only such a process's place is the program's: a library caller's is not."""
    return {"session_leader": os.getsid(0) == os.getpid()}


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


# Ignored by python itself at start-up, whatever its caller did.
PYTHON_IGNORES = {signal.SIGPIPE, getattr(signal, "SIGXFSZ", signal.SIGPIPE)}


def _take_ignored_signals(ignored: set[int]) -> None:
    """Ignore what the caller ignores, and only that: a zygote started with SIGINT ignored
    (from a job run with ``&`` or ``nohup``) must not pass that on to a caller who does not
    ignore it, whose fresh python would install its KeyboardInterrupt handler."""
    for signum in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP} - PYTHON_IGNORES:
        try:
            current = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
        if signum in ignored and current is not signal.SIG_IGN:
            _quietly(signal.signal, signum, signal.SIG_IGN)
        elif signum not in ignored and current is signal.SIG_IGN:
            _quietly(signal.signal, signum,
                     signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


def apply(attrs: dict) -> None:
    """Take on the caller's attributes where they differ from this process's (a fresh
    interpreter's start-up keeps them all; python then sets SIGINT's handler unless SIGINT
    was ignored)."""
    if not attrs:
        return
    os.umask(attrs["umask"])
    for name, limits in attrs["rlimits"].items():
        which = getattr(resource, name, None)
        if which is not None and list(resource.getrlimit(which)) != limits:
            _quietly(resource.setrlimit, which, tuple(limits))
    if affinity_change(attrs):
        _quietly(os.sched_setaffinity, 0, attrs["affinity"])
    if os.getpriority(os.PRIO_PROCESS, 0) != attrs["nice"]:
        _quietly(os.setpriority, os.PRIO_PROCESS, 0, attrs["nice"])
    _take_ignored_signals(set(attrs["ignored_signals"]))
    if attrs["blocked_signals"] or signal.pthread_sigmask(signal.SIG_BLOCK, []):
        signal.pthread_sigmask(signal.SIG_SETMASK, attrs["blocked_signals"])
