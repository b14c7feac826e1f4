"""Surgical quarantine: a package that initialises CUDA at import is deferred, not its importer.

When the culprit of a preload entry is reached through a guarded import (modelopt's
``import_plugin``, a ``try: … except ImportError``), the zygote blocks the culprit's package
while it preloads (``Blocker``: importing it raises ``ModuleNotFoundError``, as if it were not
installed), so the entry imports cleanly minus the plugins that needed it. The imports the
block cut off are recorded (``CutImport``) and replayed in each forked step, so that the step
sees what a fresh interpreter sees: the plugin module imported, its registrations made, its
names bound in its importer.

When: ``lazy`` (the default) replays at the step's first import of the deferred package, so a
step that never touches it pays nothing (the replay costs 0.56-0.71 s per step for
torch_geometric on an H200); ``eager`` (``PRELOAD_LAUNCHER_DEFERRED=eager``) replays before
the step's code, for steps that inspect registries without importing the package.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

from . import guards

__all__ = ["CutImport", "Blocker", "install_for_step", "replay", "replay_eager", "top_level"]

_IMPORT_MACHINERY = ("<frozen importlib", os.path.dirname(importlib.__file__),
                     os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def top_level(module: str) -> str:
    return module.partition(".")[0]


@dataclass(frozen=True)
class CutImport:
    """An import in ``importer`` that the block made fail and a guard swallowed: ``module``
    (what failed to load), ``fromlist`` (as the statement named it, for people), ``binds``
    (the names the statement binds in ``importer``: ``[name, dotted path]``, ``["*", module]``)
    and ``guard`` (what the guard swallows: ``guards.guard_of``)."""

    importer: str
    module: str
    fromlist: tuple[str, ...] = ()
    binds: tuple = ()
    guard: Optional[dict] = field(default=None, compare=False, hash=False)

    def to_dict(self) -> dict:
        return {**asdict(self), "fromlist": list(self.fromlist),
                "binds": [list(b) for b in self.binds]}

    @classmethod
    def from_dict(cls, data: dict) -> "CutImport":
        fromlist = tuple(data.get("fromlist") or ())
        binds = data.get("binds")
        if binds is None:  # recorded before binds were: what the fromlist names
            binds = [["*", data["module"]]] if "*" in fromlist else \
                [[n, f"{data['module']}.{n}"] for n in fromlist]
        return cls(data["importer"], data["module"], fromlist, tuple(tuple(b) for b in binds),
                   data.get("guard"))


@dataclass
class _Frame:
    """One frame on the way to a blocked import, as much of it as the cut needs."""

    module: str  # the module whose code runs in it
    is_module: bool  # a module's top level (it is being imported), not a function
    binds: Optional[list]  # what its current import statement binds (module frames)
    guard: Optional[dict]  # what the handler around its current instruction swallows
    via_import_module: bool = False  # its current call is importlib.import_module


class Blocker(importlib.abc.MetaPathFinder):
    """In the zygote: the deferred packages read as not installed. ``stacks`` keeps, for each
    blocked import, the frames that led to it, from which ``cut_imports`` finds what the block
    cut off."""

    def __init__(self, packages) -> None:
        self.packages = set(packages)
        self.entries: frozenset = frozenset()  # the preload entries' packages (kept if possible)
        self.stacks: list[tuple[str, str, list[_Frame]]] = []  # (package, name, frames)

    def find_spec(self, name, path=None, target=None):
        if top_level(name) not in self.packages:
            return None
        self.stacks.append((top_level(name), name, _frames(sys._getframe(1))))
        raise ModuleNotFoundError(f"No module named {name!r} (deferred by preload_launcher)",
                                  name=name)

    def cut_imports(self) -> dict[str, list[CutImport]]:
        """Per blocked package, the outermost import on each blocked import's way that failed
        (a failed import leaves no entry in ``sys.modules``), made by a module that loaded."""
        cuts: dict[str, list[CutImport]] = {}
        for package, name, frames in self.stacks:
            cut = _cut(name, frames)
            if cut is not None and cut not in cuts.setdefault(package, []):
                cuts[package].append(cut)
        return cuts


def _frames(frame) -> list[_Frame]:
    """The frames from a blocked import outwards, minus the import machinery's and ours."""
    out: list[_Frame] = []
    inner_is_import_module = False
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(_IMPORT_MACHINERY):
            inner_is_import_module = inner_is_import_module or code.co_name == "import_module"
        else:
            name = frame.f_globals.get("__name__", "")
            is_module = code.co_name == "<module>"
            if name == "__main__":  # the zygote's own start: no importer beyond it
                break
            out.append(_Frame(name, is_module, guards.bindings(frame) if is_module else None,
                              guards.guard_of(frame), inner_is_import_module))
            inner_is_import_module = False
        frame = frame.f_back
    return out


def _cut(name: str, frames: list[_Frame]) -> Optional[CutImport]:
    """The cut import: the outermost module on the way that failed to load (or the blocked
    package itself, imported right in a module that loaded), with the module importing it."""
    failed = name
    inner: list[_Frame] = []  # frames between the failed module and its importer
    for frame in frames:
        if not frame.is_module:
            inner.append(frame)
            continue
        if frame.module not in sys.modules:
            failed, inner = frame.module, []
            continue
        guard = next((f.guard for f in inner + [frame] if f.guard is not None), None)
        # A stored call result is the module only for importlib.import_module(failed).
        binds = [(name, path or failed) for name, path in frame.binds or []
                 if path or frame.via_import_module]
        return CutImport(frame.module, failed, tuple(name for name, _ in binds), tuple(binds),
                         guard)
    return None


def _resolve(path: str):
    """The object a dotted path names: the longest imported module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is not None:
            obj = module
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            return obj
    raise AttributeError(path)


def _swallowed(cut: CutImport, exc: BaseException) -> bool:
    """Does the cut import's guard swallow ``exc``? (ImportError where it could not be read.)"""
    for name in (cut.guard or {}).get("swallows", ["builtins.ImportError"]):
        try:
            cls = _resolve(name)
        except AttributeError:
            continue
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
    return False


def _guarded_import(cut: CutImport) -> bool:
    """Import ``cut.module`` under what its guard swallows; True if it loaded."""
    guard = cut.guard or {}
    if "cm" in guard:  # the guard itself (modelopt's import_plugin): it decides, and says so
        module, qualname = guard["cm"]
        try:
            manager = _resolve(f"{module}.{qualname}")(*guard["args"], **guard["kwargs"])
        except Exception:
            manager = contextlib.suppress(ImportError)
        filename, line = guard.get("at") or ("<replay>", 1)
        # Run from the importer's file and line: what the guard prints names them, as fresh.
        code = compile("\n" * (line - 1) + "with manager:\n    import_module(name)\n", filename,
                       "exec")
        exec(code, {"manager": manager, "import_module": importlib.import_module,
                    "name": cut.module})
        return cut.module in sys.modules
    try:
        importlib.import_module(cut.module)
    except BaseException as exc:
        if _swallowed(cut, exc):
            return False
        raise
    return True


def replay(cuts: list[CutImport]) -> None:
    """Make the cut imports now, binding what each statement binds in its importer. One that
    fails again is swallowed as its guard swallowed it; one its guard would not have
    swallowed raises, as it would have in a fresh interpreter."""
    for cut in cuts:
        if not _guarded_import(cut):
            continue
        importer = sys.modules.get(cut.importer)
        if importer is None:
            continue
        for name, path in cut.binds:
            try:
                obj = _resolve(path)
            except AttributeError:
                continue
            if name != "*":
                setattr(importer, name, obj)
                continue
            names = getattr(obj, "__all__", None)
            if names is None:
                names = [n for n in vars(obj) if not n.startswith("_")]
            for attr in names:
                if hasattr(obj, attr):
                    setattr(importer, attr, getattr(obj, attr))


class _ReplayOnImport(importlib.abc.MetaPathFinder):
    """In a step (lazy): the first load of a deferred package replays its cut imports right
    after the package itself is loaded (a lookup alone, ``importlib.util.find_spec``, does
    not); then this finder is gone."""

    def __init__(self, deferred: dict[str, list[CutImport]]) -> None:
        self.deferred = dict(deferred)

    def find_spec(self, name, path=None, target=None):
        if "." in name or name not in self.deferred:
            return None
        spec = _find_elsewhere(name, path, target)
        namespace = spec is not None and spec.loader is None and \
            spec.submodule_search_locations is not None
        if namespace:  # megatron: the loader python gives a namespace package
            spec.loader = _NamespaceLoader.__new__(_NamespaceLoader)
            spec.loader._path = spec.submodule_search_locations
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader

        def exec_and_replay(module):
            module.__loader__ = module.__spec__.loader = loader  # as if never wrapped
            if namespace:
                module.__file__ = None
            cuts = self.deferred.pop(name, None)
            try:
                loader.exec_module(module)
            except BaseException:
                if cuts is not None:  # not loaded: the next import tries again
                    self.deferred[name] = cuts
                raise
            if not self.deferred:  # the import system is done with sys.meta_path by now
                _remove(_ReplayOnImport)
            if cuts:
                replay(cuts)

        spec.loader = _Loader(loader, exec_and_replay)
        return spec


_NamespaceLoader = getattr(importlib.machinery, "NamespaceLoader", None) or \
    importlib._bootstrap_external._NamespaceLoader  # type: ignore[attr-defined]  # 3.10


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, exec_module) -> None:
        self._loader = loader
        self.exec_module = exec_module

    def create_module(self, spec):
        return self._loader.create_module(spec)


def _find_elsewhere(name, path, target):
    for finder in sys.meta_path:
        if isinstance(finder, (_ReplayOnImport, Blocker)) or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


def _remove(kind) -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, kind)]


_eager: list[CutImport] = []  # the cut imports an eager step replays before its code


def install_for_step(deferred: dict[str, list[dict]], mode: str) -> None:
    """In a forked step: lift the zygote's block, and replay the cut imports ``eager``ly
    (``replay_eager``, once the step's ``sys.path`` is set) or ``lazy``ly at the step's first
    import of each deferred package."""
    _remove((Blocker, _ReplayOnImport))
    _eager.clear()
    if not deferred:
        return
    cuts = {package: [CutImport.from_dict(c) for c in items] for package, items in deferred.items()}
    if mode == "eager":
        _eager.extend(cut for package_cuts in cuts.values() for cut in package_cuts)
    else:
        sys.meta_path.insert(0, _ReplayOnImport(cuts))


def replay_eager() -> list[str]:
    """Before an eager step's code, with its own ``sys.path``: what ``install_for_step`` kept.
    Returns the importers of the replayed imports."""
    cuts, _eager[:] = list(_eager), []
    replay(cuts)
    return [cut.importer for cut in cuts]
