"""The scout: on a package set seen for the first time, a forked child imports the preload
entries ahead of the zygote, in the zygote's order, and streams what it passed.

A scout reports a checkpoint at the start and at the end of every import that runs new code
(``s <key>`` / ``e <key>``), each only after checking that the process is still fit to fork, and
a report after each entry (``r <json>``; ``q <json>`` where the entry left it unfit). At the first checkpoint where it is not (the driver
initialised, a Python thread started) it stops, and its report on that entry names the culprit
and its chain. The zygote imports the same entries at the same time and trails its scout
checkpoint by checkpoint (``Follower``): it runs code only once the scout has run it cleanly,
and it enters a new top-level package of another distribution only once the scout finished
importing it — so a culprit to defer is found before the zygote ever starts it, and the zygote
blocks it instead.

One scout serves every entry from the first one to scout, so no stack is imported twice beside
the zygote's own import (a scout per entry, each from the start, imported torch once per entry,
all at once). It is forked from the zygote itself, so it imports each entry in the state the
zygote will import it in; after an entry that left it unfit, or a crash, the zygote forks the
next scout at the next entry, from its own state, the culprit blocked. A scout that dies without
a report (a segfault at import) quarantines the entry it was in.
"""

from __future__ import annotations

import faulthandler
import fcntl
import json
import os
import select
import signal
import sys
import threading
from dataclasses import asdict
from typing import Callable, Optional

from ..result import signal_name
from ..step import runtime
from .crashes import crash_verdict

__all__ = ["Scout", "Reporter", "Follower", "Abandon", "new_code", "checkpoint_key"]

TIMEOUT_S = 300.0  # a scout that says nothing for this long is killed, and not waited for
PIPE_SIZE = 1 << 20  # room for many checkpoints: a scout seldom waits for the zygote to read


class Abandon(BaseException):
    """Raised in the zygote inside an entry's import: its scout found that the entry must go.
    ``entered``: the zygote ran some of the entry's code, which it cannot take back (a restart
    without the entry); else the entry is only skipped. Not an ``Exception``: library guards
    (``except Exception``) must not swallow it."""

    def __init__(self, key: str, verdict: dict, entered: bool) -> None:
        super().__init__(key)
        self.key, self.verdict, self.entered = key, verdict, entered


class _Stop(BaseException):
    """Raised in a scout at its first unfit checkpoint: nothing after it needs importing."""


def checkpoint_key(label: str, fromlist) -> str:
    return f"{label}:{','.join(fromlist)}" if fromlist else label


def _modules_of(key: str) -> list[str]:
    """The modules an import statement's checkpoint key names (``pkg:a,b``: pkg, pkg.a, pkg.b;
    a name that is an attribute, not a module, is harmless here)."""
    label, _, names = key.partition(":")
    return [label] + [f"{label}.{name}" for name in names.split(",") if name and name != "*"]


def new_code(label: str, fromlist) -> bool:
    """Would ``__import__(label, fromlist=...)`` run module code not run before?"""
    module = sys.modules.get(label)
    if module is None:
        return True
    return any(name != "*" and not hasattr(module, name) and f"{label}.{name}" not in sys.modules
               for name in fromlist or ())


class Reporter:
    """The scout's side: a checkpoint is reported once the process is still fit at it."""

    def __init__(self, fd: int, probe) -> None:
        self.fd = fd
        self.probe = probe

    def checkpoint(self, kind: str, key: str, hook) -> None:
        if self.probe.initialized() or threading.active_count() > 1:
            if not hook.culprit:  # dirtied by module code between two imports
                hook.culprit = hook.stack[-1] if hook.stack else key.split(":")[0]
                hook.chain = list(hook.stack) or [hook.culprit]
            raise _Stop()
        os.write(self.fd, f"{kind} {key}\n".encode())


class Scout:
    """The zygote's view of one scout: forked now, it imports ``entries`` in order and stops
    after the first that leaves it unfit (``is_dirty`` of its report)."""

    def __init__(self, entries: list[str], import_entry: Callable, is_dirty: Callable,
                 probe, blocker) -> None:
        self.entries = list(entries)
        self.seen: dict[str, int] = {}  # "s key"/"e key" -> order of its first report
        self.ended: set[str] = set()  # modules whose import the scout finished cleanly
        self.count = 0
        self.reports: dict[str, dict] = {}  # entry -> its EntryReport, as sent
        self.stopped = False  # an entry left it unfit ("q …"): it goes no further
        self.crash: Optional[tuple[str, dict]] = None  # (entry, verdict): it died in that entry
        self.finished = False
        self._buffer = b""
        report_r, report_w = os.pipe()
        try:
            fcntl.fcntl(report_w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass  # the default size: the scout waits for the zygote to read more often

        def scout() -> int:
            os.close(report_r)
            runtime.die_with_parent()
            # The zygote's crash record is the zygote's: a scout's crash is told by its status.
            faulthandler.disable()
            reporter = Reporter(report_w, probe)
            for module in self.entries:
                entry = import_entry(module, probe, blocker, reporter)
                last = is_dirty(entry)  # unfit to go on: the zygote forks the next scout
                line = f"{'q' if last else 'r'} {json.dumps(asdict(entry))}\n"
                os.write(report_w, line.encode())
                if last:
                    break
            return 0

        self.pid = runtime.fork(scout)
        os.close(report_w)
        os.set_blocking(report_r, False)
        self.fd = report_r

    def catch_up(self, entry: str) -> None:
        """Wait until the scout is done with the entries before ``entry`` (the zygote imports
        those it knows without following, so it may be ahead): only then is it known whether
        the scout goes on to ``entry``. It had to pass them to reach ``entry`` anyway."""
        earlier = self.entries[:self.entries.index(entry)] if entry in self.entries else []
        while not (self.finished or self.stopped) and any(e not in self.reports for e in earlier):
            self.read(TIMEOUT_S)

    def covers(self, entry: str) -> bool:
        """Can this scout still tell about ``entry``?"""
        return (entry in self.reports or (self.crash is not None and self.crash[0] == entry)
                or (entry in self.entries and not self.stopped and not self.finished))

    def outcome(self, entry: str) -> Optional[tuple[Optional[dict], Optional[dict]]]:
        """(its report, the crash verdict) once the scout is done with ``entry``; None before.
        (None, None): it went silent, or ended, without telling."""
        if entry in self.reports:
            return self.reports[entry], None
        if self.crash is not None and self.crash[0] == entry:
            return None, self.crash[1]
        if self.finished or self.stopped:
            return None, None
        return None

    def passed(self, checkpoint: str, beyond: bool) -> bool:
        """Has the scout passed ``checkpoint`` (and, with ``beyond``, the next one too)?"""
        index = self.seen.get(checkpoint)
        return index is not None and (not beyond or index < self.count - 1)

    def read(self, wait: Optional[float]) -> None:
        """Take in what the scout sent; ``wait``: seconds to wait for something (0: none)."""
        if self.finished:
            return
        if wait != 0 and not select.select([self.fd], [], [], wait)[0]:
            self.end(killed=True)  # silent for too long
            return
        try:
            chunk = os.read(self.fd, PIPE_SIZE)
        except BlockingIOError:
            return
        if not chunk:
            self.end(killed=False)
            return
        lines = (self._buffer + chunk).split(b"\n")
        self._buffer = lines.pop()
        for line in lines:
            kind, _, rest = line.decode().partition(" ")
            if kind in ("r", "q"):  # (one line: whether it stopped is known with the report)
                report = json.loads(rest)
                self.reports[report["module"]] = report
                self.stopped = kind == "q"
            else:
                self.seen.setdefault(line.decode(), self.count)
                self.count += 1
                if kind == "e":
                    self.ended.update(_modules_of(rest))

    def end(self, killed: bool) -> None:
        """Reap the scout; one that died without telling about the entry it was in, and not
        killed by us, crashed in it."""
        if self.finished:
            return
        self.finished = True
        os.close(self.fd)
        runtime.signal_group(self.pid, signal.SIGKILL)
        _, status = os.waitpid(self.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        untold = [e for e in self.entries if e not in self.reports]
        if untold and not self.stopped and not killed and code != 0:
            how = (f"{signal_name(-code)}: {signal.strsignal(-code)}" if code < 0
                   else f"exit status {code}")
            self.crash = (untold[0], crash_verdict(untold[0], how))


class Follower:
    """The zygote's side of one entry's import: each checkpoint waits for the scout to have
    passed it (``Reporter``); the scout's outcome for the entry, when it comes, goes to
    ``on_outcome``, which blocks a culprit the zygote has not reached, or raises ``Abandon``."""

    def __init__(self, scout: Scout, entry: str, entry_package: str,
                 on_outcome: Callable[[tuple, bool], None]) -> None:
        self.scout, self.entry = scout, entry
        self.entry_package = entry_package
        self.on_outcome = on_outcome
        self.entered = False  # past the entry's first checkpoint: its code has started
        self.settled = False  # the scout is done with the entry; the zygote goes on its own

    def checkpoint(self, kind: str, key: str, hook) -> None:
        if self.settled:
            return
        modules = _modules_of(key)
        top = modules[0].partition(".")[0]
        if kind == "s" and top != self.entry_package and top not in sys.modules:
            ready = lambda: self.scout.ended.issuperset(modules)  # noqa: E731
        elif kind == "s":  # (the scout may have reached the modules by another statement)
            ready = lambda: (self.scout.passed(f"s {key}", beyond=True)  # noqa: E731
                             or self.scout.ended.issuperset(modules))
        else:
            ready = lambda: self.scout.passed(f"e {key}", beyond=True)  # noqa: E731
        self.scout.read(0)
        while not ready() and self.scout.outcome(self.entry) is None:
            self.scout.read(TIMEOUT_S)
        outcome = self.scout.outcome(self.entry)
        if outcome is not None:
            self.settled = True
            self.on_outcome(outcome, self.entered)
        self.entered = True
