"""Stage 3a: import the preload set without initialising CUDA, prove it, and keep it current.

Rules while importing (measured on an H200 image):
- ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` keeps ``torch.cuda.is_available()`` off ``cuInit``;
- device queries made at import time (modelopt asks ``get_device_capability``) are answered
  from NVML, and the real functions are put back before the first fork (``cuda``);
- after every import a driver-level probe checks that nothing initialised the driver behind
  torch's back. The first import that did is the culprit: its chain of importers is reported
  and the preload entry that pulled it in is quarantined (remembered per installed package set
  in a verdict cache); the zygote then re-executes itself without it (``Quarantined``).
"""

from __future__ import annotations

import builtins
import gc
import importlib.util
import logging
import os
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from . import learn, threads
from .verdicts import DEFER, LEARNED, SCOUTED, VerdictCache, package_fingerprint
from .profiles import read_profile
from .cuda import (PRELOAD_ENV, DriverProbe, cuda_safe_imports, nvml_device_count,
                   torch_cuda_initialized)
from .deferral import Blocker, top_level
from .envreads import recording_env_reads
from .crashes import CrashGuard, collect_crashes
from .procfs import native_threads
from .staleness import StalenessWatch
from .scouts import Abandon, Follower, Scouts, ScoutStream, checkpoint_key, new_code
from .settings import IMPORT_ENV_KEYS, PER_TEST_ENV, QUARANTINE_ENV, RESTARTED_ENV, Settings, ZygoteConfig

__all__ = ["PreloadReport", "EntryReport", "Preloader", "Quarantined", "preload", "VerdictCache",
           "StalenessWatch", "freeze_image", "package_fingerprint"]

log = logging.getLogger(__name__)

MAX_LEARNED_QUARANTINES = 5


# ---------------------------------------------------------------- culprit hunting

@dataclass
class EntryReport:
    module: str
    seconds: float = 0.0
    ok: bool = False
    error: str = ""
    python_threads: list[str] = field(default_factory=list)
    native_threads_added: int = 0
    torch_cuda_initialized: bool = False
    driver_initialized: bool = False
    culprit: str = ""
    chain: list[str] = field(default_factory=list)
    deferrable: str = ""  # the package to defer instead of the entry, if any
    missing: str = ""  # the module an ImportError named


@dataclass
class PreloadReport:
    requested: list[str]
    entries: list[EntryReport] = field(default_factory=list)
    quarantined: dict[str, dict] = field(default_factory=dict)  # entry -> verdict
    probe: str = ""
    nvml_answers: bool = False
    seconds: float = 0.0
    import_env: dict[str, Optional[str]] = field(default_factory=dict)
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


class _CulpritHook:
    """Wraps ``__import__`` to catch the first import after which the driver is initialised,
    and the chain of modules that were importing it; keeps the live stack of ``__import__``
    calls for a scout's or the zygote's ``watcher`` (``scouts``)."""

    def __init__(self, probe: DriverProbe) -> None:
        self.probe = probe
        self.stack: list[str] = []
        self.culprit = ""
        self.chain: list[str] = []
        self._original = builtins.__import__
        self.watcher = None  # a scout's Reporter or the zygote's Follower (``scouts``)

    def __call__(self, name, globals=None, locals=None, fromlist=(), level=0):
        label = name
        if level:
            try:
                label = importlib.util.resolve_name("." * level + name,
                                                    (globals or {}).get("__package__") or "")
            except (ImportError, ValueError):
                pass
        key = checkpoint_key(label, fromlist) if self.watcher and new_code(label, fromlist) else ""
        if key:
            self.watcher.checkpoint("s", key, self)
        self.stack.append(label)
        try:
            return self._original(name, globals, locals, fromlist, level)
        finally:
            self.stack.pop()
            threads.pin_for_preload()  # torch's pool at one thread as soon as torch is here
            if not self.culprit and self.probe.initialized():
                self.culprit = label
                self.chain = _dedupe(_modules_being_imported() + [label])
            if key:
                self.watcher.checkpoint("e", key, self)

    def __enter__(self):
        builtins.__import__ = self
        return self

    def __exit__(self, *exc):
        builtins.__import__ = self._original


def _modules_being_imported() -> list[str]:
    """The modules whose top level runs on this thread's stack, outermost first: the chain of
    importers however each import was spelt (``from . import x`` and ``importlib.import_module``
    never call ``__import__`` for ``x``)."""
    names = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") != "__main__":
            names.append(frame.f_globals.get("__name__", ""))
        frame = frame.f_back
    return names[::-1]


def _dedupe(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        if not out or out[-1] != name:
            out.append(name)
    return out


def import_entry(module: str, probe: DriverProbe, blocker: Optional[Blocker] = None,
                 watcher=None) -> EntryReport:
    """Import one preload entry and record what it did to the process. ``watcher``: a scout's
    ``Reporter`` or the zygote's ``Follower`` of its scout (``scouts``)."""
    report = EntryReport(module=module)
    threads_before = sum(native_threads().values())
    loaded_before = {top_level(m) for m in sys.modules}
    threads.pin_for_preload()
    start = time.perf_counter()
    with _CulpritHook(probe) as hook:
        hook.watcher = watcher
        try:
            if watcher is not None:
                watcher.checkpoint("s", module, hook)
            importlib.import_module(module)
            if watcher is not None:
                watcher.checkpoint("e", module, hook)
            report.ok = True
        except Abandon:
            raise
        except BaseException as exc:  # a failed preload is reported, never fatal
            report.error = f"{type(exc).__name__}: {exc}"
            report.missing = getattr(exc, "name", None) or "" if isinstance(exc, ImportError) else ""
    report.seconds = round(time.perf_counter() - start, 3)
    report.native_threads_added = sum(native_threads().values()) - threads_before
    report.python_threads = [t.name for t in threading.enumerate()
                             if t is not threading.main_thread()]
    report.torch_cuda_initialized = torch_cuda_initialized()
    report.driver_initialized = probe.initialized()
    if report.driver_initialized or report.torch_cuda_initialized:
        report.culprit = hook.culprit or module
        # import_module() bypasses __import__, so the entry itself heads the chain here.
        report.chain = _dedupe([module] + hook.chain)
        report.deferrable = deferrable_package(report.chain, loaded_before,
                                               blocker.entries if blocker else frozenset())
    return report


def deferrable_package(chain: list[str], loaded_before: set[str],
                       entries: frozenset = frozenset()) -> str:
    """The package to defer for a culprit reached through ``chain``: the first one on the way
    from another distribution than the entry's that was not loaded before ('' when none) —
    passing over packages that are preload entries themselves while a deeper one can be
    deferred (megatron.bridge reaches torch_geometric through modelopt, which stays)."""
    entry_package = top_level(chain[0])
    candidates = []
    for module in chain[1:]:
        package = top_level(module)
        if package != entry_package and package not in loaded_before and package not in candidates:
            candidates.append(package)
    preferred = [package for package in candidates if package not in entries]
    return (preferred or candidates or [""])[0]


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
        scouts = Scouts([m for m in modules if m not in sys.modules and scout(m)], import_entry,
                        probe, blocker) if blocker is not None else None
        try:
            _import_entries(modules, probe, skip, blocker, scouts, report, log, guard)
        finally:
            if scouts is not None:
                scouts.close()
            if guard is not None:
                guard.close()
    report.seconds = round(time.perf_counter() - start, 3)
    return report


def _import_entries(modules: list[str], probe: DriverProbe, skip: dict, blocker: Optional[Blocker],
                    scouts: Optional[Scouts], report: PreloadReport, log: Callable,
                    guard: Optional[CrashGuard]) -> None:
    for module in modules:
        if _quarantined(module, report.quarantined):
            continue
        log("preloading %s", module)
        stream = scouts.stream(module) if scouts is not None else None
        follower = None
        if stream is not None:
            scouts.drain()
            if stream.report is not None or stream.finished:  # it is done already
                stream.end(killed=stream.report is not None)
                if not _act_on_scout(stream, skip, blocker, report, started=False):
                    continue
            else:
                follower = Follower(scouts, stream, top_level(module), lambda done: (
                    _act_on_scout(done, skip, blocker, report, started=True)))
        if guard is not None:
            guard.importing(module)
        try:
            entry = import_entry(module, probe, blocker, follower)
        except Abandon as abandoned:
            report.abandoned = abandoned.key
            return
        finally:
            if stream is not None:
                stream.end(killed=True)  # the zygote's own import is proven: done with it
        report.entries.append(entry)
        if is_dirty(entry):
            report.dirty_entry = module
            return
        if blocker is not None and top_level(entry.missing) in blocker.packages:
            report.quarantined[module] = unguarded_verdict(entry, skip)


def _act_on_scout(stream: ScoutStream, skip: dict, blocker: Blocker, report: PreloadReport,
                  started: bool) -> bool:
    """What a scout found about its entry, acted on: False when the entry must not be
    imported. ``started``: the zygote is inside the entry's import already (it cannot take
    back what it imported: an entry to quarantine, or a culprit it entered, raises ``Abandon``,
    for a restart without it)."""
    if stream.verdict is not None:  # it crashed the scout
        key, verdict = stream.module, stream.verdict
    else:
        scouted = EntryReport(**stream.report) if stream.report else None
        # A culprit behind a package another entry's scout had deferred is blocked already.
        if scouted is None or not is_dirty(scouted) or scouted.deferrable in blocker.packages:
            return True
        key, verdict = verdict_key(scouted, skip)
    skip[key] = report.found[key] = verdict
    if key.startswith(DEFER) and key[len(DEFER):] not in sys.modules:
        blocker.packages.add(key[len(DEFER):])
        return True
    if started:
        raise Abandon(key, verdict)
    report.quarantined[stream.module] = verdict
    return False


def _quarantined(module: str, quarantined: dict) -> bool:
    return any(module == q or module.startswith(q + ".") for q in quarantined)


def unguarded_verdict(entry: EntryReport, skip: dict) -> dict:
    """An entry that imports a deferred package without a guard: it cannot be preloaded."""
    package = top_level(entry.missing)
    deferred = skip.get(DEFER + package, {})
    return {"culprit": deferred.get("culprit", package),
            "chain": deferred.get("chain", [entry.module, package]),
            "reason": f"{deferred.get('reason', 'initialised CUDA')}; {entry.module} imports "
                      f"{package} without a guard, so {package} cannot be deferred"}


def preload_learned(modules: list[str], probe: DriverProbe, budget: float,
                    keep_going: Callable[[], bool] = lambda: True,
                    blocker: Optional[Blocker] = None) -> tuple[dict, Optional[EntryReport]]:
    """Import learned modules until the time budget is spent or ``keep_going()`` says stop;
    stop at the first dirty one. One that tries a deferred package is not kept (``blocker``).

    Returns a summary (with each module's cost) and, when one made the process unfit to fork,
    its report."""
    summary = {"listed": len(modules), "loaded": 0, "failed": 0, "over_budget": 0, "seconds": 0.0,
               "costs": {}, "guards_deferred": [], "failed_modules": [], "unlearnable": {}}
    start = time.perf_counter()
    dirty = None
    with cuda_safe_imports():
        for i, module in enumerate(modules):
            if module in sys.modules:
                summary["loaded"] += 1
                continue
            if time.perf_counter() - start >= budget:
                summary["over_budget"] = len(modules) - i
                break
            if not keep_going():
                summary["interrupted"] = True
                break
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
            if effects.describe():  # the step's own import must warn or print, not ours
                learn.undo_import(before)
                summary["unlearnable"][module] = effects.describe()
                continue
            summary["loaded" if entry.ok else "failed"] += 1
            summary["costs"][module] = entry.seconds
            if not entry.ok:
                summary["failed_modules"].append(module)
    summary["seconds"] = round(time.perf_counter() - start, 3)
    return summary, dirty


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


def verdict_for(entry: EntryReport) -> dict:
    if entry.python_threads and not (entry.driver_initialized or entry.torch_cuda_initialized):
        reason = f"started Python threads at import: {', '.join(entry.python_threads)}"
    elif entry.driver_initialized and not entry.torch_cuda_initialized:
        reason = "initialised the CUDA driver behind torch's back"
    else:
        reason = "initialised CUDA"
    return {"culprit": entry.culprit or entry.module, "chain": entry.chain, "reason": reason}


def is_dirty(entry: EntryReport) -> bool:
    """Did this import leave the process unfit to fork?"""
    return bool(entry.driver_initialized or entry.torch_cuda_initialized or entry.python_threads)


def verdict_key(entry: EntryReport, skip: dict) -> tuple[str, dict]:
    """What a dirty entry costs: its culprit's package deferred when that is another
    distribution's (the entry stays), else the entry itself quarantined."""
    verdict = verdict_for(entry)
    if entry.deferrable and DEFER + entry.deferrable not in skip:
        return DEFER + entry.deferrable, {**verdict, "entry": entry.module}
    return entry.module, verdict


# ---------------------------------------------------------------- the zygote's preload

class Quarantined(Exception):
    """An entry made the process unfit to fork: re-execute with ``skip`` as the quarantine."""

    def __init__(self, skip: dict, entry: str) -> None:
        verdict = skip[entry]
        super().__init__(f"preload entry {entry} {verdict['reason']} (culprit {verdict['culprit']}"
                         f" via {' -> '.join(verdict['chain'])})")
        self.skip = skip


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
        self.env_set_by_preload: dict[str, str] = {}
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
        imports read (a zygote serves only steps that agree on them) and which they set."""
        start_env = dict(os.environ)
        with threads.preload_limits(), recording_env_reads() as keys:
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
        report.deferred = self.deferred()
        report.hints = {key: "re-verifying" for key in self.hints}
        keys = (keys | set(IMPORT_ENV_KEYS)) - {*PRELOAD_ENV, *PER_TEST_ENV, QUARANTINE_ENV,
                                                RESTARTED_ENV}
        # What the imports saw, not what they left: some set variables while importing.
        report.import_env = {k: start_env.get(k) for k in sorted(keys)}
        self.env_set_by_preload = {k: v for k, v in os.environ.items() if start_env.get(k) != v}
        return report

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
        summary, dirty = preload_learned(modules, self.probe, budget, keep_going, self.blocker)
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
        if summary["imported"] or summary["unlearnable"] or summary["guards_deferred"] or failed:
            self.profile.save()
        if dirty is not None:
            self.quarantine(dirty, LEARNED + top_level(dirty.module))
        return summary

    def learn_while_idle(self, idle: Callable[[], bool]) -> dict:
        """What finished steps imported that this zygote lacks, imported now, one module at a
        time while ``idle()``: later steps of the same session profit from earlier ones."""
        if self.profile is None:
            return {"imported": 0}
        merged = self.profile.merge_reports()
        return self.learn(idle, changed=merged > 0)


def hint_holds(key: str, probe: DriverProbe, blocker: Blocker) -> bool:
    """In a forked child of the zygote: does importing what ``key`` names still make a process
    unfit to fork? (The child is thrown away either way.)"""
    module = key[len(DEFER):] if key.startswith(DEFER) else key
    blocker.packages.discard(top_level(module))
    with cuda_safe_imports():
        entry = import_entry(module, probe)
    return bool(entry.driver_initialized or entry.torch_cuda_initialized or entry.python_threads)


def freeze_image() -> None:
    """Ready the preloaded image for forking: children never touch (and copy) its objects'
    pages in GC, and inherit no exit-only finalizers."""
    skip_exit_only_finalizers()
    gc.collect()
    gc.freeze()


def skip_exit_only_finalizers() -> int:
    """Unhook torch.library's per-library exit finalizers from ``atexit`` (children inherit this).

    Each deregisters an operator library from the dying process: ~30 ms per step with torch
    loaded and nothing a program can observe, like the module teardown ``os._exit`` skips.
    Libraries a step creates itself keep their finalizers."""
    skipped = 0
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        info = finalizer._registry.get(finalizer)  # type: ignore[attr-defined]
        func = getattr(info, "func", None)
        if getattr(func, "__module__", "") == "torch.library" and func.__name__ == "_del_library":
            finalizer.atexit = False
            skipped += 1
    return skipped
