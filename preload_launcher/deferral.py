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

import importlib
import importlib.abc
import sys
from dataclasses import asdict, dataclass
from typing import Optional

__all__ = ["CutImport", "Blocker", "install_for_step", "replay", "top_level"]


def top_level(module: str) -> str:
    return module.partition(".")[0]


@dataclass(frozen=True)
class CutImport:
    """``from <module> import <fromlist>`` (or ``import <module>``) in ``importer``, which the
    block made fail and the importer's guard swallowed."""

    importer: str
    module: str
    fromlist: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {**asdict(self), "fromlist": list(self.fromlist)}

    @classmethod
    def from_dict(cls, data: dict) -> "CutImport":
        return cls(data["importer"], data["module"], tuple(data.get("fromlist") or ()))


class Blocker(importlib.abc.MetaPathFinder):
    """In the zygote: the deferred packages read as not installed. ``stacks`` keeps, for each
    blocked import, the import frames that led to it (``(module, importer, fromlist)``), from
    which ``cut_imports`` finds what the block cut off."""

    def __init__(self, packages) -> None:
        self.packages = set(packages)
        self.entries: frozenset = frozenset()  # the preload entries' packages (kept if possible)
        self.frames: Optional[list] = None  # the culprit hook's live frame stack, when one runs
        self.stacks: list[tuple[str, list[tuple]]] = []  # (blocked package, frames)

    def find_spec(self, name, path=None, target=None):
        if top_level(name) not in self.packages:
            return None
        if self.frames is not None:
            self.stacks.append((top_level(name), list(self.frames)))
        raise ModuleNotFoundError(f"No module named {name!r} (deferred by preload_launcher)",
                                  name=name)

    def cut_imports(self) -> dict[str, list[CutImport]]:
        """Per blocked package, the outermost import on each blocked import's way that failed
        for it: the guarded one (a failed import leaves no entry in ``sys.modules``)."""
        cuts: dict[str, list[CutImport]] = {}
        for package, stack in self.stacks:
            for module, importer, fromlist in stack:
                if module not in sys.modules and top_level(module) not in self.packages:
                    cut = CutImport(importer, module, tuple(fromlist or ()))
                    if cut not in cuts.setdefault(package, []):
                        cuts[package].append(cut)
                    break
        return cuts


def replay(cuts: list[CutImport]) -> None:
    """Make the cut imports now, binding what each bound in its importer. A cut import that
    fails again was guarded, so it is swallowed again."""
    for cut in cuts:
        try:
            module = importlib.import_module(cut.module)
        except ImportError:
            continue
        importer = sys.modules.get(cut.importer)
        if importer is None:
            continue
        names = cut.fromlist
        if "*" in names:
            names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
        for name in names:
            if hasattr(module, name):
                setattr(importer, name, getattr(module, name))


class _ReplayOnImport(importlib.abc.MetaPathFinder):
    """In a step (lazy): the first import of a deferred package replays its cut imports right
    after the package itself is loaded; then this finder is gone."""

    def __init__(self, deferred: dict[str, list[CutImport]]) -> None:
        self.deferred = dict(deferred)

    def find_spec(self, name, path=None, target=None):
        if "." in name or name not in self.deferred:
            return None
        cuts = self.deferred.pop(name)
        spec = _find_elsewhere(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader

        def exec_and_replay(module):
            module.__loader__ = module.__spec__.loader = loader  # as if never wrapped
            loader.exec_module(module)
            if not self.deferred:  # the import system is done with sys.meta_path by now
                _remove(_ReplayOnImport)
            replay(cuts)

        spec.loader = _Loader(loader, exec_and_replay)
        return spec


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


def install_for_step(deferred: dict[str, list[dict]], mode: str) -> None:
    """In a forked step: lift the zygote's block and replay the cut imports, ``eager``ly now or
    ``lazy``ly at the step's first import of each deferred package."""
    _remove((Blocker, _ReplayOnImport))
    if not deferred:
        return
    cuts = {package: [CutImport.from_dict(c) for c in items] for package, items in deferred.items()}
    if mode == "eager":
        for package_cuts in cuts.values():
            replay(package_cuts)
    else:
        sys.meta_path.insert(0, _ReplayOnImport(cuts))
