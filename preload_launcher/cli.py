"""Stage 6: ``preload-launcher run|doctor``. Builds requests and calls the client; never forks."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Optional

from . import settings
from .client import Launcher, ZygoteProcess
from .result import LauncherError

__all__ = ["main"]


def _exit_status(returncode: int) -> int:
    """A shell's convention: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def cmd_run(args: argparse.Namespace) -> int:
    if not args.command:
        print("preload-launcher run: no command given (use: run -- python script.py …)",
              file=sys.stderr)
        return 2
    modules = settings.preload_modules(args.preload)
    launcher = Launcher(modules)
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
    lines.append("")
    lines.append(f"final preload set: {', '.join(report.get('loaded', [])) or '(none)'}")
    threads = status.get("native_threads", {})
    lines.append(f"native threads at fork time: {sum(threads.values())} "
                 f"({', '.join(f'{k}×{v}' for k, v in sorted(threads.items()))})")
    lines.append(f"zygote RSS: {status.get('rss_kb', 0) / 1024:.0f} MiB")
    return "\n".join(lines)


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
    run.add_argument("command", nargs=argparse.REMAINDER)
    doctor = sub.add_parser("doctor", help="preload, report what each module did, and exit")
    doctor.add_argument("--preload", default=None)
    doctor.add_argument("--json", action="store_true")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    return {"run": cmd_run, "doctor": cmd_doctor}[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
