"""A step's module table starts as a fresh interpreter's; a preloaded module joins it when the
step imports it, as configured as a fresh import would configure it now, or the step runs fresh.

In a step (``start_fresh``): every module a fresh interpreter lacks at start-up leaves
``sys.modules`` for a stash, and a finder first on ``sys.meta_path`` hands a stashed module back
when the step imports it, with its closure: what its import imported in the zygote
(``zygote.import_graph``), so ``sys.modules`` after ``import transformers`` holds what a fresh
``import transformers`` leaves (``importlib.util.find_spec`` finds it, and hands nothing back); a
package handed back holds no stashed submodule as an attribute (``detach_submodules``). Before
handing back:

- the step's own modules win: a top-level name the step's own path entries provide another
  file for is not handed back, and the step's import finds its file (``shadowing``);
- the closure's import-time environment is checked: a variable one of its modules read at
  import that the step has changed since it started (``os.environ["HF_HUB_OFFLINE"] = "1"``
  before ``import transformers``) means the zygote's modules were configured otherwise than a
  fresh import would configure them now, and ``on_changed`` decides (``rerun``: run the step
  as a fresh interpreter, or fail loudly).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Callable, Optional

from ..interpreter import env_value
from ..zygote import envreads, import_graph, threads
from . import import_effects, shadowing

__all__ = ["start_fresh", "stop_checking", "known_modules", "attach"]

_attached: dict[str, set[str]] = {}  # importer -> what a step's eager replay imported for it


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
        closure = import_graph.closures.get(name)
        if closure is None:  # not a root: walked now
            found = import_graph.walk(name, self.stash)
            closure = tuple(import_graph.in_import_order(found))
            tops = {n.partition(".")[0] for n in found}
        else:
            tops = import_graph.closure_tops[name]
        names = [n for n in closure if n in self.stash]
        names += [a for n in names for a in import_graph.aliases.get(n, ())
                  if a in self.stash and a not in closure]  # the closure may hold it already
        if _attached:
            names = list(dict.fromkeys(
                names + [a for n in names for a in _attached.get(n, ()) if a in self.stash]))
        shadowed = self.shadowed_tops(tops)
        if shadowed:  # the step's own: not handed back, nor what only they imported
            names = import_graph.in_import_order(import_graph.walk(
                name, {n for n in names if n.partition(".")[0] not in shadowed}))
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
        threads.take_counts({n.partition(".")[0] for n in names})
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
                        if stashed in import_graph.held:
                            setattr(package, attr, import_graph.held[stashed])
                        self.detached[stashed] = (package, attr)

    def check_env(self, names: list[str]) -> None:
        """The step changed its environment: does a variable these modules read at import now
        differ? (``on_changed`` decides what then.)"""
        changed = {}
        for member in names:
            for key, seen in import_graph.reads_of(member).items():
                now = env_value(os.environ, key)
                # A scanned family the zygote saw otherwise: learned after its start, no
                # zygote was chosen for it (``preload``), so the step's own start counts too.
                if not envreads.same_to_readers(key, now, env_value(self.start_env, key)) or (
                        key in import_graph.reads.get(member, {}) and key.endswith("*")
                        and now != seen):
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
    threads.take_counts({n.partition(".")[0] for n in sys.modules})  # held from the start
    _restorer = _Restorer(stash, {**os.environ, **(runner_env or {})}, on_changed)
    sys.meta_path.insert(0, _restorer)


def stop_checking() -> None:
    """The step's code is done: what the launcher imports at exit is not the step's."""
    if _restorer is not None:
        _restorer.checking = False


def known_modules() -> set[str]:
    """The modules in ``sys.modules`` and those still stashed."""
    return set(sys.modules) | (set(_restorer.stash) if _restorer is not None else set())
