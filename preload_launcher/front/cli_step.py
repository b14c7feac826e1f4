"""``preload-launcher run`` through a zygote: the daemon for the preload set (a dead one is
replaced), else a one-off zygote; ``-v`` says which, why, and what could not be preloaded."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import Mapping, Optional, Sequence

from ..caller.client import Launcher
from ..caller.zygote_handle import ZygoteProcess
from ..command import runner_env_of
from ..result import ZygoteDied
from . import daemon
from .cli_run import other_daemons, say
from .reporting import preload_problems

__all__ = ["run_forked"]


def run_forked(args: argparse.Namespace, modules: Sequence[str], named_in: str) -> int:
    """Run ``args.command`` through a zygote; returns its return code (negative: a signal).
    ``named_in``: where the preload list came from ("" for the default list)."""
    launcher = Launcher(modules)
    # A test runner's own settings (pytest's PYTEST_VERSION) are part of what its imports see.
    env = {**os.environ, **runner_env_of(args.command)}
    found = None if args.no_daemon else _daemon_for(modules, env)
    if found is not None:
        launcher.zygotes.append(found)
        how = f"the daemon (pid {found.status['pid']})"
    else:
        how = "a one-off zygote"
    try:
        # The step gets the CLI's own stdin, stdout and stderr, a terminal included.
        result = launcher.run(args.command, timeout=args.timeout, capture=False, relay=True)
    except KeyboardInterrupt:
        return -signal.SIGINT
    except subprocess.TimeoutExpired:
        print(f"preload-launcher run: timed out after {args.timeout} s", file=sys.stderr)
        return 124
    except ZygoteDied as err:  # `stop` (or a crash) ended the daemon, and the step with it
        print(f"preload-launcher run: the zygote (pid {err.pid}) stopped while running the "
              "command, which was killed with it", file=sys.stderr)
        return -signal.SIGKILL
    finally:
        statuses = [z.status for z in launcher.zygotes]
        launcher.close()
    say(args, f"{how}, via {result.via}" + (f" ({result.reason})" if result.reason else ""))
    if args.verbose:
        for status in statuses:
            for line in preload_problems(status.get("preload", {}), named_in):
                print(f"[preload-launcher] {line}", file=sys.stderr)
    return result.returncode


def _daemon_for(modules: Sequence[str], env: Mapping[str, str]) -> Optional[ZygoteProcess]:
    """The daemon to use, or None; a dead one (killed, crashed) is replaced. Says why a running
    daemon is not used."""
    zygote, meta = daemon.find_daemon(modules)
    if zygote is None and meta is not None:
        print("preload-launcher: the daemon is gone; starting a new one", file=sys.stderr)
        zygote = daemon.start_daemon(modules, env, implicit=True)
    if zygote is None:
        others = other_daemons(modules)
        if others:
            print(f"preload-launcher: no daemon preloads {','.join(modules)}; running: {others} "
                  "(use --preload to pick one)", file=sys.stderr)
        return None
    mismatch = zygote.env_mismatch(env)
    if mismatch:
        hint = " (`serve --pytest` starts one for pytest runs)" if "PYTEST_VERSION" in mismatch \
            else ""
        print(f"preload-launcher: the daemon was preloaded with other values of {', '.join(mismatch)};"
              f" using a fresh zygote for this environment{hint}", file=sys.stderr)
        return None
    return zygote
