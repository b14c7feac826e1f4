"""A zygote's staleness: edits to the modules it holds (preloaded or learned) outside
site-packages, and package installs or removals, since it imported them (it restarts itself
once idle, so that no step runs code older than its files)."""

from __future__ import annotations

import functools
import os
import sys

__all__ = ["StalenessWatch", "installed_dirs", "installed_roots"]

CHANGED_WHILE_IMPORTING = -2  # a file written while the pass that imported it ran
# File times come from the kernel's coarse clock, a tick or so behind ``time.time_ns()``: a
# write just after a pass began may carry a time just before it.
CLOCK_SLACK_NS = 20_000_000


class StalenessWatch:
    """Notices edits to the modules this process holds outside site-packages and package
    installs/removals.

    Local source files are compared by mtime; installed packages through the mtime of each
    site-packages directory (an install or uninstall adds or removes entries there). Modules
    imported later (learned while idle) join the watch with ``add_new``."""

    def __init__(self) -> None:
        self.site_dirs = {d: _mtime(d) for d in installed_dirs()}
        self.roots = installed_roots()
        self.local_files: dict[str, int] = {}
        self.seen: set[str] = set()  # modules looked at already
        self.add_new()

    def add_new(self, since_ns: int = 0) -> None:
        """Watch the local files of modules imported since the last call. ``since_ns``: when
        the pass that imported them began (``time.time_ns()``); a file written after that may
        have been read in its old version, and counts as changed (a restart too many costs a
        preload; one too few, a step running old code)."""
        for name, module in list(sys.modules.items()):
            if name in self.seen:
                continue
            self.seen.add(name)
            path = getattr(module, "__file__", None)
            if not path or path in self.local_files or not os.path.isfile(path) or \
                    os.path.realpath(path).startswith(self.roots):
                continue
            mtime = _mtime(path)
            changed = since_ns and mtime >= since_ns - CLOCK_SLACK_NS
            self.local_files[path] = CHANGED_WHILE_IMPORTING if changed else mtime

    def changes(self) -> list[str]:
        changed = [p for p, t in self.local_files.items() if _mtime(p) != t]
        changed += [f"packages in {d}" for d, t in self.site_dirs.items() if _mtime(d) != t]
        return changed


@functools.lru_cache(maxsize=None)
def installed_dirs() -> frozenset[str]:
    """Where this interpreter's standard library and installed packages live (a virtualenv's
    too, wherever it lies: a project's own ``.venv`` holds installed packages, not its code).
    Read once, in the zygote (its ``StalenessWatch``): a step that asks at exit imports nothing
    (``sysconfig`` imports ``threading`` on 3.12 and later)."""
    import site
    import sysconfig
    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= set(site.getsitepackages()) | {site.getusersitepackages()}
    return frozenset(d for d in dirs if os.path.isdir(d))


@functools.lru_cache(maxsize=None)
def installed_roots() -> tuple[str, ...]:
    """``installed_dirs`` as prefixes of real paths (``os.sep``-terminated)."""
    return tuple(os.path.join(os.path.realpath(d), "") for d in installed_dirs())


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1
