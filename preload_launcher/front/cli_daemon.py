"""``preload-launcher serve|status|stop``: the warm daemon's verbs.

``status`` and ``stop`` pick daemons by the same rule as every verb: ``--preload``, else
``PRELOAD_LAUNCHER_MODULES``, else the default list; ``--all`` takes every daemon of this user.
A daemon that is starting is shown as starting, and ``stop`` waits for it to serve, then stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from .. import settings
from ..caller.zygote_handle import ZygoteProcess
from ..command import runner_env_of
from ..files import unlink_all
from . import daemon
from .cli_run import other_daemons
from .daemon_files import daemon_paths, pid_alive, starting_daemons, starting_file
from .reporting import format_deferred

__all__ = ["cmd_serve", "cmd_status", "cmd_stop", "format_status"]


def _terminal():
    """Where long work shows its progress: stderr when it is a terminal, else nowhere."""
    return sys.stderr if sys.stderr.isatty() else None


def cmd_serve(args: argparse.Namespace) -> int:
    modules = settings.preload_modules(args.preload)
    zygote, _ = daemon.find_daemon(modules)
    if zygote is None:
        daemon.mark_starting(modules)
        try:
            # A daemon for pytest runs imports with what pytest sets in its own process.
            env = {**os.environ, **(runner_env_of(["pytest"]) if args.pytest else {})}
            zygote = daemon.start_daemon(modules, env, args.idle_timeout, _terminal(),
                                         implicit=args.implicit)
        finally:
            unlink_all(starting_file(modules))  # started (or failed): `run` may try again
    if zygote.process is not None:  # this call started it (else another had, meanwhile)
        print(f"preload-launcher: serving, pid {zygote.status['pid']}, preloaded "
              f"{', '.join(zygote.status['preload']['loaded']) or '(none)'} in "
              f"{zygote.status['preload']['seconds']:.1f} s; log {zygote.log_path}")
    else:
        print(f"preload-launcher: already serving, pid {zygote.status['pid']}")
    if args.detach:
        return 0
    pid = zygote.status["pid"]
    stop = lambda *_: daemon.stop_daemon(modules)  # noqa: E731
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while pid_alive(pid):
        time.sleep(0.5)
    return 0


def format_status(status: dict) -> str:
    report = status.get("preload", {})
    lines = [f"pid {status['pid']} ({status['python']}), up {status['uptime_s']:.0f} s, "
             f"{status['served']} steps served, {status['running']} running",
             f"preloaded: {', '.join(report.get('loaded', [])) or '(none)'} "
             f"({report.get('seconds', 0):.1f} s)",
             f"memory: zygote RSS {status['rss_kb'] / 1024:.0f} MiB, running steps PSS "
             f"{status['steps_pss_kb'] / 1024:.0f} MiB"]
    for entry, verdict in report.get("quarantined", {}).items():
        lines.append(f"quarantined: {entry} ({verdict['reason']}; culprit {verdict['culprit']})")
    lines.extend(format_deferred(report.get("deferred", {})))
    lines.append("stale: " + (", ".join(status["stale"][:5]) if status["stale"] else "no"))
    return "\n".join(lines)


def format_starting(starter: dict) -> str:
    modules = ",".join(starter["modules"]) if starter.get("modules") else "its preload set"
    return f"pid {starter['pid']}: starting (preloading {modules}); not serving yet"


def _chosen(args: argparse.Namespace) -> tuple[list[dict], list[dict], str]:
    """(metadata of the daemons a status/stop call means, those of them still starting, what
    to say when there is none): --all, else the preload set by the rule every verb uses."""
    starting = starting_daemons()
    # A starting daemon's metadata is written before it serves, and it answers only once it
    # serves: status and stop report it as starting rather than wait for it.
    markers = {s["marker"] for s in starting}
    from_meta = [m for m in daemon.list_daemons()
                 if m.get("socket", "")[:-len(".sock")] + ".starting" not in markers]
    if args.all:
        return from_meta, starting, ("no daemon is running (start one with: "
                                     "preload-launcher serve --detach)")
    modules = settings.preload_modules(args.preload)
    sock = daemon_paths(modules)[0]
    marker = starting_file(modules)
    others = other_daemons(modules)
    why = f"no daemon preloads {','.join(modules)}" + (
        f"; running: {others} (use --preload MODULES or --all)" if others else
        "; none is running")
    return ([m for m in from_meta if m.get("socket") == sock],
            [s for s in starting if s["marker"] == marker], why)


def _serving(metas: list[dict]) -> list[ZygoteProcess]:
    found = []
    for meta in metas:
        try:
            found.append(ZygoteProcess.attach(meta["socket"]))
        except (OSError, KeyError):
            pass  # gone: the next `run` replaces it
    return found


def cmd_status(args: argparse.Namespace) -> int:
    metas, starting, why = _chosen(args)
    found = _serving(metas)
    for zygote in found:
        print(json.dumps(zygote.status, indent=1) if args.json else format_status(zygote.status))
    for starter in starting:
        print(json.dumps({"starting": True, **starter}) if args.json else format_starting(starter))
    if not found and not starting:
        print(f"preload-launcher status: {why}", file=sys.stderr)
    return 0 if found else 1


def cmd_stop(args: argparse.Namespace) -> int:
    _, starting, _ = _chosen(args)
    for starter in starting:
        print(f"preload-launcher stop: {format_starting(starter)}: stopping it once it serves",
              file=sys.stderr)
    daemon.wait_for_starting(starting)
    metas, _, why = _chosen(args)
    stopped = [pid for pid in (daemon.stop_daemon(m["modules"], sock=m["socket"])
                               for m in metas) if pid]
    for pid in stopped:
        print(f"preload-launcher: stopped pid {pid}")
    if not stopped:
        print(f"preload-launcher stop: {why}", file=sys.stderr)
    return 0 if stopped else 1
