"""A step's module table starts as a fresh interpreter's; a preloaded module joins it when the
step imports it, as configured as a fresh import would configure it now, or the step runs fresh.

In the zygote (``recording``): each import the preload and the learning make is recorded as an
edge from the module being imported (the innermost module top level running) to what it
imports, names already loaded included, and each environment variable a module's import reads
is recorded against that module with the value it saw.

In a step (``start_fresh``): every module a fresh interpreter lacks at start-up leaves
``sys.modules`` for a stash, and a finder first on ``sys.meta_path`` hands a stashed module back
when the step imports it, with its closure: what its import imported in the zygote, so
``sys.modules`` after ``import transformers`` holds what a fresh ``import transformers`` leaves
(``importlib.util.find_spec`` finds it, and hands nothing back); a package handed back holds
no stashed submodule as an attribute (``detach_submodules``). Before handing back:

- the step's own modules win: a top-level name the step's own path entries provide another
  file for is not handed back, and the step's import finds its file (``shadowing``);
- the closure's import-time environment is checked: a variable one of its modules read at
  import that the step has changed since it started (``os.environ["HF_HUB_OFFLINE"] = "1"``
  before ``import transformers``) means the zygote's modules were configured otherwise than a
  fresh import would configure them now, and ``on_changed`` decides (``rerun``: run the step
  as a fresh interpreter, or fail loudly).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib.abc
import importlib.machinery
import os
import re
import sys
from typing import Callable, Iterator, Optional

from ..interpreter import env_value
from ..settings import NATIVE_ENV, THREAD_ENV
from ..zygote import envreads
from . import import_effects, shadowing

__all__ = ["recording", "start_fresh", "stop_checking", "known_modules", "reads_of", "families",
           "attach"]

# What native code reads when the extensions that load it are imported, invisible to
# ``os.environ``'s recorder (``settings.NATIVE_ENV``: families ``X*``; thread counts): torch's
# and numpy's, with the OpenMP, MKL, oneDNN and OpenBLAS runtimes they bring.
NATIVE_READS = {name: THREAD_ENV + NATIVE_ENV for name in (
    "torch._C", "numpy._core._multiarray_umath", "numpy.core._multiarray_umath")}

_PREFIX = re.compile(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)*_")  # "TQDM_", "HF_HUB_"
# Per-test, terminal and launcher variables differ between a suite's processes for no reason
# an import cares about (``settings``): a scan for them is not a setting the step changed.
_NOT_FAMILIES = {"PYTEST_", "PRELOAD_LAUNCHER_", "_PRELOAD_LAUNCHER_"}
_edges: dict[str, set[str]] = {}  # importer -> what its import imported
_reads: dict[str, dict[str, Optional[str]]] = {}  # module -> {variable: value its import saw}
_roots: set[str] = set()  # modules imported by no module: preload entries, learned modules
_recording = False
_scanning = False  # a scan the recording makes itself
_original_import = builtins.__import__


def _importing(frame) -> Optional[str]:
    """The module whose top level runs at ``frame`` or below it (being imported), if any."""
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            if name in sys.modules and name != "__main__":
                return name
        frame = frame.f_back
    return None


@functools.wraps(_original_import)  # a module may keep it: python's own in all but identity
def _recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    module = _original_import(name, globals, locals, fromlist, level)
    if _recording:
        importer = _importing(sys._getframe(1))
        if importer is not None:
            base = getattr(module, "__name__", None)
            if fromlist:
                names = [base, *(f"{base}.{f}" for f in fromlist if f != "*")]
            else:
                names = [name if level == 0 else base]
            _edges.setdefault(importer, set()).update(
                n for n in names if n != importer and n in sys.modules)
    return module


class _LoadWatcher(importlib.abc.MetaPathFinder):
    """While recording: a module loaded by other means than an import statement
    (``importlib.import_module``, a parent package, a submodule named in a ``from`` list)."""

    def find_spec(self, name, path=None, target=None):
        _edges.setdefault(name, set())  # what its import imports is seen: never derived later
        parent, _, attr = name.rpartition(".")  # what its package held under its name before
        if attr in getattr(sys.modules.get(parent), "__dict__", {}) and name not in _held:
            _held[name] = vars(sys.modules[parent])[attr]
        importer = _importing(sys._getframe(1))
        if importer is None:
            _roots.add(name)
        elif importer != name:
            _edges.setdefault(importer, set()).add(name)
        return None


def _on_env_read(key: str, value: Optional[str]) -> None:
    module = _importing(sys._getframe(2))
    if module is not None:
        _reads.setdefault(module, {}).setdefault(key, value)


def _on_env_scan() -> None:
    """A scan of the whole environment at import, as ``{k[5:]: v for k, v in os.environ.items()
    if k.startswith("TQDM_")}`` reads settings: each family ``PREFIX_*`` its code may test (the
    upper-case text ending in ``_`` among the constants and local values on the way from the
    importing module) counts as read, with the values it has now."""
    global _scanning
    if _scanning:  # our own scan, below
        return
    frame = sys._getframe(2)
    prefixes: set[str] = set()
    while frame is not None:
        code = frame.f_code
        prefixes.update(c for c in code.co_consts if isinstance(c, str) and _PREFIX.fullmatch(c))
        if code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            if name in sys.modules and name != "__main__":
                break
        else:
            prefixes.update(v for v in frame.f_locals.values()
                            if isinstance(v, str) and _PREFIX.fullmatch(v))
        frame = frame.f_back
    if frame is None:
        return
    reads = _reads.setdefault(name, {})
    _scanning = True
    try:
        environ = dict(os.environ)
    finally:
        _scanning = False
    for prefix in prefixes - _NOT_FAMILIES:
        reads.setdefault(prefix + "*", env_value(environ, prefix + "*"))


def families() -> set[str]:
    """The families of variables scans read while recording (``PREFIX_*``)."""
    return {key for reads in _reads.values() for key in reads if key.endswith("*")}


def _derive_edges() -> None:
    """Modules imported before any recording (the launcher's own and the standard library
    modules it uses) get the edges their globals show: the modules bound there, and those
    that the functions and classes bound there come from."""
    for name, module in list(sys.modules.items()):
        if name in _edges or name in shadowing.startup_modules or module is None:
            continue
        found = set()
        for value in list(getattr(module, "__dict__", {}).values()):
            other = getattr(value, "__name__", None) if isinstance(value, type(sys)) else \
                getattr(value, "__module__", None)
            if isinstance(other, str) and other != name and other in sys.modules:
                found.add(other)
        _edges[name] = found


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Record the imports made inside (and what environment each module's import read)."""
    global _recording
    _derive_edges()
    watcher = _LoadWatcher()
    sys.meta_path.insert(0, watcher)
    builtins.__import__ = _recording_import
    _recording = True
    try:
        with envreads.reporting_reads(_on_env_read, _on_env_scan), \
                import_effects.recording(_importing):
            yield
    finally:
        _recording = False
        builtins.__import__ = _original_import
        sys.meta_path[:] = [f for f in sys.meta_path if f is not watcher]
    _prepare()


def reads_of(name: str) -> dict[str, Optional[str]]:
    """The variables ``name``'s own import read (a family ``X*``: all named X...), and their
    values (the recording's; None for what native code read)."""
    native = {key: None for key in NATIVE_READS.get(name, ())}
    return {**native, **_reads.get(name, {})}


# ---------------------------------------------------------------- ahead of the forks

_order: dict[str, int] = {}  # the zygote's import order
_closures: dict[str, tuple[str, ...]] = {}  # a root -> its closure, in import order
_closure_tops: dict[str, frozenset] = {}  # a root -> the top-level names in its closure
# A module that is no package -> the names under it in ``sys.modules``: entries its import put
# there itself (``typing.io`` on 3.10), which no import can find again (not a package).
_aliases: dict[str, tuple[str, ...]] = {}


def _walk(name: str, present) -> set[str]:
    """``name``, its parents and what their imports imported, transitively, among ``present``."""
    found, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in found or current not in present:
            continue
        found.add(current)
        todo.extend(_edges.get(current, ()))
        parent = current.rpartition(".")[0]
        if parent:
            todo.append(parent)
    return found


def _prepare() -> None:
    """In the zygote, once its modules are there: the closure of each module a step imports
    first (a top-level package; a preload entry or learned module, imported by no module), so
    that handing it back in a step is a filter and a few dictionary stores."""
    _order.clear()
    _order.update((name, i) for i, name in enumerate(sys.modules))
    _closures.clear()
    _closure_tops.clear()
    _aliases.clear()
    for name in sys.modules:
        parent = name.rpartition(".")[0]
        if parent and not hasattr(sys.modules.get(parent), "__path__"):
            _aliases[parent] = _aliases.get(parent, ()) + (name,)
    roots = {n for n in sys.modules if "." not in n} | (_roots & set(sys.modules))
    for root in roots:
        found = _walk(root, sys.modules)
        _closures[root] = tuple(sorted(found, key=_order.__getitem__))
        _closure_tops[root] = frozenset(n.partition(".")[0] for n in found)
    import_effects.prepare()


# ---------------------------------------------------------------- in a step

_attached: dict[str, set[str]] = {}  # importer -> what a step's eager replay imported for it
_held: dict[str, object] = {}  # submodule -> its package's attribute of that name before it


def attach(importers: list[str], names: set[str]) -> None:
    """In a step, before ``start_fresh``: ``names`` were imported on behalf of ``importers``
    (``deferral``'s eager replay) and come back with them."""
    for importer in importers:
        _attached.setdefault(importer, set()).update(names)


class _Restorer(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The step's finder for stashed modules; also their loader, which loads nothing."""

    def __init__(self, stash: dict, start_env: dict[str, str],
                 on_changed: Callable[[dict[str, str]], None]) -> None:
        self.stash = stash  # what is still to hand back
        self.zygote_main = sys.modules.get("__main__")  # stashed as __mp_main__ too
        self.detached: dict[str, tuple] = {}  # submodule -> (its package, the attribute)
        self.zygotes = dict(stash)  # every stashed module, handed back or not
        self.decided: dict[tuple, bool] = {}  # (top-level name, own path entries) -> shadowed
        self.listed: dict[tuple, set[str]] = {}  # own path entries -> the names they provide
        self.start_env = start_env
        self.on_changed = on_changed  # {variable: module that read it} -> returns or ends
        self.checking = True

    def find_spec(self, name, path=None, target=None):
        module = self.stash.get(name)
        if module is None or self.shadowed_tops({name.partition(".")[0]}):
            return None
        original = getattr(module, "__spec__", None)
        spec = importlib.machinery.ModuleSpec(
            name, self, origin=getattr(original, "origin", None), loader_state=original,
            is_package=hasattr(module, "__path__"))
        if original is not None:  # what find_spec shows is the module's own
            spec.submodule_search_locations = original.submodule_search_locations
            spec.cached = original.cached
            spec.has_location = original.has_location
        return spec

    def create_module(self, spec):
        return self.hand_back(spec.name)

    def exec_module(self, module) -> None:
        module.__spec__ = module.__spec__.loader_state  # as the zygote's import left it

    def shadowed_tops(self, tops) -> set[str]:
        """Those of the top-level names ``tops`` that the step's ``sys.path`` of now gives
        another file (its entries before the standard library: ``shadowing``). Only names
        those folders hold are asked; each once per set of entries."""
        own = tuple(shadowing.own_path_entries(sys.path))
        if not own:
            return set()
        if own not in self.listed:
            self.listed[own] = shadowing.names_in(own)
        shadowed = set()
        for top in tops & self.listed[own]:
            key = (top, own)
            if key not in self.decided:
                module = self.zygotes.get(top)
                self.decided[key] = module is not None and shadowing.shadows(top, module, own)
            if self.decided[key]:
                shadowed.add(top)
        return shadowed

    def hand_back(self, name: str):
        closure = _closures.get(name)
        if closure is None:  # not a root: walked now
            found = _walk(name, self.stash)
            closure = tuple(sorted(found, key=lambda n: _order.get(n, len(_order))))
            tops = {n.partition(".")[0] for n in found}
        else:
            tops = _closure_tops[name]
        names = [n for n in closure if n in self.stash]
        names += [a for n in names for a in _aliases.get(n, ())
                  if a in self.stash and a not in closure]  # the closure may hold it already
        if _attached:
            names = list(dict.fromkeys(
                names + [a for n in names for a in _attached.get(n, ()) if a in self.stash]))
        shadowed = self.shadowed_tops(tops)
        if shadowed:  # the step's own: not handed back, nor what only they imported
            names = sorted(_walk(name, {n for n in names if n.partition(".")[0] not in shadowed}),
                           key=lambda n: _order.get(n, len(_order)))
        if self.checking and dict(os.environ) != self.start_env:
            self.check_env(names)
        for member in names:
            module = self.stash.pop(member)
            # the zygote's __main__ is never a step's module: an alias of it is the step's own
            sys.modules[member] = sys.modules["__main__"] if module is self.zygote_main else module
        if "multiprocessing" in names and "__main__" in sys.modules:
            # its import's own line, with the step's __main__ (a spawn pool's results need it)
            sys.modules["__mp_main__"] = sys.modules["__main__"]
            self.stash.pop("__mp_main__", None)
        self.detach_submodules(names)
        self.start_env.update(import_effects.bring_back(names))  # set by the imports, not the step
        return sys.modules[name]

    def detach_submodules(self, names: list[str]) -> None:
        """A package holds as attributes only the submodules imported in the step: ``from pkg
        import sub`` of a stashed one imports it then, checking the variables it read."""
        for member in names:
            if member in self.detached:  # handed back now: the attribute its import sets
                package, attr = self.detached.pop(member)
                setattr(package, attr, sys.modules[member])
        for member in names:
            package = sys.modules[member]
            if "__path__" in vars(package):  # no attribute lookup: a module's __getattr__ may
                for attr, value in list(vars(package).items()):  # import or warn (torch's
                    stashed = f"{member}.{attr}"  # deprecated names do), nor a look at values
                    if stashed in self.stash and self.stash[stashed] is value:
                        del vars(package)[attr]  # or what it held before: a function, say
                        if stashed in _held:
                            setattr(package, attr, _held[stashed])
                        self.detached[stashed] = (package, attr)

    def check_env(self, names: list[str]) -> None:
        """The step changed its environment: does a variable these modules read at import now
        differ? (``on_changed`` decides what then.)"""
        changed = {}
        for member in names:
            for key, seen in reads_of(member).items():
                now = env_value(os.environ, key)
                # A scanned family the zygote saw otherwise: learned after its start, no
                # zygote was chosen for it (``preload``), so the step's own start counts too.
                if not envreads.same_to_readers(key, now, env_value(self.start_env, key)) or (
                        key in _reads.get(member, {}) and key.endswith("*") and now != seen):
                    changed.setdefault(key, member)
        if changed:
            self.on_changed(changed)


_restorer: Optional[_Restorer] = None


def start_fresh(keep: set, on_changed: Callable[[dict[str, str]], None],
                runner_env: Optional[dict[str, str]] = None) -> None:
    """Stash every module a fresh interpreter would not have now (all but ``keep`` and the
    start-up modules); the step's imports take them back. ``on_changed``: called with
    ``{variable: module}`` when a closure's import-time environment changed since now.
    ``runner_env``: what the test runner the step starts sets for itself before a test's
    imports (its zygote was chosen with it): the step counts as having started with it."""
    global _restorer
    keep = keep | shadowing.startup_modules | {"__main__"}
    stash = dict(sys.modules)
    sys.modules.clear()
    sys.modules.update({name: stash.pop(name) for name in keep if name in stash})
    _restorer = _Restorer(stash, {**os.environ, **(runner_env or {})}, on_changed)
    sys.meta_path.insert(0, _restorer)


def stop_checking() -> None:
    """The step's code is done: what the launcher imports at exit is not the step's."""
    if _restorer is not None:
        _restorer.checking = False


def known_modules() -> set[str]:
    """The modules in ``sys.modules`` and those still stashed."""
    return set(sys.modules) | (set(_restorer.stash) if _restorer is not None else set())
