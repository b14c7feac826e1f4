"""What ``python FILE`` runs, by CPython's rules: a directory or zip archive with a
``__main__.py`` (``FILE`` becomes ``sys.path[0]`` and ``__main__`` is run from it, as runpy
does for python), a compiled ``.pyc``, or source. ``__file__`` is ``FILE`` joined to the cwd,
not normalised (``../sub/x.py`` stays ``/cwd/../sub/x.py``), as python makes it."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import marshal
import os
import types
import zipimport

__all__ = ["script_path", "is_main_importer", "set_up_main", "code_of"]

PYC_HEADER = 16  # magic, flags, mtime or hash, source size


def script_path(value: str) -> str:
    """``FILE`` as python records it: absolute, joined to the cwd without normalising."""
    return value if os.path.isabs(value) else os.path.join(os.getcwd(), value)


def is_main_importer(path: str) -> bool:
    """A path python runs through its importer (a directory or a zip file), not as a file."""
    if os.path.isdir(path):
        return True
    try:
        zipimport.zipimporter(path)
    except (zipimport.ZipImportError, OSError):
        return False
    return True


def _is_pyc(path: str) -> bool:
    if path.endswith(".pyc"):
        return True
    with open(path, "rb") as f:
        return f.read(2) == importlib.util.MAGIC_NUMBER[:2]


def set_up_main(main: types.ModuleType, path: str) -> None:
    """``__file__``/``__loader__`` of a file run as ``__main__`` (python's ``set_main_loader``)."""
    main.__file__ = path
    main.__cached__ = None
    loader = (importlib.machinery.SourcelessFileLoader if os.path.isfile(path) and _is_pyc(path)
              else importlib.machinery.SourceFileLoader)
    main.__loader__ = loader("__main__", path)


def code_of(path: str):
    """The code object python runs for ``path``: a .pyc's marshalled code, else compiled
    source. Raises OSError when the file cannot be read."""
    with open(path, "rb") as f:
        data = f.read()
    if _is_pyc(path):
        if data[:4] != importlib.util.MAGIC_NUMBER:
            raise RuntimeError("Bad magic number in .pyc file")
        return marshal.loads(data[PYC_HEADER:])
    return compile(data, path, "exec", dont_inherit=True)  # not this file's __future__
