"""Stage 6: ``preload-launcher run|doctor|serve|status|stop|learned|profile``. Builds requests and calls
the client; never forks."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional


from . import __version__, daemon, learn, settings
from .verdicts import SCOUTED, VerdictCache, package_fingerprint
from .files import unlink_all
from .profiles import write_profile
from .client import Launcher, ZygoteProcess
from .result import LauncherError

__all__ = ["main"]


def _exit_status(returncode: int) -> int:
    """A shell's convention: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _daemon_for(modules, env) -> tuple[Optional[ZygoteProcess], bool]:
    """(the matching daemon or None, whether a daemon for ``modules`` runs at all); a dead one
    (killed, crashed) is replaced. Says why a running daemon is not used."""
    zygote, meta = daemon.find_daemon(modules)
    if zygote is None and meta is not None:
        print("preload-launcher: the daemon is gone; starting a new one", file=sys.stderr)
        zygote = daemon.start_daemon(modules, env)
    if zygote is None:
        others = _other_daemons(modules)
        if others:
            print(f"preload-launcher: no daemon preloads {','.join(modules)}; running: {others} "
                  "(use --preload to pick one)", file=sys.stderr)
        return None, False
    mismatch = zygote.env_mismatch(env)
    if mismatch:
        print(f"preload-launcher: the daemon was preloaded with other values of {', '.join(mismatch)};"
              " using a fresh zygote for this environment", file=sys.stderr)
        return None, True
    return zygote, True


def _other_daemons(modules) -> str:
    """'pid N preloads a,b; …' for this user's live daemons of another preload set."""
    found = [(meta["pid"], meta["modules"]) for meta in daemon.list_daemons()
             if meta["modules"] != list(modules) and daemon._pid_alive(meta["pid"])]
    return "; ".join(f"pid {pid} preloads {','.join(mods)}" for pid, mods in found)


def cmd_run(args: argparse.Namespace) -> int:
    if not args.command:
        print("preload-launcher run: no command given (use: run -- python script.py …)",
              file=sys.stderr)
        return 2
    modules = settings.preload_modules(args.preload)
    launcher = Launcher(modules)
    found, exists = (None, False) if args.no_daemon else _daemon_for(modules, os.environ)
    if found is not None:
        launcher.zygotes.append(found)
        how = f"the daemon (pid {found.status['pid']})"
    elif not args.no_daemon and not exists and settings.Settings.from_env().autoserve:
        # The step first, alone: a daemon preloading beside it would slow it down.
        code = _run_plain(args.command, args.timeout)
        started = daemon.spawn_daemon(modules)
        say(args, "a plain process: no daemon preloads " + ",".join(modules) + "; " +
            ("one is starting for the next run" if started else "one is starting already"))
        return _exit_status(code)
    else:
        how = "a one-off zygote"
    try:
        # The step gets the CLI's own stdin, stdout and stderr, a terminal included.
        result = launcher.run(args.command, timeout=args.timeout, capture=False)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except subprocess.TimeoutExpired:
        print(f"preload-launcher run: timed out after {args.timeout} s", file=sys.stderr)
        return 124
    finally:
        launcher.close()
    say(args, f"{how}, via {result.via}" + (f" ({result.reason})" if result.reason else ""))
    return _exit_status(result.returncode)


def _terminal():
    """Where long work shows its progress: stderr when it is a terminal, else nowhere."""
    return sys.stderr if sys.stderr.isatty() else None


def say(args: argparse.Namespace, how: str) -> None:
    if args.verbose:
        print(f"[preload-launcher] ran through {how}", file=sys.stderr)


def _run_plain(command: list[str], timeout: Optional[float]) -> int:
    """The command as the shell would run it: same terminal, same process group (Ctrl-C
    reaches it), but killed with its group after ``timeout``."""
    try:
        proc = subprocess.Popen(command)
    except OSError as err:
        print(f"preload-launcher run: {command[0]}: {err.strerror}", file=sys.stderr)
        return 127 if isinstance(err, FileNotFoundError) else 126
    try:
        return proc.wait(timeout=timeout)
    except KeyboardInterrupt:
        return proc.wait()
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        print(f"preload-launcher run: timed out after {timeout} s", file=sys.stderr)
        return 124


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
        status = zygote.start(progress=_terminal()).status
    except LauncherError as err:
        print(f"preload-launcher doctor: {err}", file=sys.stderr)
        return 1
    finally:
        zygote.close()
    print(json.dumps(status, indent=1) if args.json else format_doctor(status))
    verdict, code = doctor_verdict(status["preload"])
    print(verdict)
    return code


def doctor_verdict(report: dict) -> tuple[str, int]:
    """The last line of doctor and its exit status: a module that is not installed is a
    warning; a quarantine or another import failure is a failure."""
    missing = [e["module"] for e in report["entries"] if not e["ok"]
               and e["error"].startswith("ModuleNotFoundError") and e.get("missing", "") and
               e["module"].startswith(e["missing"])]
    failed = [f"{e['module']} ({e['error'][:80]})" for e in report["entries"]
              if not e["ok"] and e["module"] not in missing]
    quarantined = [f"{name} ({verdict['reason']})" for name, verdict in report["quarantined"].items()]
    problems = quarantined and [f"quarantined: {'; '.join(quarantined)}"] or []
    problems += failed and [f"failed to import: {'; '.join(failed)}"] or []
    warning = f"; not installed (skipped): {', '.join(missing)}" if missing else ""
    if problems:
        return f"doctor: FAIL: {'; '.join(problems)}{warning}", 1
    return (f"doctor: OK: {len(report['loaded'])} of {len(report['requested'])} preloaded"
            f"{warning}"), 0


def cmd_serve(args: argparse.Namespace) -> int:
    modules = settings.preload_modules(args.preload)
    zygote, _ = daemon.find_daemon(modules)
    if zygote is None:
        try:
            zygote = daemon.start_daemon(modules, os.environ, args.idle_timeout, _terminal())
        finally:
            unlink_all(daemon.starting_file(modules))  # started (or failed): `run` may try again
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


def _chosen_daemons(args: argparse.Namespace) -> tuple[list[dict], str]:
    """The daemons a status/stop call means (--all: every one; --preload or the default list:
    that one), and what to say when there is none."""
    metas = daemon.list_daemons()
    if getattr(args, "all", False) or (args.verb == "status" and args.preload is None):
        return metas, "no daemon is running (start one with: preload-launcher serve --detach)"
    modules = list(settings.preload_modules(args.preload))
    others = _other_daemons(modules)
    why = f"no daemon preloads {','.join(modules)}" + (
        f"; running: {others} (use --preload MODULES or --all)" if others else
        "; none is running")
    return [m for m in metas if m["modules"] == modules], why


def cmd_status(args: argparse.Namespace) -> int:
    metas, why = _chosen_daemons(args)
    found = [z for z, _ in (daemon.find_daemon(m["modules"]) for m in metas) if z is not None]
    for zygote in found:
        print(json.dumps(zygote.status, indent=1) if args.json else format_status(zygote.status))
    if not found:
        print(f"preload-launcher status: {why}", file=sys.stderr)
    return 0 if found else 1


def cmd_stop(args: argparse.Namespace) -> int:
    daemon.wait_for_starting()
    metas, why = _chosen_daemons(args)
    stopped = [pid for pid in (daemon.stop_daemon(m["modules"]) for m in metas) if pid]
    for pid in stopped:
        print(f"preload-launcher: stopped pid {pid}")
    if not stopped:
        print(f"preload-launcher stop: {why}", file=sys.stderr)
    return 0 if stopped else 1


PRELOAD_HELP = ("comma-separated modules the zygote preloads (default: PRELOAD_LAUNCHER_MODULES, "
                f"else {','.join(settings.DEFAULT_MODULES)})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preload-launcher",
        description="Run python and torchrun steps as fresh children forked from a preloaded, "
                    "CUDA-clean zygote.",
        epilog="Run 'preload-launcher VERB --help' for a verb's options.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    _add_step_verbs(sub)
    _add_daemon_verbs(sub)
    _add_profile_verbs(sub)
    return parser


def _verb(sub, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=summary, description=description)


def _preload_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preload", default=None, metavar="MODULES", help=PRELOAD_HELP)


def _add_step_verbs(sub) -> None:
    run = _verb(sub, "run", "run one command, exit with its code",
                "Run one command (python …, torchrun …) through the daemon that preloads its "
                "modules. With no such daemon the command runs as a plain process, and a daemon "
                "starts in the background for the next run (PRELOAD_LAUNCHER_AUTOSERVE=0: a "
                "one-off zygote instead).")
    _preload_option(run)
    run.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="kill the step and everything it started after this many seconds "
                          "(exit status 124)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="say how the step ran (daemon, plain process or one-off zygote) and why")
    run.add_argument("--no-daemon", action="store_true",
                     help="neither use nor start a daemon: a one-off zygote runs the step")
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    doctor = _verb(sub, "doctor", "preload, report what each module did, exit",
                   "Start a zygote, preload, and report per module: import time, CUDA state, "
                   "threads started, quarantines and deferrals. Exit status 0 when every "
                   "installed module was preloaded (or deferred a culprit), 1 when one was "
                   "quarantined or failed; a module that is not installed is a warning.")
    _preload_option(doctor)
    doctor.add_argument("--json", action="store_true", help="print the zygote's status as JSON")


def _add_daemon_verbs(sub) -> None:
    serve = _verb(sub, "serve", "keep a warm zygote (a daemon) for `run`",
                  "Start a daemon that preloads once and serves `run` until stopped or idle.")
    _preload_option(serve)
    serve.add_argument("--detach", action="store_true",
                       help="return once the daemon serves (else wait until it stops)")
    serve.add_argument("--idle-timeout", type=float, default=None, metavar="SECONDS",
                       help="stop after this many seconds without a request (default: "
                            "PRELOAD_LAUNCHER_IDLE_TIMEOUT_S, else 1800; 0: never)")
    status = _verb(sub, "status", "show running daemons", "Show each running daemon: pid, "
                   "uptime, preload, steps served, memory, staleness.")
    _preload_option(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    stop = _verb(sub, "stop", "stop a daemon and the steps it runs",
                 "Stop the daemon that preloads the given modules (or every daemon), its steps "
                 "and its files.")
    _preload_option(stop)
    stop.add_argument("--all", action="store_true", help="stop every daemon of this user")


def _add_profile_verbs(sub) -> None:
    project_help = "project root (default: the current directory)"
    learned = _verb(sub, "learned", "show, pin or forget learned preload entries",
                    "Show the modules steps imported that the next zygote preloads, and edit "
                    "the list.")
    learned.add_argument("--project", default=None, help=project_help)
    learned.add_argument("--pin", action="append", metavar="MODULE", help="always preload MODULE")
    learned.add_argument("--forget", action="append", metavar="MODULE",
                         help="never preload MODULE")
    learned.add_argument("--clear", action="store_true", help="forget everything learned")
    learned.add_argument("--top", type=int, default=20, metavar="N",
                         help="show the N costliest modules (default 20)")
    profile = _verb(sub, "profile", "write a portable profile for fresh machines",
                    "Write this package set's verdicts and learned modules to a file that a "
                    "fresh machine starts from (PRELOAD_LAUNCHER_PROFILE=FILE).")
    profile.add_argument("--write", required=True, metavar="FILE", help="where to write it")
    profile.add_argument("--project", default=None, help=project_help)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help(sys.stderr)
        return 2
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    return {"run": cmd_run, "doctor": cmd_doctor, "serve": cmd_serve, "status": cmd_status,
            "stop": cmd_stop, "learned": cmd_learned, "profile": cmd_profile}[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
