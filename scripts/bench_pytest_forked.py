"""pytest itself forked from a warm daemon, against plain pytest with the plugin; plain and
the first call each start on an empty private cache and runtime directory (a fresh CI machine):

  1. plain      ``python -m pytest SUITE`` (the plugin on: its own zygote serves the steps)
  2. first      ``preload-launcher run -- python -m pytest SUITE`` with no daemon yet
  3. warm x N   the same once the daemon the first call started is ready: pytest is forked
                from it, and so are the suite's steps

    python scripts/bench_pytest_forked.py                 # scripts/example_suite, the demo's preload
    python scripts/bench_pytest_forked.py --suite DIR --preload torch --rounds 3 --warm 5

Rounds alternate plain and first call; the warm calls follow the last round's first call.

Every call must pass; the daemon is stopped and the directories removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEMO_PRELOAD = "torch,megatron.core,modelopt.torch"  # what scripts/demo.py preloads
CLI = [sys.executable, "-m", "preload_launcher.cli"]
DAEMON_WAIT_S = 900.0


def timed(command: list[str], env: dict, cwd: str) -> tuple[float, str, str]:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return wall, done.stdout, done.stderr


def summary(stdout: str, stderr: str) -> str:
    """How pytest ran (``run -v``) and how its steps ran (the plugin's summary)."""
    lines = [line.replace("[preload-launcher] ", "") for line in stderr.splitlines()
             if line.startswith("[preload-launcher] ran through")]
    lines += [line for line in stdout.splitlines()
              if line.startswith(("steps via zygote", "zygotes started"))]
    return "; ".join(lines)


def wait_for_daemon(env: dict) -> float:
    start = time.perf_counter()
    while subprocess.run([*CLI, "status"], env=env, capture_output=True).returncode != 0:
        if time.perf_counter() - start > DAEMON_WAIT_S:
            sys.exit("the daemon the first call started did not come up")
        time.sleep(0.5)
    return time.perf_counter() - start


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def private_env(preload: str) -> tuple[dict, str]:
    """The environment of a fresh CI machine: an empty cache and runtime directory."""
    private = tempfile.mkdtemp(prefix="pl-bench-pytest-")
    os.chmod(private, 0o700)
    os.makedirs(os.path.join(private, "run"), mode=0o700)
    pythonpath = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PRELOAD_LAUNCHER_MODULES=preload, PYTHONPATH=pythonpath,
               PRELOAD_LAUNCHER_CACHE_DIR=os.path.join(private, "cache"),
               XDG_RUNTIME_DIR=os.path.join(private, "run"))
    for name in ("PRELOAD_LAUNCHER", "PRELOAD_LAUNCHER_PROFILE", "PRELOAD_LAUNCHER_AUTOSERVE"):
        env.pop(name, None)
    return env, private


def one_round(pytest: list[str], args: argparse.Namespace, suite: str, last: bool) -> tuple:
    """Plain pytest, then the first ``run`` and, in the ``last`` round, the warm calls, each
    start on an empty cache. Returns (plain, first, [warm...]) walls."""
    env, private = private_env(args.preload)
    try:
        plain, out, err = timed(pytest, env, suite)
        print(f"plain pytest (plugin on)        {plain:6.2f} s  {summary(out, err)}", flush=True)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    env, private = private_env(args.preload)
    through_run = [*CLI, "run", "-v", "--", *pytest]
    warm: list[float] = []
    try:
        first, out, err = timed(through_run, env, suite)
        print(f"run -- pytest, no daemon yet    {first:6.2f} s  {summary(out, err)}", flush=True)
        if last:
            print(f"  the daemon it started was ready {wait_for_daemon(env):.1f} s after it "
                  "ended", flush=True)
            for i in range(args.warm):
                wall, out, err = timed(through_run, env, suite)
                warm.append(wall)
                print(f"run -- pytest, warm {i + 1}          {wall:6.2f} s  {summary(out, err)}",
                      flush=True)
    finally:
        subprocess.run([*CLI, "stop", "--all"], env=env, capture_output=True)
        shutil.rmtree(private, ignore_errors=True)
    return plain, first, warm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default=os.path.join(HERE, "example_suite"))
    parser.add_argument("--preload", default=DEMO_PRELOAD)
    parser.add_argument("--rounds", type=int, default=2, help="plain / first-call pairs")
    parser.add_argument("--warm", type=int, default=3, help="warm calls after the last first")
    args = parser.parse_args()
    suite = os.path.abspath(args.suite)
    pytest = [sys.executable, "-m", "pytest", suite, "-q", "-p", "no:cacheprovider"]
    print(f"suite {suite}, preload {args.preload}; load average {load()}", flush=True)
    plains, firsts, warm = [], [], []
    for i in range(args.rounds):
        plain, first, warm = one_round(pytest, args, suite, last=i == args.rounds - 1)
        plains.append(plain)
        firsts.append(first)
    print(f"median: plain {statistics.median(plains):.2f} s, first run {statistics.median(firsts):.2f}"
          f" s" + (f", warm {statistics.median(warm):.2f} s" if warm else "")
          + f"; load average {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
