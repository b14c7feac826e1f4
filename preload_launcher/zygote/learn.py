"""Learned preload: steps report the modules they imported; the next zygote preloads them.

A profile is kept per (interpreter, project) in the cache directory, and emptied when the
installed packages change:

    <cache>/learned/<key>.json      {"modules": {name: {"count", "seconds"}}, "pinned", "forgotten",
                                     "unlearnable": {name: what its import warned or printed}}
    <cache>/learned/<key>.d/*.json  one report per finished step, merged at the next zygote start
    <cache>/learned/<key>.json.lock  held while a process writes its edits into the profile

Children only list names (a set difference on ``sys.modules`` at exit: nothing a step can see
is hooked); the zygote measures what each costs when it preloads it. Modules from the project's
own tree are never learned (they change between runs), nor anything the zygote refused before,
nor modules whose import warns or prints (a step must see that itself: ``ImportEffects``).
"""

from __future__ import annotations

import functools
import io
import os
import sys
import time
import warnings
from typing import Callable, Optional, Sequence

from ..files import read_json, unlink_all, update_json, write_json
from ..identity import interpreter_key
from .staleness import installed_roots

__all__ = ["Profile", "profile_key", "report_step_imports", "ImportEffects", "undo_import",
           "test_runner_modules", "reaches_test_runner"]

MAX_LEARNED = 5000  # most frequently seen modules kept; the rest are dropped
TEST_RUNNER = ("pytest", "_pytest", "pluggy", "py")  # pytest itself and what it is made of


@functools.lru_cache(maxsize=None)
def test_runner_modules() -> frozenset[str]:
    """Top-level modules a test run must import itself: pytest's own, and every module of a
    distribution that registers a ``pytest11`` plugin, which pytest marks for assertion
    rewriting at start-up (an imported one cannot be rewritten: pytest warns, and a suite with
    ``filterwarnings = error`` fails before collecting). Found as pytest finds them: the
    distribution's top-level files and packages, and its entry points' modules."""
    from importlib.metadata import distributions
    names = set(TEST_RUNNER)
    for dist in distributions():
        plugins = [ep for ep in dist.entry_points if ep.group == "pytest11"]
        if not plugins:
            continue
        names.update(ep.module.partition(".")[0] for ep in plugins)
        for path in dist.files or ():
            if path.name.startswith("__editable__"):
                continue  # setuptools' finder of an editable install, as pytest skips it
            if len(path.parts) == 1 and path.suffix == ".py" and path.stem != "setup":
                names.add(path.stem)
            elif len(path.parts) == 2 and path.parts[1] == "__init__.py":
                names.add(path.parts[0])
    return frozenset(names)


def _top(name: str) -> str:
    return name.partition(".")[0]


def reaches_test_runner(before: set[str]) -> str:
    """Why the modules imported since ``before`` must stay a test run's own ('' if they may
    be learned): they include a module of the test runner (``test_runner_modules``)."""
    reached = sorted({_top(name) for name in sys.modules if name not in before}
                     & test_runner_modules())
    return f"imports {', '.join(reached[:3])}, which pytest must import itself" if reached else ""


def profile_key(project: str) -> str:
    """One profile per interpreter (``identity``: any of its names) and project; package
    versions are checked inside it."""
    return interpreter_key(project)


class Profile:
    """One profile, edited by several processes (zygotes of different preload sets, daemons,
    the CLI): each keeps its own edits and ``save`` replays them on the file's latest contents
    under a lock, so no process's save undoes another's (``learned --forget`` with a daemon
    up, two daemons learning different modules)."""

    def __init__(self, cache_dir: str, key: str, project: str) -> None:
        self.dir = os.path.join(cache_dir, "learned")
        self.path = os.path.join(self.dir, f"{key}.json")
        self.reports_dir = os.path.join(self.dir, f"{key}.d")
        self.project = project
        self.data = self._complete(read_json(self.path) or {})
        self._edits: list[Callable[[dict], None]] = []  # not saved yet

    def _complete(self, data: dict) -> dict:
        data.setdefault("modules", {})
        data.setdefault("pinned", [])
        data.setdefault("forgotten", [])
        data.setdefault("unlearnable", {})  # module -> what its import warned or printed
        data.setdefault("guards_deferred", [])  # learned modules the zygote left to the steps
        data.setdefault("project", self.project)
        data.setdefault("fingerprint", "")
        return data

    def _edit(self, change: Callable[[dict], None]) -> None:
        change(self.data)
        self._edits.append(change)

    def save(self) -> bool:
        """Write this process's edits into the file as it is now; afterwards ``data`` is what
        was written (others' edits included). False when the cache cannot be written."""
        def replay(data: dict) -> None:
            self._complete(data)
            for change in self._edits:
                change(data)
            _keep_most_seen(data)

        written = update_json(self.path, replay)
        if written is None:
            return False
        self.data = written
        self._edits.clear()
        return True

    def check_packages(self, fingerprint: str) -> bool:
        """Drop what was learned under other package versions; True if it was dropped."""
        stale = bool(self.data["fingerprint"]) and self.data["fingerprint"] != fingerprint

        def change(data: dict) -> None:
            if data["fingerprint"] and data["fingerprint"] != fingerprint:
                data["modules"] = {}
                data["guards_deferred"] = []
            data["fingerprint"] = fingerprint

        self._edit(change)
        return stale

    def merge_reports(self) -> int:
        """Fold the steps' reports into the profile; returns how many were read."""
        try:
            names = os.listdir(self.reports_dir)
        except OSError:
            return 0
        merged = 0
        for name in names:
            if not name.endswith(".json"):
                continue  # a report still being written
            path = os.path.join(self.reports_dir, name)
            report = read_json(path)
            try:
                unlink_all(path)
            except OSError:
                continue  # a read-only cache: the report would be counted again and again
            if report is None:
                continue
            merged += 1
            self._edit(functools.partial(_count, list(report.get("modules", []))))
        return merged

    def to_preload(self, exclude: set[str]) -> list[str]:
        """Pinned first, then learned modules in the order steps first imported them."""
        forgotten = set(self.data["forgotten"]) | set(self.data["unlearnable"])
        ordered = list(self.data["pinned"]) + list(self.data["modules"])
        runner = test_runner_modules()
        seen: set[str] = set()
        out = []
        for name in ordered:
            if name in seen or name in forgotten or name in exclude or _top(name) in runner:
                continue
            seen.add(name)
            out.append(name)
        return out

    def kept_before(self) -> frozenset[str]:
        """Modules a zygote of this profile imported and kept (their cost is recorded): no
        child needs to try them again (``tryout``)."""
        return frozenset(name for name, entry in self.data["modules"].items()
                         if entry.get("seconds") is not None)

    def adopt(self, modules: list[str]) -> None:
        """Take modules another machine learned (a portable profile) as if seen once here."""
        def change(data: dict) -> None:
            forgotten = set(data["forgotten"])
            for module in modules:
                if module not in forgotten:
                    data["modules"].setdefault(module, {"count": 1, "seconds": None})

        self._edit(change)

    def drop(self, module: str) -> None:
        """Unlearn a module (the zygote failed to import it); steps may teach it again."""
        self._edit(lambda data: data["modules"].pop(module, None))

    def leave_to_steps(self, modules: Sequence[str]) -> None:
        """Learned modules whose import reaches a deferred package: never preloaded again (a
        step imports them itself, and sees the package as a fresh interpreter does)."""
        def change(data: dict) -> None:
            data["guards_deferred"].extend(m for m in modules if m not in data["guards_deferred"])

        self._edit(change)

    def record_cost(self, module: str, seconds: float) -> None:
        def change(data: dict) -> None:
            entry = data["modules"].get(module)
            if entry is not None:
                entry["seconds"] = round(seconds, 4)

        self._edit(change)

    def pin(self, module: str) -> None:
        def change(data: dict) -> None:
            if module not in data["pinned"]:
                data["pinned"].append(module)
            if module in data["forgotten"]:
                data["forgotten"].remove(module)

        self._edit(change)

    def forget(self, module: str) -> None:
        def change(data: dict) -> None:
            data["modules"].pop(module, None)
            if module in data["pinned"]:
                data["pinned"].remove(module)
            if module not in data["forgotten"]:
                data["forgotten"].append(module)

        self._edit(change)

    def clear(self) -> None:
        self._edit(lambda data: data.__setitem__("modules", {}))

    def refuse(self, module: str, why: str) -> None:
        """Never preload ``module`` again: its import has an effect a step must see itself
        (a warning, output), which a preloaded import would have spent in the zygote."""
        def change(data: dict) -> None:
            data["modules"].pop(module, None)
            data["unlearnable"][module] = why

        self._edit(change)


def _count(modules: list[str], data: dict) -> None:
    """One step's report: each module it imported seen once more (unless forgotten, or the
    test runner's)."""
    forgotten = set(data["forgotten"]) | set(data["unlearnable"])
    runner = test_runner_modules()
    for module in modules:
        if module not in forgotten and _top(module) not in runner:
            entry = data["modules"].setdefault(module, {"count": 0, "seconds": None})
            entry["count"] += 1


def _keep_most_seen(data: dict) -> None:
    modules = data["modules"]
    if len(modules) > MAX_LEARNED:
        keep = sorted(modules, key=lambda m: -modules[m]["count"])[:MAX_LEARNED]
        data["modules"] = {m: modules[m] for m in keep}


class ImportEffects:
    """What an import did that a step would see: warnings of any category (whatever the
    filters: a step may run with ``-W error``), and writes to ``sys.stdout``/``sys.stderr``.
    A learned module whose import does either must stay the step's own import."""

    def __enter__(self) -> "ImportEffects":
        self._catcher = warnings.catch_warnings(record=True)
        self.warned = self._catcher.__enter__()
        warnings.simplefilter("always")
        self.output = io.StringIO()
        self._streams = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = self.output
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout, sys.stderr = self._streams
        self._catcher.__exit__(*exc)

    def describe(self) -> str:
        """'' when the import was silent; else what it did, in a few words."""
        if self.warned:
            first = self.warned[0]
            return f"warned at import: {first.category.__name__}: {first.message}"[:200]
        text = self.output.getvalue()
        return f"printed at import: {text.strip()[:120]!r}" if text else ""


def undo_import(before: set[str]) -> list[str]:
    """Take the modules imported since ``before`` out of ``sys.modules`` (and off their
    parent packages), so that a step imports them itself, as a fresh interpreter would."""
    added = [name for name in list(sys.modules) if name not in before]
    for name in added:
        module = sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and getattr(sys.modules[parent], child, None) is module:
            delattr(sys.modules[parent], child)
    return added


def _from_project(module, roots: tuple[str, ...], installed: tuple[str, ...]) -> bool:
    """Whether ``module`` is the project's code: under its tree, and not in a place packages
    are installed to that lies deeper there (a ``.venv`` in the project folder)."""
    path = getattr(module, "__file__", None)
    if not path:
        return False
    path = os.path.realpath(path)
    root = max((len(r) for r in roots if path.startswith(r)), default=0)
    return root > max((len(d) for d in installed if path.startswith(d)), default=0)


def _zygote_can_import(module, zygote_path: set[str], step_only: set[str]) -> bool:
    """Would the zygote import this top-level module from the same place? Not when it was found
    through a ``sys.path`` entry the zygote lacks (``step_only``): the step's script folder or
    cwd (a namespace package without ``__file__`` included), or a folder a library appended at
    run time (onnxruntime's helpers), where a step's own file should win. Modules found by a
    finder of their own (editable installs) are found by the zygote's finder too."""
    path = getattr(module, "__file__", None)
    if path:
        folder = os.path.dirname(path)
        if hasattr(module, "__path__"):
            folder = os.path.dirname(folder)
        folders = {os.path.abspath(folder)}
    else:
        portions = getattr(module, "__path__", None)
        if portions is None:
            return True  # built-in or frozen
        folders = {os.path.abspath(os.path.dirname(p)) for p in list(portions)}
    return bool(folders & zygote_path) or not folders & step_only


def report_step_imports(before: set[str], reports_dir: Optional[str], project: str,
                        zygote_path: Sequence[str]) -> None:
    """At a step's exit: write the names of modules it imported that the zygote can import
    (found through ``zygote_path``, its ``sys.path``) and that are not from the project's tree."""
    if not reports_dir:
        return
    roots = tuple(os.path.join(os.path.realpath(p), "") for p in {project, os.getcwd()}
                  if p and os.path.realpath(p) != "/")
    installed = installed_roots()  # read in the zygote: nothing imported here
    importable = {os.path.abspath(p) for p in zygote_path}
    step_only = {os.path.abspath(p) for p in sys.path if isinstance(p, str)} - importable
    verdicts: dict[str, bool] = {}  # per top-level package
    names = []
    for name, module in list(sys.modules.items()):
        if name in before or name == "__main__" or _from_project(module, roots, installed):
            continue
        top = name.partition(".")[0]
        if top not in verdicts:
            top_module = sys.modules.get(top)
            verdicts[top] = top_module is not None and _zygote_can_import(top_module, importable,
                                                                           step_only)
        if verdicts[top]:
            names.append(name)
    if not names:
        return
    try:
        write_json(os.path.join(reports_dir, f"{os.getpid()}-{time.monotonic_ns()}.json"),
                   {"modules": names})
    except OSError:
        pass  # learning is best effort; the step's result never depends on it
