"""A worker pool's start: N spawned gloo ranks importing a suite's heavy chain, started fresh for
each of three tests, with the launcher on (steps only) and suite-wide (the pool's ranks forked).

    python scripts/bench_pool.py [--imports torch,megatron.core,modelopt.torch] [--ranks 2]

Each pytest session runs in its own empty cache; prints each pool's start and the sessions'
wall time.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time

SUITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pool_suite")


def session(mode: str, imports: str, ranks: int) -> tuple[float, list[str], str]:
    scratch = tempfile.mkdtemp(prefix="pl-bench-pool-")
    out = os.path.join(scratch, "pools.txt")
    env = dict(os.environ, PRELOAD_LAUNCHER=mode, PRELOAD_LAUNCHER_MODULES=imports,
               POOL_SUITE_IMPORTS=imports, POOL_SUITE_RANKS=str(ranks), POOL_SUITE_OUT=out,
               PRELOAD_LAUNCHER_CACHE_DIR=os.path.join(scratch, "cache"))
    # Where the package is on PYTHONPATH rather than installed, its plugin by name.
    installed = any(ep.name == "preload_launcher"
                    for ep in importlib.metadata.entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "preload_launcher.pytest_plugin"]
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *plugin, SUITE], env=env, text=True, capture_output=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"{mode}: pytest failed\n{done.stdout}\n{done.stderr}")
        with open(out) as f:
            pools = f.read().split()[1::2]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = [line for line in done.stdout.splitlines() if "suite-wide" in line or "passed" in line]
    return wall, pools, " | ".join(summary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imports", default="torch,megatron.core,modelopt.torch")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    for mode, what in (("1", "launcher on, pools spawned plainly"),
                       ("suite", "suite-wide, pools' ranks forked")):
        wall, pools, summary = session(mode, args.imports, args.ranks)
        print(f"{what}: pool starts {', '.join(pools)} s; session {wall:.1f} s ({summary})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
