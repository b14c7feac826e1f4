"""The preload set imported in order, each entry watched (``culprits``) and scouted where it is
new (``scouts``), stopping at the first that leaves the process unfit to fork; then the learned
modules, within a time budget, under the same rules.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from ..cuda import DriverProbe, cuda_safe_imports
from . import learn
from .crashes import CrashGuard
from .culprits import EntryReport, import_entry, is_dirty, unguarded_verdict, verdict_key
from .deferral import Blocker, top_level
from .scouts import Abandon, Follower, Scout
from .tryout import try_import
from .verdicts import DEFER

__all__ = ["PreloadReport", "preload", "preload_learned"]



@dataclass
class PreloadReport:
    requested: list[str]
    entries: list[EntryReport] = field(default_factory=list)
    quarantined: dict[str, dict] = field(default_factory=dict)  # entry -> verdict
    probe: str = ""
    nvml_answers: bool = False
    seconds: float = 0.0
    import_env: dict[str, Optional[str]] = field(default_factory=dict)
    # Of those, the ones unset at start that the imports set (TORCHINDUCTOR_CACHE_DIR): an
    # environment holding the same value (a process that imported the same stack) matches.
    set_while_importing: dict[str, str] = field(default_factory=dict)
    dirty_entry: str = ""  # set when an entry left the process unfit to fork
    deferred: dict[str, dict] = field(default_factory=dict)  # package -> verdict + cut imports
    hints: dict[str, str] = field(default_factory=dict)  # a profile's verdict -> its check
    found: dict[str, dict] = field(default_factory=dict)  # verdicts scouts found this start
    learned: dict = field(default_factory=dict)  # the learned preload's summary
    abandoned: str = ""  # the verdict key a scout found too late: restart without it

    @property
    def loaded(self) -> list[str]:
        return [e.module for e in self.entries if e.ok]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["loaded"] = self.loaded
        return data


def preload(modules: list[str], probe: DriverProbe, skip: dict[str, dict],
            blocker: Optional[Blocker] = None, scout: Callable[[str], bool] = lambda m: False,
            log: Callable[..., None] = lambda *a: None,
            guard: Optional[CrashGuard] = None) -> PreloadReport:
    """Import ``modules`` in order; stop at the first that makes the process unfit to fork.

    Entries in ``skip`` are quarantined, and so are their submodules (importing one runs the
    quarantined ``__init__`` again). An entry that fails only because it needs a deferred
    package without a guard is quarantined too (``report.quarantined``); the process stays
    clean, so this costs no restart. Entries for which ``scout(entry)`` is true are scouted
    (``scouts``): a verdict a scout finds is added to ``skip`` and ``report.found``; one found
    too late to act on without a restart sets ``report.abandoned``. ``guard`` names each entry
    while it is imported, should it crash the interpreter (``crashes``)."""
    report = PreloadReport(requested=list(modules), probe=probe.name)
    report.quarantined = {k: v for k, v in skip.items() if not k.startswith(DEFER)}
    start = time.perf_counter()
    with cuda_safe_imports() as nvml:
        report.nvml_answers = nvml
        scouting = _Scouting(modules, probe, skip, blocker, scout, report)
        try:
            _import_entries(modules, probe, blocker, scouting, report, log, guard)
        finally:
            scouting.close()
            if guard is not None:
                guard.close()
    report.seconds = round(time.perf_counter() - start, 3)
    return report


def _import_entries(modules: list[str], probe: DriverProbe, blocker: Optional[Blocker],
                    scouting: "_Scouting", report: PreloadReport, log: Callable,
                    guard: Optional[CrashGuard]) -> None:
    for module in modules:
        if _quarantined(module, report.quarantined):
            continue
        log("preloading %s", module)
        try:
            follower = scouting.follower(module)
            if guard is not None:
                guard.importing(module)
            entry = import_entry(module, probe, blocker, follower)
        except Abandon as abandoned:
            if abandoned.entered:  # it ran some of the entry: a restart without it
                report.abandoned = abandoned.key
                return
            report.quarantined[module] = abandoned.verdict
            continue
        report.entries.append(entry)
        if is_dirty(entry):
            report.dirty_entry = module
            return
        if blocker is not None and top_level(entry.missing) in blocker.packages:
            report.quarantined[module] = unguarded_verdict(entry, skip=scouting.skip)


class _Scouting:
    """The scout (``scouts``) of the entries to scout, forked at the first of them and again
    after one that stopped it; the verdicts it finds, acted on."""

    def __init__(self, modules: list[str], probe: DriverProbe, skip: dict,
                 blocker: Optional[Blocker], scout: Callable[[str], bool],
                 report: PreloadReport) -> None:
        self.modules, self.probe, self.skip, self.blocker = modules, probe, skip, blocker
        self.wanted = scout
        self.report = report
        self.scout: Optional[Scout] = None

    def follower(self, module: str) -> Optional[Follower]:
        """The zygote's follower of the scout for ``module``; None where it is not scouted or
        the scout is done with it already (what it found acted on: ``Abandon``, not entered,
        where the entry must go)."""
        if self.blocker is None or module in sys.modules or not self.wanted(module):
            return None
        if self.scout is not None:
            self.scout.catch_up(module)
        if self.scout is None or not self.scout.covers(module):
            self.close()
            rest = [m for m in self.modules[self.modules.index(module):]
                    if not _quarantined(m, self.report.quarantined)]
            # up to the last entry to scout: those after it the zygote imports on its own
            last = max(i for i, m in enumerate(rest) if self.wanted(m) and m not in sys.modules)
            self.scout = Scout(rest[:last + 1], import_entry, is_dirty, self.probe, self.blocker)
        self.scout.read(0)
        outcome = self.scout.outcome(module)
        if outcome is not None:
            self.act(module, outcome, entered=False)
            return None
        return Follower(self.scout, module, top_level(module),
                        lambda done, entered: self.act(module, done, entered))

    def act(self, module: str, outcome: tuple, entered: bool) -> None:
        """What the scout found about ``module``, acted on: a culprit the zygote has not loaded
        is blocked; otherwise an entry that must go raises ``Abandon``."""
        scouted, crashed = outcome
        if crashed is not None:
            key, verdict = module, crashed
        else:
            entry = EntryReport(**scouted) if scouted else None
            # A culprit behind a package deferred already (by an earlier scout) is blocked.
            if entry is None or not is_dirty(entry) or entry.deferrable in self.blocker.packages:
                return
            key, verdict = verdict_key(entry, self.skip)
        self.skip[key] = self.report.found[key] = verdict
        if key.startswith(DEFER) and key[len(DEFER):] not in sys.modules:
            self.blocker.packages.add(key[len(DEFER):])
            return
        raise Abandon(key, verdict, entered)

    def close(self) -> None:
        if self.scout is not None:
            self.scout.end(killed=True)
            self.scout = None


def _quarantined(module: str, quarantined: dict) -> bool:
    return any(module == q or module.startswith(q + ".") for q in quarantined)


def preload_learned(modules: list[str], probe: DriverProbe, budget: float,
                    keep_going: Callable[[], bool] = lambda: True,
                    blocker: Optional[Blocker] = None,
                    kept_before: frozenset = frozenset()) -> tuple[dict, Optional[EntryReport]]:
    """Import learned modules until the time budget is spent or ``keep_going()`` says stop;
    stop at the first dirty one. Each is imported in a child first (``tryout``; not those a
    zygote imported and kept before, ``kept_before``): one that leaves the child unfit to fork,
    warns or prints at import, reaches pytest, tries a deferred package (``blocker``) or fails
    there is never imported here.

    Returns a summary (with each module's cost, and the modules whose import left the child
    unfit to fork, with their verdicts: ``dirty``) and, when one made this process unfit to fork
    all the same, its report."""
    summary = {"listed": len(modules), "loaded": 0, "failed": 0, "over_budget": 0, "seconds": 0.0,
               "costs": {}, "guards_deferred": [], "failed_modules": [], "unlearnable": {},
               "dirty": {}}
    start = time.perf_counter()
    dirty = None
    with cuda_safe_imports():
        for i, module in enumerate(modules):
            if module in sys.modules:
                summary["loaded"] += 1
                continue
            if top_level(module) in {top_level(m) for m in summary["dirty"]}:
                continue  # its package is refused already (the same __init__ chain)
            if time.perf_counter() - start >= budget:
                summary["over_budget"] = len(modules) - i
                break
            if not keep_going():
                summary["interrupted"] = True
                break
            tried = {} if module in kept_before else try_import(module, probe, blocker)
            if tried:  # ruled out by the child's import: none runs here
                _note_ruled_out(summary, module, tried)
                continue
            # What follows keeps out an import that does here what it did not in the child.
            blocked_before = len(blocker.stacks) if blocker is not None else 0
            before = set(sys.modules)
            with learn.ImportEffects() as effects:
                entry = import_entry(module, probe)
            if entry.driver_initialized or entry.torch_cuda_initialized or entry.python_threads:
                dirty = entry
                break
            if blocker is not None and unimport_blocked(blocker, blocked_before, module):
                summary["guards_deferred"].append(module)
                continue
            # The step's own import must warn or print, not ours; and pytest must import its
            # plugins itself, to rewrite their asserts.
            unlearnable = effects.describe() or learn.reaches_test_runner(before)
            if unlearnable:
                learn.undo_import(before)
                summary["unlearnable"][module] = unlearnable
                continue
            summary["loaded" if entry.ok else "failed"] += 1
            summary["costs"][module] = entry.seconds
            if not entry.ok:
                summary["failed_modules"].append(module)
    summary["seconds"] = round(time.perf_counter() - start, 3)
    return summary, dirty


def _note_ruled_out(summary: dict, module: str, tried: dict) -> None:
    if "dirty" in tried:
        summary["dirty"][module] = tried["dirty"]
    elif "deferred" in tried:
        summary["guards_deferred"].append(module)
    elif "unlearnable" in tried:
        summary["unlearnable"][module] = tried["unlearnable"]
    else:
        summary["failed"] += 1
        summary["failed_modules"].append(module)


def unimport_blocked(blocker: Blocker, blocked_before: int, module: str) -> bool:
    """A learned module whose import tried a deferred package (``try: import fakegeo / except
    ImportError: HAVE_GEO = False``) would keep what the block made of it in every step: the
    modules on the way to the blocked import that this import loaded are taken out of
    ``sys.modules`` again, so steps import them fresh. True if there were any."""
    stacks = blocker.stacks[blocked_before:]
    if not stacks:
        return False
    del blocker.stacks[blocked_before:]  # no cut to replay: the step imports them itself
    on_the_way = {frame.module for _, _, frames in stacks for frame in frames if frame.is_module}
    for name in on_the_way | {module}:
        sys.modules.pop(name, None)
    return True
