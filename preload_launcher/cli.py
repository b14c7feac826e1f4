"""Stage 6: ``preload-launcher run|doctor|serve|status|stop|learned|profile``. Builds requests and calls
the client; never forks.

Each verb lives in its own module, imported only when that verb runs: ``run`` without a daemon
loads the settings and the daemon's file names, never the client (it starts in milliseconds).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional

from . import __version__, settings
from .result import LauncherError

__all__ = ["main", "build_parser"]

# verb -> (module, function)
VERBS = {"run": ("front.cli_run", "cmd_run"), "doctor": ("front.cli_inspect", "cmd_doctor"),
         "serve": ("front.cli_daemon", "cmd_serve"), "status": ("front.cli_daemon", "cmd_status"),
         "stop": ("front.cli_daemon", "cmd_stop"), "learned": ("front.cli_inspect", "cmd_learned"),
         "profile": ("front.cli_inspect", "cmd_profile")}

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
                "starts in the background for the next run unless the command used under a "
                "second of CPU time (PRELOAD_LAUNCHER_AUTOSERVE=0: a one-off zygote instead).")
    _preload_option(run)
    run.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="kill the step and everything it started after this many seconds "
                          "(exit status 124)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="say how the step ran (daemon, plain process or one-off zygote) and "
                          "why, and which preload modules could not be imported")
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
    serve.add_argument("--pytest", action="store_true",
                       help="preload as pytest runs (with the PYTEST_VERSION it sets for "
                            "itself), to serve `run -- pytest …` and what its tests start")
    # `run` starts its daemons with this: they pre-warm no CUDA context unless a variable asks.
    serve.add_argument("--implicit", action="store_true", help=argparse.SUPPRESS)
    status = _verb(sub, "status", "show running daemons",
                   "Show the daemon for the preload set (--preload, else PRELOAD_LAUNCHER_MODULES, "
                   "else the default list), or every daemon (--all): pid, uptime, preload, steps "
                   "served, memory, staleness; or that it is starting. Exit status 0 when one "
                   "serves.")
    _preload_option(status)
    status.add_argument("--all", action="store_true", help="show every daemon of this user")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    stop = _verb(sub, "stop", "stop a daemon and the steps it runs",
                 "Stop the daemon for the preload set (--preload, else PRELOAD_LAUNCHER_MODULES, "
                 "else the default list), or every daemon (--all), its steps and its files; a "
                 "daemon that is starting is stopped once it serves.")
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


# Interpreter settings meant for the command, which the CLI's own interpreter would also act on:
# stay interactive after the command (PYTHONINSPECT), print its own imports (PYTHONVERBOSE,
# PYTHONPROFILEIMPORTTIME) or warnings (PYTHONWARNINGS, PYTHONDEVMODE), trace its own memory.
# The command gets them; the CLI re-executes itself without them (``-E``).
COMMANDS_ONLY = ("PYTHONINSPECT", "PYTHONVERBOSE", "PYTHONDEBUG", "PYTHONOPTIMIZE",
                 "PYTHONDEVMODE", "PYTHONWARNINGS", "PYTHONPROFILEIMPORTTIME",
                 "PYTHONTRACEMALLOC", "PYTHONFAULTHANDLER", "PYTHONMALLOC", "PYTHONMALLOCSTATS",
                 "PYTHONWARNDEFAULTENCODING", "PYTHONDUMPREFS", "PYTHONSHOWREFCOUNT")
ISOLATED = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
            "from preload_launcher.cli import main; sys.exit(main())")


def isolate_own_interpreter(argv: list[str]) -> None:
    """Re-execute this CLI with ``-E`` where the environment holds settings for the command's
    interpreter that this one would also take (the environment itself is passed on whole)."""
    if sys.flags.ignore_environment or not any(os.environ.get(k) for k in COMMANDS_ONLY):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.execv(sys.executable, [sys.executable, "-E", "-c", ISOLATED, package_parent, *argv])


def main(argv: Optional[list[str]] = None) -> int:
    if argv is None:
        isolate_own_interpreter(sys.argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help(sys.stderr)
        return 2
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    module, function = VERBS[args.verb]
    try:
        settings.Settings.from_env()  # a bad setting stops every verb before it does anything
        verb = getattr(importlib.import_module(f"{__package__}.{module}"), function)
        return verb(args)
    except settings.SettingsError as err:
        print(f"preload-launcher {args.verb}: {err}", file=sys.stderr)
        return 2
    except LauncherError as err:  # no private directory, a daemon that could not start
        print(f"preload-launcher {args.verb}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
