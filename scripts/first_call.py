"""The first call of a session from an empty launcher cache (no verdicts, no profile: scouts
run where culprits can be seen) against the first call with the cache that run left (warm).

Each call runs in a fresh interpreter: ``Launcher(modules).run(step)`` from creating the
launcher to the step's result, as a session's first test sees it.

    python scripts/first_call.py                           # torch,megatron.core,modelopt.torch
    python scripts/first_call.py --preload torch --runs 5 --probe fake   # scouts on a CPU box

Prints each run and the medians; the goal is empty/warm <= 1.25. With ``--plain``, each run also
times a plain ``import`` of the same modules in a fresh interpreter, beside the preload's own
seconds (the zygote's report), so what scouting adds to a preload is seen apart from the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ONE_CALL = """
import json, sys, time
start = time.perf_counter()
from preload_launcher import Launcher
launcher = Launcher(sys.argv[1].split(","))
try:
    result = launcher.run([sys.executable, "-c", sys.argv[2]])
    elapsed = time.perf_counter() - start
    report = launcher.zygotes[-1].status.get("preload", {})
finally:
    launcher.close()
print(json.dumps({"seconds": elapsed, "preload_s": report.get("seconds"),
                  "via": result.via, "reason": result.reason,
                  "returncode": result.returncode, "loaded": report.get("loaded"),
                  "deferred": sorted(report.get("deferred", {})),
                  "quarantined": sorted(report.get("quarantined", {}))}))
"""


def one_call(modules: str, step: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", ONE_CALL, modules, step], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if done.returncode != 0:
        sys.exit(f"the call failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


PLAIN_IMPORT = """
import importlib, sys, time
start = time.perf_counter()
for module in sys.argv[1].split(","):
    importlib.import_module(module)
print(time.perf_counter() - start)
"""


def plain_import(modules: str, env: dict) -> float:
    done = subprocess.run([sys.executable, "-c", PLAIN_IMPORT, modules], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if done.returncode != 0:
        sys.exit(f"the plain import failed:\n{done.stderr}")
    return float(done.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preload", default="torch,megatron.core,modelopt.torch")
    parser.add_argument("--step", default="pass", help="the step's python -c code")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--probe", default=None, help="PRELOAD_LAUNCHER_PROBE (fake: scouts "
                        "run on a machine without GPUs)")
    parser.add_argument("--plain", action="store_true", help="also time a plain import of the "
                        "modules each run")
    args = parser.parse_args()
    empty, warm, plain, preloads = [], [], [], {"empty": [], "warm": []}
    for run in range(args.runs):
        cache = tempfile.mkdtemp(prefix="pl-first-call-")
        env = dict(os.environ, PRELOAD_LAUNCHER_CACHE_DIR=cache, PRELOAD_LAUNCHER_AUTOSERVE="0")
        env.pop("PRELOAD_LAUNCHER_PROFILE", None)
        if args.probe:
            env["PRELOAD_LAUNCHER_PROBE"] = args.probe
        try:
            cold = one_call(args.preload, args.step, env)
            hot = one_call(args.preload, args.step, env)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        empty.append(cold["seconds"])
        warm.append(hot["seconds"])
        preloads["empty"].append(cold["preload_s"])
        preloads["warm"].append(hot["preload_s"])
        also = ""
        if args.plain:
            plain.append(plain_import(args.preload, env))
            also = (f"; preload itself {cold['preload_s']:.2f} / {hot['preload_s']:.2f} s, "
                    f"plain import {plain[-1]:.2f} s")
        print(f"run {run + 1}: empty cache {cold['seconds']:.2f} s ({cold['via']}), warm "
              f"{hot['seconds']:.2f} s ({hot['via']}){also}; loaded {cold['loaded']}, deferred "
              f"{cold['deferred']}, quarantined {cold['quarantined']}", flush=True)
    ratio = statistics.median(empty) / statistics.median(warm)
    print(f"median: empty cache {statistics.median(empty):.2f} s, warm "
          f"{statistics.median(warm):.2f} s, ratio {ratio:.2f}x (goal <= 1.25x)")
    if args.plain:
        print(f"median preload itself: empty cache {statistics.median(preloads['empty']):.2f} s, "
              f"warm {statistics.median(preloads['warm']):.2f} s; plain import "
              f"{statistics.median(plain):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
