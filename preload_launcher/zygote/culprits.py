"""One preload entry's import, watched: the ``__import__`` hook that finds the first import after
which the CUDA driver is initialised (the culprit) and the chain of importers that reached it,
and the verdict a dirty entry earns (its culprit's package deferred, or the entry quarantined).
"""

from __future__ import annotations

import builtins
import functools
import importlib.util
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from ..cuda import DriverProbe, cuda_safe_imports, torch_cuda_initialized
from ..procfs import native_threads
from . import threads
from .deferral import Blocker, top_level
from .scouts import Abandon, checkpoint_key, new_code
from .verdicts import DEFER

__all__ = ["EntryReport", "import_entry", "deferrable_package", "verdict_for", "is_dirty",
           "verdict_key", "unguarded_verdict", "hint_holds"]



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
        builtins.__import__ = self._delegator()
        return self

    def __exit__(self, *exc):
        self.active = False
        builtins.__import__ = self._original

    def _delegator(self):
        """What ``builtins.__import__`` is while the entry imports. A module may keep it (to
        wrap imports of its own): once the import is over, what it kept is the original
        ``__import__`` again in all but identity, in every forked step."""
        hook, original = self, self._original
        self.active = True

        @functools.wraps(original)
        def __import__(name, globals=None, locals=None, fromlist=(), level=0):
            if hook.active:
                return hook(name, globals, locals, fromlist, level)
            return original(name, globals, locals, fromlist, level)
        return __import__


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


def unguarded_verdict(entry: EntryReport, skip: dict) -> dict:
    """An entry that imports a deferred package without a guard: it cannot be preloaded."""
    package = top_level(entry.missing)
    deferred = skip.get(DEFER + package, {})
    return {"culprit": deferred.get("culprit", package),
            "chain": deferred.get("chain", [entry.module, package]),
            "reason": f"{deferred.get('reason', 'initialised CUDA')}; {entry.module} imports "
                      f"{package} without a guard, so {package} cannot be deferred"}


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


def hint_holds(key: str, probe: DriverProbe, blocker: Blocker) -> bool:
    """In a forked child of the zygote: does importing what ``key`` names still make a process
    unfit to fork? (The child is thrown away either way.)"""
    module = key[len(DEFER):] if key.startswith(DEFER) else key
    blocker.packages.discard(top_level(module))
    with cuda_safe_imports():
        entry = import_entry(module, probe)
    return bool(entry.driver_initialized or entry.torch_cuda_initialized or entry.python_threads)
