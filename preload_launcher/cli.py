"""Stage 6: ``preload-launcher run|doctor|serve|status|stop|learned|profile``. Builds requests and calls
the client; never forks."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Optional


from . import daemon, learn, settings
from .preload import SCOUTED, VerdictCache, package_fingerprint
from .profiles import write_profile
from .client import Launcher, ZygoteProcess
from .result import LauncherError

__all__ = ["main"]


def _exit_status(returncode: int) -> int:
    """A shell's convention: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _daemon_for(modules, env) -> Optional[ZygoteProcess]:
    """The matching daemon; a dead one (killed, crashed) is replaced; none -> None."""
    zygote, meta = daemon.find_daemon(modules)
    if zygote is None and meta is not None:
        print("preload-launcher: the daemon is gone; starting a new one", file=sys.stderr)
        zygote = daemon.start_daemon(modules, env)
    if zygote is None:
        return None
    mismatch = zygote.env_mismatch(env)
    if mismatch:
        print(f"preload-launcher: the daemon was preloaded with other values of {', '.join(mismatch)};"
              " using a fresh zygote for this environment", file=sys.stderr)
        return None
    return zygote


def cmd_run(args: argparse.Namespace) -> int:
    if not args.command:
        print("preload-launcher run: no command given (use: run -- python script.py …)",
              file=sys.stderr)
        return 2
    modules = settings.preload_modules(args.preload)
    launcher = Launcher(modules)
    if not args.no_daemon:
        found = _daemon_for(modules, os.environ)
        if found is not None:
            launcher.zygotes.append(found)
    try:
        result = launcher.run(args.command, timeout=args.timeout, echo=True)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        launcher.close()
    if args.verbose:
        print(f"[preload-launcher] via={result.via} {result.reason}", file=sys.stderr)
    return _exit_status(result.returncode)


def format_doctor(status: dict) -> str:
    report = status.get("preload", {})
    lines = [f"zygote pid {status.get('pid')} ({status.get('python')}), probe: {report.get('probe')}, "
             f"NVML answers during import: {report.get('nvml_answers')}",
             f"preload took {report.get('seconds')} s; requested: {', '.join(report.get('requested', []))}",
             "", f"{'module':32} {'time':>7}  {'torch CUDA':10} {'driver':8} {'threads+':8} result"]
    for e in report.get("entries", []):
        result = "ok" if e["ok"] else f"FAILED: {e['error'][:100]}"
        lines.append(f"{e['module']:32} {e['seconds']:6.2f}s  {str(e['torch_cuda_initialized']):10} "
                     f"{str(e['driver_initialized']):8} {e['native_threads_added']:<8} {result}")
        if e["python_threads"]:
            lines.append(f"{'':32} python threads started: {', '.join(e['python_threads'])}")
    for entry, verdict in report.get("quarantined", {}).items():
        lines.append(f"QUARANTINED {entry}: {verdict['reason']}; culprit {verdict['culprit']} via "
                     f"{' -> '.join(verdict['chain'])}")
    lines.extend(format_deferred(report.get("deferred", {})))
    lines.append("")
    lines.append(f"final preload set: {', '.join(report.get('loaded', [])) or '(none)'}")
    lines.append(format_learned(report.get("learned", {})))
    threads = status.get("native_threads", {})
    lines.append(f"native threads at fork time: {sum(threads.values())} "
                 f"({', '.join(f'{k}×{v}' for k, v in sorted(threads.items()))})")
    for row in status.get("native_threads_described", []):
        lines.append(f"  {row['count']:3} × {row['what']}: fork-safe: {row['fork_safe']}")
    lines.append(f"zygote RSS: {status.get('rss_kb', 0) / 1024:.0f} MiB")
    return "\n".join(lines)


def format_deferred(deferred: dict, indent: str = "") -> list[str]:
    """Deferred packages: why, and the guarded imports each step replays."""
    lines = []
    for package, info in deferred.items():
        lines.append(f"{indent}DEFERRED {package}: {info['reason']}; culprit {info['culprit']} via "
                     f"{' -> '.join(info['chain'])}; {info.get('entry', 'its importer')} stays "
                     "preloaded")
        for cut in info.get("cut", []):
            names = ", ".join(cut["fromlist"]) or "(module)"
            lines.append(f"{indent}  replayed in steps: from {cut['module']} import {names} "
                         f"(in {cut['importer']})")
    return lines


def format_learned(learned: dict) -> str:
    if not learned:
        return "learned preload: off (PRELOAD_LAUNCHER_LEARN=0)"
    if "disabled" in learned:
        return f"learned preload: disabled ({learned['disabled']})"
    text = (f"learned preload: {learned['loaded']} of {learned['listed']} modules that earlier "
            f"steps imported, {learned['seconds']:.1f} s at start-up")
    if learned.get("over_budget"):
        text += f", {learned['over_budget']} left out by the budget"
    if learned.get("quarantined"):
        text += f"; quarantined: {', '.join(learned['quarantined'])}"
    return text


def cmd_learned(args: argparse.Namespace) -> int:
    """Show, pin or forget what the learned preload keeps for this project and environment."""
    project = os.path.abspath(args.project or os.getcwd())
    profile = learn.Profile(settings.Settings.from_env().cache_dir, learn.profile_key(project), project)
    profile.merge_reports()
    for module in args.pin or []:
        profile.pin(module)
    for module in args.forget or []:
        profile.forget(module)
    if args.clear:
        profile.data["modules"] = {}
    profile.save()
    modules = profile.data["modules"]
    print(f"profile {profile.path} (project {project})")
    print(f"{len(modules)} learned, pinned: {', '.join(profile.data['pinned']) or '-'}, "
          f"forgotten: {', '.join(profile.data['forgotten']) or '-'}")
    costly = sorted(modules, key=lambda m: -(modules[m]["seconds"] or 0))[:args.top]
    for name in costly:
        seconds = modules[name]["seconds"]
        print(f"  {name:50} seen {modules[name]['count']:4}x  "
              f"{'%.3f s' % seconds if seconds is not None else 'not preloaded yet'}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Write a portable profile: this package set's verdicts and the learned modules."""
    s = settings.Settings.from_env()
    project = os.path.abspath(args.project or os.getcwd())
    fingerprint = package_fingerprint(sys.path[1:])  # as the zygote sees them: no sys.path[0]
    verdicts = {k: v for k, v in VerdictCache(s.cache_dir, f"{fingerprint}-{s.probe}").get().items()
                if not v.get("cleared")}
    learned = learn.Profile(s.cache_dir, learn.profile_key(project), project)
    learned.merge_reports()
    learned.save()
    write_profile(args.write, fingerprint, s.probe, verdicts, list(learned.data["modules"]),
                  list(learned.data["pinned"]))
    found = sorted(k for k in verdicts if not k.startswith(SCOUTED))
    print(f"preload-launcher: wrote {args.write}: {len(found)} verdicts "
          f"({', '.join(found) or 'none'}), {len(verdicts) - len(found)} entries known clean, "
          f"{len(learned.data['modules'])} learned modules, package fingerprint {fingerprint}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    modules = settings.preload_modules(args.preload)
    zygote = ZygoteProcess(modules, os.environ)
    try:
        status = zygote.start().status
    except LauncherError as err:
        print(f"preload-launcher doctor: {err}", file=sys.stderr)
        return 1
    finally:
        zygote.close()
    print(json.dumps(status, indent=1) if args.json else format_doctor(status))
    report = status["preload"]
    clean = not report["quarantined"] and all(e["ok"] for e in report["entries"])
    return 0 if clean else 1


def cmd_serve(args: argparse.Namespace) -> int:
    modules = settings.preload_modules(args.preload)
    zygote, _ = daemon.find_daemon(modules)
    if zygote is None:
        zygote = daemon.start_daemon(modules, os.environ)
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
    while daemon._pid_alive(pid):
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


def cmd_status(args: argparse.Namespace) -> int:
    metas = daemon.list_daemons()
    if args.preload is not None or not metas:
        metas = [{"modules": list(settings.preload_modules(args.preload))}]
    found = 0
    for meta in metas:
        zygote, _ = daemon.find_daemon(meta["modules"])
        if zygote is None:
            print(f"no daemon serving {','.join(meta['modules'])}")
            continue
        found += 1
        print(json.dumps(zygote.status, indent=1) if args.json else format_status(zygote.status))
    return 0 if found else 1


def cmd_stop(args: argparse.Namespace) -> int:
    metas = daemon.list_daemons() if args.all else [
        {"modules": list(settings.preload_modules(args.preload))}]
    stopped = [daemon.stop_daemon(meta["modules"]) for meta in metas]
    for pid in stopped:
        if pid:
            print(f"preload-launcher: stopped pid {pid}")
    return 0 if any(stopped) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="preload-launcher",
                                     description="Run steps as children of a preloaded zygote.")
    sub = parser.add_subparsers(dest="verb", required=True)
    run = sub.add_parser("run", help="run one command through a zygote, exit with its code")
    run.add_argument("--preload", default=None,
                     help="comma-separated modules to preload (default: PRELOAD_LAUNCHER_MODULES "
                          f"or {','.join(settings.DEFAULT_MODULES)})")
    run.add_argument("--timeout", type=float, default=None)
    run.add_argument("-v", "--verbose", action="store_true", help="say how the step ran")
    run.add_argument("--no-daemon", action="store_true", help="never use a running daemon")
    run.add_argument("command", nargs=argparse.REMAINDER)
    doctor = sub.add_parser("doctor", help="preload, report what each module did, and exit")
    doctor.add_argument("--preload", default=None)
    doctor.add_argument("--json", action="store_true")
    serve = sub.add_parser("serve", help="keep a warm zygote for `run` (a daemon)")
    serve.add_argument("--preload", default=None)
    serve.add_argument("--detach", action="store_true", help="return once it serves")
    status = sub.add_parser("status", help="show running daemons")
    status.add_argument("--preload", default=None)
    status.add_argument("--json", action="store_true")
    learned = sub.add_parser("learned", help="show, pin or forget learned preload entries")
    learned.add_argument("--project", default=None, help="project root (default: cwd)")
    learned.add_argument("--pin", action="append", metavar="MODULE")
    learned.add_argument("--forget", action="append", metavar="MODULE")
    learned.add_argument("--clear", action="store_true", help="forget everything learned")
    learned.add_argument("--top", type=int, default=20, help="show the N costliest")
    profile = sub.add_parser("profile", help="write a portable profile for fresh machines")
    profile.add_argument("--write", required=True, metavar="FILE",
                         help="where to write it (use it with PRELOAD_LAUNCHER_PROFILE=FILE)")
    profile.add_argument("--project", default=None, help="project root (default: cwd)")
    stop = sub.add_parser("stop", help="stop a daemon and the steps it runs")
    stop.add_argument("--preload", default=None)
    stop.add_argument("--all", action="store_true")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    return {"run": cmd_run, "doctor": cmd_doctor, "serve": cmd_serve, "status": cmd_status,
            "stop": cmd_stop, "learned": cmd_learned, "profile": cmd_profile}[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
