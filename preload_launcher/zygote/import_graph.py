"""The zygote's record of its imports, which lets a step's module table start as a fresh
interpreter's (``step.module_table``).

While the preload and the learning import (``recording``), each import is recorded as an edge
from the module being imported (the innermost module top level running) to what it imports,
names already loaded included, whether a finder loaded it, an import statement named it or the
running import put it into ``sys.modules`` by hand; and each environment variable a module's
import reads is recorded against that module with the value it saw. Once the modules are
there, each module a step may import first gets its closure (``closures``): what a fresh
import of it leaves in ``sys.modules``.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib.abc
import os
import re
import sys
from typing import Iterator, Optional

from ..interpreter import env_value
from ..settings import NATIVE_ENV, THREAD_ENV
from ..step import import_effects, shadowing
from . import envreads

__all__ = ["recording", "reads_of", "families", "walk", "in_import_order", "edges", "reads",
           "roots", "held", "closures", "closure_tops", "aliases", "failed"]

# What native code reads when the extensions that load it are imported, invisible to
# ``os.environ``'s recorder (``settings.NATIVE_ENV``: families ``X*``; thread counts): torch's
# and numpy's, with the OpenMP, MKL, oneDNN and OpenBLAS runtimes they bring.
NATIVE_READS = {name: THREAD_ENV + NATIVE_ENV for name in (
    "torch._C", "numpy._core._multiarray_umath", "numpy.core._multiarray_umath")}

_PREFIX = re.compile(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)*_")  # "TQDM_", "HF_HUB_"
# Per-test, terminal and launcher variables differ between a suite's processes for no reason
# an import cares about (``settings``): a scan for them is not a setting the step changed.
_NOT_FAMILIES = {"PYTEST_", "PRELOAD_LAUNCHER_", "_PRELOAD_LAUNCHER_"}
edges: dict[str, set[str]] = {}  # importer -> what its import imported
reads: dict[str, dict[str, Optional[str]]] = {}  # module -> {variable: value its import saw}
roots: set[str] = set()  # modules imported by no module: preload entries, learned modules
held: dict[str, object] = {}  # submodule -> its package's attribute of that name before it
_accounted: set[str] = set()  # names in sys.modules whose arrival the recording has seen
_loading: set[str] = set()  # names a finder was asked for whose load may not have ended
_recording = False
_scanning = False  # a scan the recording makes itself
_original_import = builtins.__import__


def _importing(frame, other_than=()) -> Optional[str]:
    """The module whose top level runs at ``frame`` or below it (being imported), if any."""
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            if name in sys.modules and name != "__main__" and name not in other_than:
                return name
        frame = frame.f_back
    return None


@functools.wraps(_original_import)  # a module may keep it: python's own in all but identity
def _recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    if _recording:
        _note_placed_by_hand(sys._getframe(1))
    module = _original_import(name, globals, locals, fromlist, level)
    if _recording:
        importer = _importing(sys._getframe(1))
        if importer is not None:
            base = getattr(module, "__name__", None)
            if fromlist:
                names = [base, *(f"{base}.{f}" for f in fromlist if f != "*")]
            else:
                names = [name if level == 0 else base]
            edges.setdefault(importer, set()).update(
                n for n in names if n != importer and n in sys.modules)
    return module


class _LoadWatcher(importlib.abc.MetaPathFinder):
    """While recording: a module loaded by other means than an import statement
    (``importlib.import_module``, a parent package, a submodule named in a ``from`` list)."""

    def find_spec(self, name, path=None, target=None):
        _note_placed_by_hand(sys._getframe(1))  # before ``name`` joins sys.modules
        _accounted.add(name)
        _loading.add(name)
        edges.setdefault(name, set())  # what its import imports is seen: never derived later
        parent, _, attr = name.rpartition(".")  # what its package held under its name before
        if attr in getattr(sys.modules.get(parent), "__dict__", {}) and name not in held:
            held[name] = vars(sys.modules[parent])[attr]
        _record_import(_importing(sys._getframe(1)), name)
        return None


def _record_import(importer: Optional[str], name: str) -> None:
    """``importer``'s import imported ``name``; imported by no module's: a root."""
    if importer is None:
        roots.add(name)
    elif importer != name:
        edges.setdefault(importer, set()).add(name)


def _note_placed_by_hand(frame) -> None:
    """Modules a running import put into ``sys.modules`` itself (torch's
    ``sys.modules.setdefault("torch.ops", ops)``, a plugin loaded with ``module_from_spec``):
    no finder loaded them and no import statement named them, yet a fresh import of that module
    leaves them there, so they belong to its closure. Looked for before every import and every
    load, the module whose top level placed them is the one running now; found after the last
    import: their package's, else a root. New entries come last in ``sys.modules`` (it keeps
    insertion order), after the last look's; so do the modules whose load ended since (python
    moves a loaded module to the end): those still loading then are stepped over."""
    try:
        placed = _unaccounted(reversed(sys.modules))
    except RuntimeError:  # another thread imported meanwhile: once more, on a copy
        placed = _unaccounted(reversed(list(sys.modules)))
    _loading.intersection_update([name for name in _loading if _still_loading(name)])
    if not placed:
        return
    _accounted.update(placed)
    importer = _importing(frame, other_than=placed)  # a plugin placed, then run: its placer's
    for name in placed:
        edges.setdefault(name, set())
        parent = name.rpartition(".")[0]
        _record_import(importer or (parent if parent in sys.modules else None), name)


def _unaccounted(newest_first) -> list[str]:
    placed = []
    for name in newest_first:
        if name not in _accounted:
            placed.append(name)
        elif name not in _loading:
            break
    return placed


def _still_loading(name: str) -> bool:
    """Whether python's import of ``name`` has not ended (so it has yet to move it to the end)."""
    try:  # what an import put there may be any object, with a __getattr__ of its own
        spec = vars(sys.modules[name]).get("__spec__")
        return bool(getattr(spec, "_initializing", False))
    except (KeyError, TypeError):  # gone (its import failed); no __dict__
        return False


def _on_env_read(key: str, value: Optional[str]) -> None:
    module = _importing(sys._getframe(2))
    if module is not None:
        reads.setdefault(module, {}).setdefault(key, value)


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
    module_reads = reads.setdefault(name, {})
    _scanning = True
    try:
        environ = dict(os.environ)
    finally:
        _scanning = False
    for prefix in prefixes - _NOT_FAMILIES:
        module_reads.setdefault(prefix + "*", env_value(environ, prefix + "*"))


def families() -> set[str]:
    """The families of variables scans read while recording (``PREFIX_*``)."""
    return {key for seen in reads.values() for key in seen if key.endswith("*")}


def _derive_edges() -> None:
    """Modules imported before any recording (the launcher's own and the standard library
    modules it uses) get the edges their globals show: the modules bound there, and those
    that the functions and classes bound there come from."""
    for name, module in list(sys.modules.items()):
        if name in edges or name in shadowing.startup_modules or module is None:
            continue
        found = set()
        for value in list(getattr(module, "__dict__", {}).values()):
            other = getattr(value, "__name__", None) if isinstance(value, type(sys)) else \
                getattr(value, "__module__", None)
            if isinstance(other, str) and other != name and other in sys.modules:
                found.add(other)
        edges[name] = found


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Record the imports made inside (and what environment each module's import read)."""
    global _recording
    _derive_edges()
    _accounted.update(sys.modules)  # what was there before: its edges are derived
    watcher = _LoadWatcher()
    sys.meta_path.insert(0, watcher)
    builtins.__import__ = _recording_import
    _recording = True
    try:
        with envreads.reporting_reads(_on_env_read, _on_env_scan), \
                import_effects.recording(_importing):
            yield
    finally:
        _note_placed_by_hand(None)  # after the last import: placed by no module's import
        _recording = False
        builtins.__import__ = _original_import
        sys.meta_path[:] = [f for f in sys.meta_path if f is not watcher]
    _prepare()


def reads_of(name: str) -> dict[str, Optional[str]]:
    """The variables ``name``'s own import read (a family ``X*``: all named X...), and their
    values (the recording's; None for what native code read)."""
    native = {key: None for key in NATIVE_READS.get(name, ())}
    return {**native, **reads.get(name, {})}


# ---------------------------------------------------------------- ahead of the forks

order: dict[str, int] = {}  # the zygote's import order
# Modules whose import started and failed (a plugin a package tries, catching the ImportError):
# gone from sys.modules, but what they imported before failing stays in a fresh interpreter, as
# part of the import that tried them.
failed: set[str] = set()
closures: dict[str, tuple[str, ...]] = {}  # a root -> its closure, in import order
closure_tops: dict[str, frozenset] = {}  # a root -> the top-level names in its closure
# A module that is no package -> the names under it in ``sys.modules``: entries its import put
# there itself (``typing.io`` on 3.10), which no import can find again (not a package).
aliases: dict[str, tuple[str, ...]] = {}


def walk(name: str, present) -> set[str]:
    """``name``, its parents and what their imports imported, transitively, among ``present``;
    through a module whose import failed, what it imported before it failed."""
    found, todo, passed = set(), [name], set()
    while todo:
        current = todo.pop()
        if current in found or current in passed:
            continue
        if current not in present:
            if current in failed:
                passed.add(current)
                todo.extend(edges.get(current, ()))
            continue
        found.add(current)
        todo.extend(edges.get(current, ()))
        parent = current.rpartition(".")[0]
        if parent:
            todo.append(parent)
    return found


def in_import_order(names) -> list[str]:
    """``names`` in the order the zygote imported them (any it did not, last)."""
    return sorted(names, key=lambda n: order.get(n, len(order)))


def _prepare() -> None:
    """In the zygote, once its modules are there: the closure of each module a step imports
    first (a top-level package; a preload entry or learned module, imported by no module), so
    that handing it back in a step is a filter and a few dictionary stores."""
    order.clear()
    order.update((name, i) for i, name in enumerate(sys.modules))
    failed.clear()
    failed.update(name for name in edges if name not in sys.modules)
    closures.clear()
    closure_tops.clear()
    aliases.clear()
    for name in sys.modules:
        parent = name.rpartition(".")[0]
        if parent and not hasattr(sys.modules.get(parent), "__path__"):
            aliases[parent] = aliases.get(parent, ()) + (name,)
    firsts = {n for n in sys.modules if "." not in n} | (roots & set(sys.modules))
    for root in firsts:
        found = walk(root, sys.modules)
        closures[root] = tuple(in_import_order(found))
        closure_tops[root] = frozenset(n.partition(".")[0] for n in found)
    import_effects.prepare()
