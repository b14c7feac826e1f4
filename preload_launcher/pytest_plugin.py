"""pytest plugin: one zygote per session, started before the suite's conftests load (its
preload overlaps their imports and the collection); under xdist the controller starts it (or finds a running daemon for the preload set) and every worker uses it.

Enabled by default once installed; per CI lane: ``PRELOAD_LAUNCHER=0|1`` (wins), then
``--preload-launcher/--no-preload-launcher``. Preload set: ``PRELOAD_LAUNCHER_MODULES`` (wins),
then the ``preload_launcher_modules`` ini key, then the default.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

import pytest

from . import settings
from .caller import client
from .front import daemon, suite_wide
from .front.reporting import format_deferred, format_learned, preload_problems
from .result import LauncherError

PRELOAD_LAUNCHER_DESC = "run steps through a preloaded zygote (PRELOAD_LAUNCHER env var wins)"
MODULES_DESC = "comma-separated modules the zygote preloads (PRELOAD_LAUNCHER_MODULES wins)"
GPUS_DESC = ("pack steps onto free GPUs: auto, or GPU ids like 0,1,2,3 (PRELOAD_LAUNCHER_GPUS "
             "wins; off by default)")
SUITE_DESC = ("also fork every python/torchrun/accelerate the tests start themselves "
              "(subprocess, sys.executable, os.system, shell scripts, multiprocessing spawn); "
              "PRELOAD_LAUNCHER=suite wins")
PROFILE_DESC = ("a portable profile (preload-launcher profile --write) the zygote starts from, "
                "relative to the rootdir (PRELOAD_LAUNCHER_PROFILE wins)")

launcher_key = pytest.StashKey[Optional[client.Launcher]]()
shared_key = pytest.StashKey[str]()  # the socket of the zygote this session's workers share
started_key = pytest.StashKey[float]()
named_key = pytest.StashKey[str]()  # where the preload list was named ("" for the default)
suite_key = pytest.StashKey[bool]()  # suite_wide is installed in this process
workers_key = pytest.StashKey[dict]()  # suite_wide's counts from the xdist workers
passed_over_key = pytest.StashKey[list]()  # why a forking zygote or a daemon was not used


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("preload_launcher")
    group.addoption("--preload-launcher", dest="preload_launcher", action="store_true",
                    default=None, help=PRELOAD_LAUNCHER_DESC)
    group.addoption("--no-preload-launcher", dest="preload_launcher", action="store_false",
                    help="run every step as a plain subprocess")
    group.addoption("--preload-launcher-suite", dest="preload_launcher_suite",
                    action="store_true", default=None, help=SUITE_DESC)
    parser.addini("preload_launcher_suite", SUITE_DESC, type="bool", default=False)
    parser.addini("preload_launcher_modules", MODULES_DESC, default=None)
    parser.addini("preload_launcher_profile", PROFILE_DESC, default=None)
    parser.addini("preload_launcher_gpus", GPUS_DESC, default=None)


def resolve_enabled(config: pytest.Config, option: Optional[bool] = None) -> bool:
    """env > CLI > default (on)."""
    toggle = settings.Settings.from_env().toggle
    if toggle is not None:
        return toggle
    if option is None:
        option = config.getoption("preload_launcher")
    return True if option is None else bool(option)


def resolve_suite_wide(config: pytest.Config) -> bool:
    """Whether the tests' own launches are served too: env (``PRELOAD_LAUNCHER=suite``) > CLI
    (``--preload-launcher-suite``) > ini (``preload_launcher_suite``) > off."""
    from_env = settings.Settings.from_env().suite_wide
    if from_env is not None:
        return from_env
    option = getattr(config.option, "preload_launcher_suite", None)
    if option is None:  # early: only the known args are parsed
        option = getattr(config.known_args_namespace, "preload_launcher_suite", None)
    return bool(option) if option is not None else bool(config.getini("preload_launcher_suite"))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser, args) -> None:
    """Start the session's zygote as early as pytest lets a plugin: before the suite's own
    conftests import torch & co, so the preload overlaps their imports and the collection.
    An xdist worker waits for its configuration: it uses its controller's zygote."""
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        return
    known = early_config.known_args_namespace
    if getattr(known, "help", False) or getattr(known, "version", False):
        return
    start_session_launcher(early_config, getattr(known, "preload_launcher", None),
                           bool(getattr(known, "collectonly", False)))


def pytest_configure(config: pytest.Config) -> None:
    if launcher_key not in config.stash:  # not started early (an xdist worker, --help)
        start_session_launcher(config, config.getoption("preload_launcher"),
                               config.option.collectonly)


def start_session_launcher(config: pytest.Config, option: Optional[bool],
                           collect_only: bool) -> None:
    try:
        _start_session_launcher(config, option, collect_only)
    except settings.SettingsError as err:  # a bad variable or ini value: pytest's usage error
        raise pytest.UsageError(str(err)) from None


def _start_session_launcher(config: pytest.Config, option: Optional[bool],
                            collect_only: bool) -> None:
    enabled = resolve_enabled(config, option)
    if not enabled:
        os.environ["PRELOAD_LAUNCHER"] = "0"  # so preload_launcher.run() in tests agrees
        config.stash[launcher_key] = None
        return
    ini = config.getini("preload_launcher_modules")
    modules = settings.preload_modules(ini=ini)
    config.stash[named_key] = settings.preload_source(ini=ini)
    wanted = settings.Settings.from_env()
    profile = wanted.profile or config.getini("preload_launcher_profile")
    gpus = wanted.gpus or settings.parse_gpus(
        config.getini("preload_launcher_gpus") or "", "preload_launcher_gpus ini option")
    worker = getattr(config, "workerinput", None)
    shared = (worker or {}).get("preload_launcher_socket") or _shared_zygote(config, modules)
    launcher = client.Launcher(modules, profile=str(config.rootpath / profile) if profile else None,
                               gpus=gpus, shared_socket=shared)
    client.set_session_launcher(launcher)  # run() in this process uses the session's zygote
    config.stash[launcher_key] = launcher
    config.stash[started_key] = time.monotonic()
    if shared:
        config.stash[shared_key] = shared
    elif worker is not None or not collect_only:
        # Its preload overlaps collection; under xdist, the workers' steps all go to it.
        try:
            config.stash[shared_key] = launcher.prestart().socket_path
        except (LauncherError, OSError):  # no private directory: each run() says why it ran
            pass                           # as a plain process; the session goes on
    if resolve_suite_wide(config):
        suite_wide.install(launcher)
        config.stash[suite_key] = True


def _shared_zygote(config: pytest.Config, modules) -> str:
    """The socket of the zygote that forked this pytest (``preload-launcher run -- pytest``),
    else of a running ``serve`` daemon, that preloads this preload set for this environment:
    the session's steps are then forked from it instead of from a second zygote; "" when none
    does. Why one was passed over is kept for the summary."""
    passed_over = []
    for find in (client.ZygoteProcess.parent, lambda: _running_daemon(modules)):
        zygote = find()
        if zygote is None or zygote.modules != list(modules):
            continue
        differs = zygote.env_mismatch(os.environ)
        if not differs:
            return zygote.socket_path
        note = (f"{_origin(zygote)} (pid {zygote.pid}) was not used: it was preloaded with "
                f"other values of {', '.join(differs[:3])}")
        if not any(f"(pid {zygote.pid})" in seen for seen in passed_over):
            passed_over.append(note)
    config.stash[passed_over_key] = passed_over
    return ""


def _running_daemon(modules) -> Optional[client.ZygoteProcess]:
    try:
        return daemon.find_daemon(modules)[0]
    except (LauncherError, OSError):
        return None


def _origin(zygote: client.ZygoteProcess) -> str:
    """Whose the zygote is, as the summary names it."""
    if zygote.process is not None:
        return "started by this session"
    kind = "daemon" if zygote.status.get("daemon") else "zygote"
    if zygote.pid == os.getppid():
        return f"the {kind} that forked this pytest"
    return "a running daemon" if kind == "daemon" else "another process's"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """xdist's controller: each worker uses the controller's zygote, which outlives them all
    (the controller ends it once the last worker is done)."""
    shared = node.config.stash.get(shared_key, "")
    if shared:
        node.workerinput["preload_launcher_socket"] = shared


def pytest_unconfigure(config: pytest.Config) -> None:
    launcher = config.stash.get(launcher_key, None)
    if launcher is not None:
        if config.stash.get(suite_key, False):
            suite_wide.uninstall()
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
        whom = "the workers" if config.pluginmanager.hasplugin("dsession") else "this session"
        _shared_summary(terminalreporter, launcher, whom)
        _suite_wide_summary(terminalreporter, config, launcher)
        _notes(terminalreporter, config, launcher, separator=True)
        return
    tr = terminalreporter
    tr.write_sep("-", "preload_launcher")
    seconds = stats["seconds"]
    tr.write_line(f"steps via zygote: {stats['zygote']} ({seconds['zygote']:.1f} s in them), "
                  f"via subprocess: {stats['subprocess']} ({seconds['subprocess']:.1f} s)")
    for reason, count in sorted(stats["reasons"].items()):
        tr.write_line(f"  subprocess because {reason}: {count}")
    if stats["with_standins"]:
        steps = stats["with_standins"]
        tr.write_line(f"  interpreters those subprocesses started, forked by the zygote: "
                      f"{launcher.standin_steps()} (python/torchrun/accelerate stand-ins on "
                      f"the PATH of {steps} step{'' if steps == 1 else 's'})")
    _suite_wide_summary(tr, config, launcher, separator=False)
    tr.write_line(f"zygotes started: {stats['zygotes_started']}; steps waited "
                  f"{stats['waited_s']:.1f} s in all for a zygote's preload")
    _notes(tr, config, launcher)
    if stats["gpu_waits"]:
        tr.write_line(f"GPU packing: {stats['gpu_waits']} steps were granted GPUs; they waited "
                      f"{stats['gpu_wait_s']:.1f} s in all for free ones")
    for z in launcher.zygotes:
        report = z.status.get("preload", {})
        if not report:
            continue
        tr.write_line(f"zygote {z.status.get('pid')} ({_origin(z)}): preloaded "
                      f"{', '.join(report['loaded']) or '(none)'} in {report['seconds']:.1f} s")
        for entry, verdict in report.get("quarantined", {}).items():
            tr.write_line(f"  quarantined {entry}: {verdict['reason']} ({verdict['culprit']})")
        for line in format_deferred(report.get("deferred", {}), indent="  "):
            tr.write_line(line)
        tr.write_line("  " + format_learned(report.get("learned", {})))
        for line in preload_problems(report, config.stash.get(named_key, "")):
            tr.write_line(f"  {line}")


def _notes(tr, config: pytest.Config, launcher: client.Launcher,
           separator: bool = False) -> None:
    """A zygote that crashed or was killed mid-session: the session went on without it, and
    says so (its log is kept); the zygote that forked this pytest, or a daemon, that was
    passed over, and why."""
    lines = launcher.lost_zygotes() + config.stash.get(passed_over_key, [])
    if lines and separator:
        tr.write_sep("-", "preload_launcher")
    for line in lines:
        tr.write_line(line, yellow=True)


def _shared_summary(tr, launcher: client.Launcher, whom: str) -> None:
    """Under xdist the steps ran in the workers, and suite-wide the tests' own launches went to
    stand-ins: the zygote reports what it served."""
    for z in launcher.zygotes:
        if not z.poll_ready():
            continue
        try:
            status = z.request("status")
        except OSError:
            continue
        # A daemon counts its whole life: what it had served when this session met it is not
        # the session's.
        served = status.get("served", 0) - (z.status.get("served") or 0)
        if served <= 0:
            continue
        tr.write_sep("-", "preload_launcher")
        tr.write_line(f"shared zygote {status['pid']} ({_origin(z)}): served {served} steps for "
                      f"{whom}, preloaded {', '.join(status['preload'].get('loaded', []))}")
        packing = status.get("gpus")
        if packing and packing.get("granted_steps"):
            tr.write_line(f"GPU packing over {','.join(packing['pool'])}: "
                          f"{packing['granted_steps']} steps granted GPUs; they waited "
                          f"{packing['waited_s']:.1f} s in all for free ones")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands what its tests started to its controller (xdist sends its
    ``workeroutput`` once every ``pytest_sessionfinish`` ran)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and session.config.stash.get(suite_key, False):
        workeroutput["preload_launcher_suite"] = suite_wide.counts()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """xdist's controller: add up what each worker's tests started (suite_wide)."""
    counts = getattr(node, "workeroutput", {}).get("preload_launcher_suite")
    if counts:
        total = node.config.stash.setdefault(workers_key, {})
        for kind, n in counts.items():
            total[kind] = total.get(kind, 0) + n


def _suite_wide_summary(tr, config: pytest.Config, launcher: client.Launcher,
                        separator: bool = True) -> None:
    """What the tests started themselves, with suite-wide serving on (all workers')."""
    if not config.stash.get(suite_key, False):
        return
    counts = suite_wide.counts()
    for kind, n in config.stash.get(workers_key, {}).items():
        counts[kind] = counts.get(kind, 0) + n
    if separator:
        tr.write_sep("-", "preload_launcher")
    forked, fallbacks = launcher.standin_counts()
    tr.write_line(f"suite-wide: the tests started {counts['interpreters']} interpreters "
                  f"(python, torchrun, accelerate, console scripts) and {counts['with_standins']} "
                  "other programs with stand-ins on their PATH; stand-ins had the zygote fork "
                  f"{forked} interpreters in all")
    for reason, n in sorted(fallbacks.items(), key=lambda item: -item[1])[:5]:
        tr.write_line(f"  {n} ran the real program because {reason}")
