"""Learned preload: steps report the modules they imported; the next zygote preloads them.

A profile is kept per (interpreter, project) in the cache directory, and emptied when the
installed packages change:

    <cache>/learned/<key>.json      {"modules": {name: {"count", "seconds"}}, "pinned", "forgotten"}
    <cache>/learned/<key>.d/*.json  one report per finished step, merged at the next zygote start

Children only list names (a set difference on ``sys.modules`` at exit: nothing a step can see
is hooked); the zygote measures what each costs when it preloads it. Modules from the project's
own tree are never learned (they change between runs), nor anything the zygote refused before.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

from .files import read_json, unlink_all, write_json
from .identity import interpreter_key

__all__ = ["Profile", "profile_key", "report_step_imports"]

MAX_LEARNED = 5000  # most frequently seen modules kept; the rest are dropped


def profile_key(project: str) -> str:
    """One profile per interpreter (``identity``: any of its names) and project; package
    versions are checked inside it."""
    return interpreter_key(project)


class Profile:
    def __init__(self, cache_dir: str, key: str, project: str) -> None:
        self.dir = os.path.join(cache_dir, "learned")
        self.path = os.path.join(self.dir, f"{key}.json")
        self.reports_dir = os.path.join(self.dir, f"{key}.d")
        self.project = project
        self.data = self._load()

    def _load(self) -> dict:
        data = read_json(self.path) or {}
        data.setdefault("modules", {})
        data.setdefault("pinned", [])
        data.setdefault("forgotten", [])
        data.setdefault("project", self.project)
        data.setdefault("fingerprint", "")
        return data

    def check_packages(self, fingerprint: str) -> bool:
        """Drop what was learned under other package versions; True if it was dropped."""
        stale = bool(self.data["fingerprint"]) and self.data["fingerprint"] != fingerprint
        if stale:
            self.data["modules"] = {}
        self.data["fingerprint"] = fingerprint
        return stale

    def save(self) -> None:
        write_json(self.path, self.data)

    def merge_reports(self) -> int:
        """Fold the steps' reports into the profile; returns how many were read."""
        try:
            names = os.listdir(self.reports_dir)
        except FileNotFoundError:
            return 0
        merged = 0
        forgotten = set(self.data["forgotten"])
        modules = self.data["modules"]
        for name in names:
            if not name.endswith(".json"):
                continue  # a report still being written
            path = os.path.join(self.reports_dir, name)
            report = read_json(path)
            unlink_all(path)
            if report is None:
                continue
            merged += 1
            for module in report.get("modules", []):
                if module in forgotten:
                    continue
                entry = modules.setdefault(module, {"count": 0, "seconds": None})
                entry["count"] += 1
        if len(modules) > MAX_LEARNED:
            keep = sorted(modules, key=lambda m: -modules[m]["count"])[:MAX_LEARNED]
            self.data["modules"] = {m: modules[m] for m in keep}
        return merged

    def to_preload(self, exclude: set[str]) -> list[str]:
        """Pinned first, then learned modules in the order steps first imported them."""
        forgotten = set(self.data["forgotten"])
        ordered = list(self.data["pinned"]) + list(self.data["modules"])
        seen: set[str] = set()
        out = []
        for name in ordered:
            if name in seen or name in forgotten or name in exclude:
                continue
            seen.add(name)
            out.append(name)
        return out

    def adopt(self, modules: list[str]) -> None:
        """Take modules another machine learned (a portable profile) as if seen once here."""
        forgotten = set(self.data["forgotten"])
        for module in modules:
            if module not in forgotten:
                self.data["modules"].setdefault(module, {"count": 1, "seconds": None})

    def record_cost(self, module: str, seconds: float) -> None:
        entry = self.data["modules"].get(module)
        if entry is not None:
            entry["seconds"] = round(seconds, 4)

    def pin(self, module: str) -> None:
        if module not in self.data["pinned"]:
            self.data["pinned"].append(module)
        if module in self.data["forgotten"]:
            self.data["forgotten"].remove(module)

    def forget(self, module: str) -> None:
        self.data["modules"].pop(module, None)
        if module in self.data["pinned"]:
            self.data["pinned"].remove(module)
        if module not in self.data["forgotten"]:
            self.data["forgotten"].append(module)


def _from_project(module, roots: tuple[str, ...]) -> bool:
    path = getattr(module, "__file__", None)
    if not path:
        return False
    return os.path.realpath(path).startswith(roots)


def report_step_imports(before: set[str], reports_dir: Optional[str], project: str) -> None:
    """At a step's exit: write the names of modules it imported (not from the project's tree)."""
    if not reports_dir:
        return
    roots = tuple(os.path.join(os.path.realpath(p), "") for p in {project, os.getcwd()}
                  if p and os.path.realpath(p) != "/")
    names = [name for name, module in list(sys.modules.items())
             if name not in before and name != "__main__" and not _from_project(module, roots)]
    if not names:
        return
    try:
        write_json(os.path.join(reports_dir, f"{os.getpid()}-{time.monotonic_ns()}.json"),
                   {"modules": names})
    except OSError:
        pass  # learning is best effort; the step's result never depends on it
