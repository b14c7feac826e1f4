"""The process attributes a ``subprocess`` child inherits from its caller: umask, resource
limits, CPU affinity, nice value, scheduling policy, I/O priority, timer slack, OOM score
adjustment, personality (execution domain), ignored signals and the blocked-signal mask.

A forked step would have the zygote's; the caller captures its own at call time (``capture``,
sent in the ``StepSpec``) and the child takes them on before user code (``apply``). What a
forked process cannot have raises ``Unforkable``, and the step runs as a plain subprocess,
which inherits it: a personality other than the zygote's (the kernel applies it as a program
starts), a memory limit (``RLIMIT_AS``, ``RLIMIT_DATA``) lowered to what the zygote maps
already, or nearly (a fresh interpreter starts far below it), and whatever the kernel refuses
the child without a privilege it lacks (a hard limit above the zygote's, a nice value below it,
CPUs outside its set, a scheduling policy, I/O priority or OOM score adjustment).
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
from typing import Callable, Optional

__all__ = ["capture", "place", "apply", "affinity_change", "Unforkable"]

RLIMITS = sorted(name for name in dir(resource) if name.startswith("RLIMIT_"))
# Signals subprocess resets to the default before exec (restore_signals=True): python itself
# ignores them, so ignoring them says nothing about the caller's wishes.
RESTORED = {signal.SIGPIPE, getattr(signal, "SIGXFSZ", signal.SIGPIPE)}

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30
PERSONALITY_QUERY = 0xFFFFFFFF  # personality() with it changes nothing, returns the current one
# ioprio_get and ioprio_set have no libc wrapper: their numbers, (set, get), per architecture
# (elsewhere the I/O priority is neither captured nor set).
IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31)}.get(os.uname().machine)
IOPRIO_WHO_PROCESS = 1
POLICY_NAMES = {getattr(os, name): name for name in
                ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE", "SCHED_FIFO", "SCHED_RR")}
# The limits that count what a process maps already, with the status field that counts it.
MEMORY_LIMITS = {"RLIMIT_AS": "VmSize", "RLIMIT_DATA": "VmData"}
# What a forked step still maps before its first line (its module table, fresh stdio): under a
# limit with less room than this above the zygote's mappings, the launcher's own code would
# fail on it, not the program.
START_ROOM = 64 << 20


class Unforkable(Exception):
    """The caller has an attribute that a process forked from the zygote cannot have: the step
    runs as a plain subprocess instead (the message says why)."""


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


def _answer(result: int) -> Optional[int]:
    """A libc call's answer; None where it failed (a container's seccomp profile may refuse
    the call: the attribute is then not carried)."""
    return None if result == -1 else result


def _checked(result: int) -> int:
    if result == -1:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def _scheduling() -> list[int]:
    """[policy, priority] as a child of this thread starts with them (SCHED_RESET_ON_FORK: a
    real-time policy becomes SCHED_OTHER)."""
    policy, priority = os.sched_getscheduler(0), os.sched_getparam(0).sched_priority
    if policy & os.SCHED_RESET_ON_FORK:
        policy &= ~os.SCHED_RESET_ON_FORK
        if policy not in (os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_IDLE):
            policy, priority = os.SCHED_OTHER, 0
    return [policy, priority]


def _io_priority() -> Optional[int]:
    if IOPRIO_SYSCALLS is None:
        return None
    return _answer(_libc.syscall(*map(ctypes.c_long, (IOPRIO_SYSCALLS[1], IOPRIO_WHO_PROCESS, 0))))


def _timer_slack() -> Optional[int]:
    return _answer(_libc.prctl(PR_GET_TIMERSLACK, *map(ctypes.c_ulong, (0, 0, 0, 0))))


def _oom_score_adj() -> Optional[int]:
    try:
        with open("/proc/self/oom_score_adj") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _personality() -> Optional[int]:
    return _answer(_libc.personality(ctypes.c_ulong(PERSONALITY_QUERY)))


def capture() -> dict:
    """This process's (this thread's, for the signal mask, the scheduling policy, the I/O
    priority and the timer slack) attributes, as plain data."""
    status = _status()
    return {
        "umask": _umask(status),
        "rlimits": {name: list(resource.getrlimit(getattr(resource, name))) for name in RLIMITS},
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "scheduling": _scheduling(),
        "io_priority": _io_priority(),
        "timer_slack": _timer_slack(),
        "oom_score_adj": _oom_score_adj(),
        "personality": _personality(),
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


def _refuse_what_no_fork_can_have(attrs: dict) -> None:
    """Before anything changes: another personality (the kernel applies most of it as a
    program starts), or a memory limit lowered to what this process maps already, or nearly
    (a fresh interpreter starts far below it)."""
    personality = attrs.get("personality")
    if personality is not None and personality != _personality():
        raise Unforkable(f"its caller's personality ({personality:#x}) takes effect only as a "
                         f"program starts")
    for name, field in MEMORY_LIMITS.items():
        soft = attrs["rlimits"].get(name, [resource.RLIM_INFINITY])[0]
        if soft in (resource.RLIM_INFINITY, resource.getrlimit(getattr(resource, name))[0]):
            continue  # not lowered here (a rank has its agent's, which it inherited)
        status = _status()
        used = int(status[field].split()[0]) << 10 if field in status else 0
        if soft < used + START_ROOM:
            raise Unforkable(f"its caller's {name} ({soft >> 20} MiB) leaves too little room "
                             f"above the {used >> 20} MiB a process forked from the zygote maps")


def _set_scheduling(scheduling: list[int]) -> None:
    os.sched_setscheduler(0, scheduling[0], os.sched_param(scheduling[1]))


def _set_io_priority(value: int) -> None:
    args = (IOPRIO_SYSCALLS[0], IOPRIO_WHO_PROCESS, 0, value)  # type: ignore[index]
    _checked(_libc.syscall(*map(ctypes.c_long, args)))


def _set_timer_slack(nanoseconds: int) -> None:
    _checked(_libc.prctl(PR_SET_TIMERSLACK, *map(ctypes.c_ulong, (nanoseconds, 0, 0, 0))))


def _set_oom_score_adj(value: int) -> None:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write(str(value))


def _take(wanted, get: Callable, put: Callable, named: Callable) -> None:
    """Set one attribute to the caller's value (None: not known, left as it is). One the
    kernel refuses this process (a privilege the zygote lacks: a fork cannot gain one) is
    ``Unforkable``: the caller's own child has it."""
    if wanted is None or wanted == get():
        return
    try:
        put(wanted)
    except (OSError, ValueError) as err:  # setrlimit says EPERM as ValueError
        raise Unforkable(f"a process forked from the zygote may not take its caller's "
                         f"{named(wanted)} ({getattr(err, 'strerror', None) or err})") from None


# Limits that gate the nice value and the scheduling policy set after them: raised before,
# lowered after (lowered first, they would refuse the child what the zygote's allowed).
GATES = ("RLIMIT_NICE", "RLIMIT_RTPRIO")


def _raises(name: str, limits: list) -> bool:
    which = getattr(resource, name, None)
    if which is None:
        return False
    current = resource.getrlimit(which)
    return any(w != c and (w == resource.RLIM_INFINITY or c != resource.RLIM_INFINITY and w > c)
               for w, c in zip(limits, current))


def _set_affinity(cpus: list) -> None:
    os.sched_setaffinity(0, cpus)
    if os.sched_getaffinity(0) != set(cpus):  # the kernel keeps only those of our cpuset
        raise OSError(errno.EINVAL, "outside the CPUs it may use")


def _take_rlimit(name: str, limits: list) -> None:
    which = getattr(resource, name, None)
    if which is not None:
        _take(limits, lambda: list(resource.getrlimit(which)),
              lambda pair: resource.setrlimit(which, tuple(pair)),
              lambda pair: f"{name} (soft {pair[0]}, hard {pair[1]})")


# What the kernel may refuse a forked process, in the order it is set (the policy before the
# timer slack: a real-time policy sets the slack, to 0, which prctl cannot set):
# {key: (get this process's, set it, how to name a value)}.
REFUSABLE = {
    "scheduling": (_scheduling, _set_scheduling,
                   lambda v: f"scheduling policy {POLICY_NAMES.get(v[0], v[0])}"),
    "io_priority": (_io_priority, _set_io_priority,
                    lambda v: f"I/O priority (class {v >> 13}, level {v & 0x1FFF})"),
    "timer_slack": (_timer_slack, _set_timer_slack, lambda v: f"timer slack ({v} ns)"),
    "oom_score_adj": (_oom_score_adj, _set_oom_score_adj, lambda v: f"oom_score_adj ({v})"),
}


def apply(attrs: dict) -> None:
    """Take on the caller's attributes where they differ from this process's (a fresh
    interpreter's start-up keeps them all; python then sets SIGINT's handler unless SIGINT
    was ignored). Raises ``Unforkable`` for one this process cannot have (before changing
    anything, where that can be told beforehand)."""
    if not attrs:
        return
    _refuse_what_no_fork_can_have(attrs)
    os.umask(attrs["umask"])
    rlimits = attrs["rlimits"]
    for name, limits in rlimits.items():
        if name not in GATES or _raises(name, limits):
            _take_rlimit(name, limits)
    _take(affinity_change(attrs), lambda: None, _set_affinity, lambda cpus: f"CPU set {cpus}")
    _take(attrs["nice"], lambda: os.getpriority(os.PRIO_PROCESS, 0),
          lambda nice: os.setpriority(os.PRIO_PROCESS, 0, nice),
          lambda nice: f"nice value ({nice})")
    for key, (get, put, named) in REFUSABLE.items():
        _take(attrs.get(key), get, put, named)
    for name in GATES:
        if name in rlimits:
            _take_rlimit(name, rlimits[name])
    _take_ignored_signals(set(attrs["ignored_signals"]))
    if attrs["blocked_signals"] or signal.pthread_sigmask(signal.SIG_BLOCK, []):
        signal.pthread_sigmask(signal.SIG_SETMASK, attrs["blocked_signals"])
