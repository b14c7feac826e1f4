"""pytest plugin: one zygote per session (per xdist worker), started while tests are collected.

Enabled by default once installed; per CI lane: ``PRELOAD_LAUNCHER=0|1`` (wins), then
``--preload-launcher/--no-preload-launcher``. Preload set: ``PRELOAD_LAUNCHER_MODULES`` (wins),
then the ``preload_launcher_modules`` ini key, then the default.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import pytest

from . import client, settings
from .cli import format_deferred, format_learned

PRELOAD_LAUNCHER_DESC = "run steps through a preloaded zygote (PRELOAD_LAUNCHER env var wins)"
MODULES_DESC = "comma-separated modules the zygote preloads (PRELOAD_LAUNCHER_MODULES wins)"
PROFILE_DESC = ("a portable profile (preload-launcher profile --write) the zygote starts from, "
                "relative to the rootdir (PRELOAD_LAUNCHER_PROFILE wins)")

launcher_key = pytest.StashKey[Optional[client.Launcher]]()
started_key = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("preload_launcher")
    group.addoption("--preload-launcher", dest="preload_launcher", action="store_true",
                    default=None, help=PRELOAD_LAUNCHER_DESC)
    group.addoption("--no-preload-launcher", dest="preload_launcher", action="store_false",
                    help="run every step as a plain subprocess")
    parser.addini("preload_launcher_modules", MODULES_DESC, default=None)
    parser.addini("preload_launcher_profile", PROFILE_DESC, default=None)


def resolve_enabled(config: pytest.Config) -> bool:
    """env > CLI > default (on)."""
    toggle = settings.Settings.from_env().toggle
    if toggle is not None:
        return toggle
    option = config.getoption("preload_launcher")
    return True if option is None else bool(option)


def pytest_configure(config: pytest.Config) -> None:
    enabled = resolve_enabled(config)
    if not enabled:
        os.environ["PRELOAD_LAUNCHER"] = "0"  # so preload_launcher.run() in tests agrees
        config.stash[launcher_key] = None
        return
    modules = settings.preload_modules(ini=config.getini("preload_launcher_modules"))
    profile = settings.Settings.from_env().profile or config.getini("preload_launcher_profile")
    launcher = client.Launcher(modules, profile=str(config.rootpath / profile) if profile else None)
    client.set_session_launcher(launcher)  # run() in this process uses the session's zygote
    config.stash[launcher_key] = launcher
    config.stash[started_key] = time.monotonic()
    if getattr(config, "workerinput", None) is not None or not config.option.collectonly:
        launcher.prestart()  # preload overlaps collection


def pytest_unconfigure(config: pytest.Config) -> None:
    launcher = config.stash.get(launcher_key, None)
    if launcher is not None:
        client.set_session_launcher(None)
        launcher.close()


@pytest.fixture(scope="session")
def preload_launcher(pytestconfig: pytest.Config) -> client.Launcher:
    """The session's launcher (``.run(args, cwd=, env=, timeout=, check=)``)."""
    launcher = pytestconfig.stash.get(launcher_key, None)
    return launcher if launcher is not None else client.Launcher(())


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    launcher = config.stash.get(launcher_key, None)
    if launcher is None:
        if not settings.Settings.from_env().enabled:
            terminalreporter.write_sep("-", "preload_launcher: off (plain subprocesses)")
        return
    stats = launcher.stats
    if not stats["zygote"] and not stats["subprocess"]:
        return
    tr = terminalreporter
    tr.write_sep("-", "preload_launcher")
    seconds = stats["seconds"]
    tr.write_line(f"steps via zygote: {stats['zygote']} ({seconds['zygote']:.1f} s in them), "
                  f"via subprocess: {stats['subprocess']} ({seconds['subprocess']:.1f} s)")
    for reason, count in sorted(stats["reasons"].items()):
        tr.write_line(f"  subprocess because {reason}: {count}")
    if stats["with_standins"]:
        tr.write_line(f"  interpreters those subprocesses started, forked by the zygote: "
                      f"{launcher.standin_steps()} (python/torchrun/accelerate stand-ins on "
                      f"the PATH of {stats['with_standins']} steps)")
    tr.write_line(f"zygotes started: {stats['zygotes_started']}; steps waited "
                  f"{stats['waited_s']:.1f} s in all for a zygote's preload")
    for z in launcher.zygotes:
        report = z.status.get("preload", {})
        if not report:
            continue
        tr.write_line(f"zygote {z.status.get('pid')}: preloaded {', '.join(report['loaded']) or '(none)'}"
                      f" in {report['seconds']:.1f} s")
        for entry, verdict in report.get("quarantined", {}).items():
            tr.write_line(f"  quarantined {entry}: {verdict['reason']} ({verdict['culprit']})")
        for line in format_deferred(report.get("deferred", {}), indent="  "):
            tr.write_line(line)
        tr.write_line("  " + format_learned(report.get("learned", {})))
        failed = [e["module"] for e in report.get("entries", []) if not e["ok"]]
        if failed:
            tr.write_line(f"  not importable: {', '.join(failed)}")
