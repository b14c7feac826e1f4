"""A daemon's staleness: edits to preloaded modules outside site-packages, and package
installs or removals, after its preload (it restarts itself once idle)."""

from __future__ import annotations

import os
import sys

__all__ = ["StalenessWatch"]


class StalenessWatch:
    """Notices edits to preloaded modules outside site-packages and package installs/removals.

    Local source files are compared by mtime; installed packages through the mtime of each
    site-packages directory (an install or uninstall adds or removes entries there)."""

    def __init__(self) -> None:
        import site
        import sysconfig
        dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        dirs |= set(site.getsitepackages()) | {site.getusersitepackages()}
        self.site_dirs = {d: _mtime(d) for d in dirs if os.path.isdir(d)}
        roots = tuple(os.path.join(os.path.realpath(d), "") for d in self.site_dirs)
        self.local_files: dict[str, int] = {}
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if path and os.path.isfile(path) and not os.path.realpath(path).startswith(roots):
                self.local_files[path] = _mtime(path)

    def changes(self) -> list[str]:
        changed = [p for p, t in self.local_files.items() if _mtime(p) != t]
        changed += [f"packages in {d}" for d, t in self.site_dirs.items() if _mtime(d) != t]
        return changed


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1
