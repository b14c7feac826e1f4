"""A step's own modules win: what its ``sys.path`` finds first is what it imports.

The zygote imported its modules with its own ``sys.path``: no script folder (or cwd), and
perhaps entries a library added at run time. A fresh ``python script.py`` puts the script's
folder (the cwd for ``-m``/``-c``) first, then ``PYTHONPATH``: a ``tqdm.py`` next to the script
is the ``tqdm`` it imports, even with ``torch`` (which imports tqdm) preloaded. A step's module
table starts without the preloaded modules (``module_table``); when the step imports one, the
path entries that precede the standard library on its ``sys.path`` at that moment are asked
first (``shadows``): a different file for that top-level name there is the step's own, and the
preloaded module (with its submodules) is not handed back.

Modules a fresh interpreter has already imported before the script runs (start-up modules),
built-in and frozen ones (found before ``sys.path``), and the launcher itself are never
shadowed. What preloaded modules bound at import (torch's reference to site-packages' tqdm)
stays bound: re-importing them would cost the preload (docs/user-guide.md, known differences).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

__all__ = ["startup_modules", "shadows", "own_path_entries", "names_in"]

# Set by the zygote's bootstrap: ``sys.modules`` as python left it before the ``-c`` code ran.
startup_modules: frozenset = frozenset()

_STDLIB = os.path.dirname(os.__file__)
_STDLIB_ZIP = f"python{sys.version_info[0]}{sys.version_info[1]}.zip"
_OURS = __name__.partition(".")[0]


def own_path_entries(path: list[str]) -> list[str]:
    """The entries before the standard library: the script's folder (or cwd) and PYTHONPATH."""
    own = []
    for entry in path:
        if not isinstance(entry, str):
            continue
        if entry == _STDLIB or entry.endswith(_STDLIB_ZIP):
            break
        own.append(os.path.abspath(entry))
    return own


def names_in(own: tuple) -> set[str]:
    """The top-level names the files and folders in ``own`` could provide."""
    names: set[str] = set()
    for directory in own:
        try:
            names.update(entry.partition(".")[0] for entry in os.listdir(directory))
        except OSError:
            continue
    return names


def shadows(name: str, module, path) -> bool:
    """Would ``path``'s own entries give the top-level module ``name`` another file than the
    preloaded ``module``'s? A folder without ``__init__`` is only a namespace portion: a module
    or package later on the path wins over it."""
    if name in startup_modules or name == _OURS or name in sys.builtin_module_names:
        return False
    spec = getattr(module, "__spec__", None)
    if getattr(spec, "origin", None) in ("built-in", "frozen"):
        return False
    own = own_path_entries(list(path))
    if not own:
        return False
    found = importlib.machinery.PathFinder.find_spec(name, own)
    if found is None or found.loader is None or not found.origin:
        return False
    where = getattr(module, "__file__", None)
    return not where or os.path.abspath(found.origin) != os.path.abspath(where)
