"""Stage 3a: import the preload set without initialising CUDA, prove it, and keep it current.

Rules while importing (measured on an H200 image):
- ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` keeps ``torch.cuda.is_available()`` off ``cuInit``;
- device queries made at import time (modelopt asks ``get_device_capability``) are answered
  from NVML, and the real functions are put back before the first fork (``cuda``);
- after every import a driver-level probe checks that nothing initialised the driver behind
  torch's back. The first import that did is the culprit (``culprits``): its chain of importers
  is reported and the preload entry that pulled it in is quarantined (remembered per installed
  package set in a verdict cache); the zygote then re-executes itself without it
  (``Quarantined``).

``Preloader`` is the zygote's preload: the verdicts it knows, the import pass (``entries``), the
learned modules it keeps importing while idle, and the image readied for forking.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from typing import Callable, Optional

from .. import interpreter
from ..cuda import PRELOAD_ENV, DriverProbe, nvml_device_count
from ..settings import (IMPORT_ENV_KEYS, NATIVE_ENV, PER_TEST_ENV, QUARANTINE_ENV, RESTARTED_ENV,
                        TERMINAL_ENV, Settings, ZygoteConfig)
from . import import_graph, learn, threads
from .crashes import CrashGuard, collect_crashes
from .culprits import EntryReport, is_dirty, verdict_for, verdict_key
from .deferral import Blocker, top_level
from .entries import PreloadReport, preload, preload_learned
from .envreads import note_reads_elsewhere, read_default, recording_env_reads
from .profiles import read_profile
from .staleness import StalenessWatch
from .startup_code import StartupCode
from .verdicts import DEFER, LEARNED, SCOUTED, VerdictCache, package_fingerprint

__all__ = ["PreloadReport", "EntryReport", "Preloader", "Quarantined", "preload", "VerdictCache",
           "StalenessWatch", "freeze_image", "package_fingerprint"]

log = logging.getLogger(__name__)

MAX_LEARNED_QUARANTINES = 5


class Quarantined(Exception):
    """An entry made the process unfit to fork: re-execute with ``skip`` as the quarantine."""

    def __init__(self, skip: dict, entry: str) -> None:
        verdict = skip[entry]
        super().__init__(f"preload entry {entry} {verdict['reason']} (culprit {verdict['culprit']}"
                         f" via {' -> '.join(verdict['chain'])})")
        self.skip = skip


# Values the stack's imports set wherever they run, even when not here: threadpoolctl's import
# sets KMP_DUPLICATE_LIB_OK=True (setdefault), so a caller whose own imports ran it (through a
# package deferred here, such as torch_geometric) holds that value. It tells an OpenMP runtime
# loaded later to tolerate a second copy, and the step's environment still says so.
IMPORT_DEFAULTS = {"KMP_DUPLICATE_LIB_OK": "True"}


class Preloader:
    """The configured entries, then the learned ones, with cached verdicts applied."""

    def __init__(self, config: ZygoteConfig, settings: Settings, probe: DriverProbe,
                 log: Callable[..., None]) -> None:
        self.config = config
        self.log = log  # the zygote's log
        self.probe = probe
        self.fingerprint = package_fingerprint()
        self.cache = VerdictCache(config.cache_dir, f"{self.fingerprint}-{probe.name}")
        for key, crashed in collect_crashes(config.cache_dir).items():  # an earlier zygote's
            VerdictCache(config.cache_dir, key).update(crashed)
        # Culprits show only where a driver can be initialised (or in tests, the fake one).
        self.scouting = probe.name == "fake" or nvml_device_count() > 0
        self.scouted: set[str] = set()  # entries known to import cleanly (known_verdicts)
        self.portable = read_profile(config.profile)
        self.hints: dict[str, dict] = {}  # verdicts from another package set, to re-verify
        self.skip = dict(settings.quarantine)
        self.skip.update(self.known_verdicts())
        self.blocker = Blocker(k[len(DEFER):] for k in self.skip if k.startswith(DEFER))
        self.blocker.entries = frozenset(top_level(m) for m in config.modules)
        sys.meta_path.insert(0, self.blocker)  # for the zygote's whole life
        self.start_env: dict[str, str] = dict(os.environ)  # what it started with (``run``)
        self.env_set_by_preload: dict[str, str] = {}
        self.env_set_at_startup: dict[str, Optional[str]] = {}  # by start-up code (None: deleted)
        self.learn_reports_dir = ""
        self.profile: Optional[learn.Profile] = None  # set while learning is on
        self.learn_spent_s = 0.0

    def known_verdicts(self) -> dict[str, dict]:
        """This package set's verdicts: the cache's, then a portable profile's (trusted when it
        was written for the same packages and probe, else taken as hints to re-verify)."""
        everything = self.cache.get()
        self.scouted = {k[len(SCOUTED):] for k in everything if k.startswith(SCOUTED)}
        cached = {k: v for k, v in everything.items()
                  if k in self.config.modules or k.startswith((LEARNED, DEFER))}
        if self.portable:
            trusted = (self.portable["fingerprint"], self.portable["probe"]) == (
                self.fingerprint, self.probe.name)
            for key, verdict in self.portable["verdicts"].items():
                if trusted and key.startswith(SCOUTED):
                    self.cache.put(key, verdict)
                    self.scouted.add(key[len(SCOUTED):])
                if key in cached or not (key in self.config.modules or key.startswith(DEFER)):
                    continue
                if trusted:
                    self.cache.put(key, verdict)
                else:
                    self.hints[key] = verdict
                cached[key] = verdict
        return {k: v for k, v in cached.items() if not v.get("cleared")}

    def settle_hint(self, key: str, holds: bool) -> None:
        """Keep what re-verifying a hint found, for the next zygote of this package set."""
        verdict = self.hints.pop(key)
        self.cache.put(key, verdict if holds else {"cleared": True, "hint": verdict})

    def run(self) -> PreloadReport:
        """Preload; raises ``Quarantined`` when an entry must go. Records which variables the
        imports read (a zygote serves only steps that agree on them) and which they set, and
        the same of python's start-up code."""
        self.start_env = dict(os.environ)
        with StartupCode() as startup:  # run again while the preload runs
            report, keys = self.import_entries()
            startup_reads = self.note_startup_code(*startup.answer())
        report.deferred = self.deferred()
        report.hints = {key: "re-verifying" for key in self.hints}
        self.note_env_reads(report, keys | startup_reads | set(IMPORT_ENV_KEYS) | set(NATIVE_ENV)
                            | import_graph.families())
        # And what sys.flags fixed at start-up from the environment (-O, dev mode, UTF-8, ...).
        report.import_env.update({interpreter.FLAG_PREFIX + k: v
                                  for k, v in interpreter.zygote_flags().items()})
        report.import_env[interpreter.USER_SITE_KEY] = interpreter.zygote_user_site()
        return report

    def import_entries(self) -> tuple[PreloadReport, set[str]]:
        """The preload set's entries, then the learned modules: (the report, the variables
        their imports read)."""
        with threads.preload_limits(), recording_env_reads() as keys, import_graph.recording():
            guard = CrashGuard(self.config.cache_dir, self.cache.fingerprint, known=self.scouted)
            report = preload(self.config.modules, self.probe, self.skip, self.blocker,
                             self.should_scout, self.log, guard)
            found = {**report.found, **{k: v for k, v in report.quarantined.items()
                                        if k not in self.skip}}  # unguarded, found just now
            found.update({SCOUTED + e.module: {} for e in report.entries if e.ok and not is_dirty(e)})
            self.cache.update(found)
            if report.abandoned:  # a scout's verdict came while the zygote was in the entry
                raise Quarantined(self.skip, report.abandoned)
            if report.dirty_entry:
                self.quarantine(report.entries[-1], report.dirty_entry)
            if self.config.learn:
                report.learned = self.preload_learned()
                self.note_refused(report)
        return report, keys

    def note_startup_code(self, read: dict[str, Optional[str]],
                          before: dict[str, Optional[str]]) -> set[str]:
        """What python's start-up code did in this process, seen again (``startup_code``):
        returns the variables it read, whose one default counts as the preload's would
        (``envreads.read_default``); ``start_env`` becomes the environment the zygote was
        started with, before the code changed it, and what it changed is replayed in each
        step (``env_set_at_startup``, None: deleted) as a fresh start does it."""
        note_reads_elsewhere(read)
        self.env_set_at_startup = {k: self.start_env.get(k) for k in before}
        for key, value in before.items():
            if value is None:
                self.start_env.pop(key, None)
            else:
                self.start_env[key] = value
        return set(read)

    def note_env_reads(self, report: PreloadReport, keys: set[str]) -> None:
        """Add the variables imports just read to those a step must agree on
        (``report.import_env``), with the value they saw: the environment the zygote started
        with, not what the imports left (some set variables while importing). What they set
        is kept for the steps too (``env_set_by_preload``, updated in place: the zygote's)."""
        keys = keys - {*PRELOAD_ENV, *PER_TEST_ENV, *TERMINAL_ENV, QUARANTINE_ENV, RESTARTED_ENV}
        report.import_env.update({k: interpreter.env_value(self.start_env, k)
                                  for k in sorted(keys) if k not in report.import_env})
        self.env_set_by_preload.update({k: v for k, v in os.environ.items()
                                        if self.start_env.get(k) != v})
        set_by_imports = {**IMPORT_DEFAULTS, **self.env_set_by_preload}
        # A variable, or a family (``X*``) of them, that the imports set where the start had
        # none: a step may hold what they left (its caller's own imports set the same).
        left = {**self.start_env, **set_by_imports}
        # One they read unset, every read with the same default: a step may hold that default.
        unset = [k for k in report.import_env if interpreter.env_value(self.start_env, k) is None]
        may_hold = {k: interpreter.env_value(left, k) for k in unset}
        may_hold.update({k: read_default(k) for k in unset if may_hold[k] is None})
        report.set_while_importing = {k: v for k, v in may_hold.items() if v is not None}

    def should_scout(self, module: str) -> bool:
        """Scout an entry never seen on this package set, where culprits can be seen at all."""
        return self.scouting and module not in self.skip and module not in self.scouted

    def quarantine(self, entry: EntryReport, name: str) -> None:
        """Remember what the dirty entry costs (``verdict_key``) and restart without it."""
        if name.startswith(LEARNED):
            key, verdict = name, verdict_for(entry)
        else:
            key, verdict = verdict_key(entry, self.skip)
        self.cache.put(key, verdict)
        raise Quarantined({**self.skip, key: verdict}, key)

    def deferred(self) -> dict[str, dict]:
        """Each deferred package: its verdict and the guarded imports the block cut off."""
        cuts = self.blocker.cut_imports()
        return {package: {**self.skip[DEFER + package],
                          "cut": [c.to_dict() for c in cuts.get(package, [])]}
                for package in sorted(self.blocker.packages)}

    def preload_learned(self) -> dict:
        """Modules earlier steps imported, within the budget, under the same CUDA-clean rules."""
        project = self.config.project
        self.profile = learn.Profile(self.config.cache_dir, learn.profile_key(project), project)
        if self.profile.check_packages(self.fingerprint):
            self.log("installed packages changed: the learned preload starts over")
        if self.portable:
            self.profile.adopt(self.portable["pinned"] + self.portable["learned"])
        self.profile.merge_reports()
        self.learn_reports_dir = self.profile.reports_dir
        if len(self.refused) > MAX_LEARNED_QUARANTINES:
            self.log("learned preload off: %d learned packages dirtied the zygote", len(self.refused))
            self.profile.save()
            self.profile = None
            return {"disabled": f"{len(self.refused)} learned packages quarantined"}
        summary = self.learn(lambda: True)
        summary["quarantined"] = sorted(self.refused)
        summary["profile"] = self.profile.path
        return summary

    @property
    def refused(self) -> set[str]:
        # Verdicts name top-level packages: importing any module of a package runs its
        # __init__ chain, so one dirty module rules out its package, not learning as a whole.
        return {k[len(LEARNED):] for k in self.skip if k.startswith(LEARNED)}

    def learn(self, keep_going: Callable[[], bool], changed: bool = True) -> dict:
        """Import the learned modules this process lacks while ``keep_going()`` and the budget
        (for the zygote's whole life) allow; raises ``Quarantined`` for a dirty one. The profile
        is saved when ``changed`` or when something was imported."""
        if changed:  # not rewritten after every step for nothing
            self.profile.save()  # which also takes in what others wrote (`learned --forget`)
        exclude = set(self.config.modules) | set(self.profile.data["guards_deferred"])
        modules = [m for m in self.profile.to_preload(exclude=exclude)
                   if top_level(m) not in self.refused | self.blocker.packages]
        budget = self.config.learn_budget_s - self.learn_spent_s
        # as at start-up, while idle too (only for imports: entering the limits costs memory)
        limits = threads.preload_limits() if modules else contextlib.nullcontext()
        with limits, import_graph.recording():
            summary, dirty = preload_learned(modules, self.probe, budget, keep_going, self.blocker,
                                             self.profile.kept_before())
        self.profile.leave_to_steps(summary["guards_deferred"])  # not tried again later
        failed = summary.pop("failed_modules")
        for module in failed:  # what the zygote cannot import goes
            self.profile.drop(module)
        self.learn_spent_s += summary["seconds"]
        summary["imported"] = len(summary["costs"])
        for module, seconds in summary.pop("costs").items():
            self.profile.record_cost(module, seconds)
        for module, why in summary["unlearnable"].items():
            self.log("not learning %s: it %s", module, why)
            self.profile.refuse(module, why)
        refused = {}  # found in a child: no restart
        for module, verdict in summary.pop("dirty").items():
            self.log("not learning %s: %s in a child (culprit %s)", module, verdict["reason"],
                     verdict["culprit"])
            refused[LEARNED + top_level(module)] = verdict
        self.cache.update(refused)  # (one write of the cache file for them all)
        self.skip.update(refused)
        if summary["imported"] or summary["unlearnable"] or summary["guards_deferred"] or failed:
            self.profile.save()
        if dirty is not None:
            self.quarantine(dirty, LEARNED + top_level(dirty.module))
        return summary

    def learn_while_idle(self, idle: Callable[[], bool], report: PreloadReport) -> dict:
        """What finished steps imported that this zygote lacks, imported now, one module at a
        time while ``idle()``: later steps of the same session profit from earlier ones. The
        variables these imports read join ``report.import_env`` as the preload's do."""
        if self.profile is None:
            return {"imported": 0}
        merged = self.profile.merge_reports()
        with recording_env_reads() as keys:
            try:
                return self.learn(idle, changed=merged > 0)
            finally:
                self.note_env_reads(report, set(keys) | import_graph.families())
                self.note_refused(report)

    def note_refused(self, report: PreloadReport) -> None:
        """Learned packages refused by this zygote's own checks join the report's quarantine."""
        report.quarantined.update({k: v for k, v in self.skip.items() if k.startswith(LEARNED)})


def freeze_image() -> None:
    """Ready the preloaded image for forking: children never touch (and copy) its objects'
    pages in GC (its objects' exit-time finalizers: ``import_effects.start_fresh``)."""
    gc.collect()
    gc.freeze()
