"""A step's own modules win: what its ``sys.path`` finds first is what it imports.

The zygote imported its modules with its own ``sys.path``: no script folder (or cwd), and
perhaps entries a library added at run time. A fresh ``python script.py`` puts the script's
folder (the cwd for ``-m``/``-c``) first, then ``PYTHONPATH``: a ``tqdm.py`` next to the script
is the ``tqdm`` it imports, even with ``torch`` (which imports tqdm) preloaded. At step start the
few directories that precede the standard library on the step's ``sys.path`` are listed, and
every preloaded top-level module they provide a different file for is dropped from
``sys.modules`` with its submodules, so the step's import finds its own file as python would.

Modules a fresh interpreter has already imported before the script runs (start-up modules),
built-in and frozen ones (found before ``sys.path``), and the launcher itself are never dropped.
What preloaded modules bound at import (torch's reference to site-packages' tqdm) stays bound:
re-importing them would cost the preload (README, known differences).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

__all__ = ["startup_modules", "drop_shadowed", "own_path_entries"]

# Set by the zygote's bootstrap: ``sys.modules`` as python left it before the ``-c`` code ran.
startup_modules: frozenset = frozenset()

_SUFFIXES = tuple(importlib.machinery.all_suffixes())
_STDLIB = os.path.dirname(os.__file__)
_STDLIB_ZIP = f"python{sys.version_info[0]}{sys.version_info[1]}.zip"
_OURS = __name__.partition(".")[0]


def own_path_entries(path: list[str]) -> list[str]:
    """The entries before the standard library: the script's folder (or cwd) and PYTHONPATH."""
    own = []
    for entry in path:
        if entry == _STDLIB or entry.endswith(_STDLIB_ZIP):
            break
        own.append(os.path.abspath(entry))
    return own


def drop_shadowed(path: list[str]) -> list[str]:
    """Drop the preloaded modules that a directory on ``path`` before the standard library
    provides its own file for; returns their top-level names."""
    modules = sys.modules
    dropped: list[str] = []
    decided: set[str] = set()  # names an earlier directory provides (it wins)
    for directory in own_path_entries(path):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for filename in names:
            name = filename.partition(".")[0]
            if name not in modules or name in decided or not _provides(directory, filename, name):
                continue
            decided.add(name)
            if _droppable(name) and _location(modules[name]) != directory:
                _drop(name)
                dropped.append(name)
    return dropped


def _provides(directory: str, filename: str, name: str) -> bool:
    """Would python's path finder find module ``name`` here? A folder without ``__init__`` is
    only a namespace portion: a module or package later on the path wins over it."""
    if filename != name:
        return filename[len(name):] in _SUFFIXES
    package = os.path.join(directory, name, "__init__")
    return any(os.path.isfile(package + suffix) for suffix in _SUFFIXES)


def _droppable(name: str) -> bool:
    if name in startup_modules or name == _OURS or name in sys.builtin_module_names:
        return False
    spec = getattr(sys.modules[name], "__spec__", None)
    return getattr(spec, "origin", None) not in ("built-in", "frozen")


def _location(module) -> str:
    """The path entry a module was found in ('' when it has no file: a namespace package)."""
    path = getattr(module, "__file__", None)
    if not path:
        return ""
    folder = os.path.dirname(path)
    if hasattr(module, "__path__"):  # a package: its folder is inside the path entry
        folder = os.path.dirname(folder)
    return os.path.abspath(folder)


def _drop(name: str) -> None:
    prefix = name + "."
    for key in [k for k in sys.modules if k == name or k.startswith(prefix)]:
        del sys.modules[key]
