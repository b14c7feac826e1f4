"""Transformer Engine on a GPU machine: what the preload does with it, and a megatron-core GPT
step whose layers come from TE (``get_gpt_layer_with_transformer_engine_spec``), under torchrun
and through the launcher, from an empty launcher cache.

    PYTHONPATH=/tmp/te-site:$PYTHONPATH python3 scripts/gpu/te_gpt.py [--reps 2]

(scripts/gpu/transformer_engine.sh installs TE there on the H200 machine.)
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
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from preload_launcher import Launcher  # noqa: E402
from preload_launcher.front.reporting import format_doctor  # noqa: E402

MODULES = ["torch", "transformer_engine.pytorch", "megatron.core", "modelopt.torch"]
TORCHRUN = shutil.which("torchrun") or "torchrun"
GPT_STEP = os.path.join(ROOT, "scripts", "steps", "gpt_step.py")


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if "gpt loss" in line or "Error" in line]
    return (lines or text.strip().splitlines() or [""])[-1][:200]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1, help="ranks (tensor parallel size)")
    args = parser.parse_args()
    global STEP
    STEP = [TORCHRUN, f"--nproc_per_node={args.nproc}", GPT_STEP]
    scratch = tempfile.mkdtemp(prefix="te-gpt-")
    env = dict(os.environ, GPT_SPEC="te", PRELOAD_LAUNCHER_CACHE_DIR=os.path.join(scratch, "cache"))
    os.environ.update(env)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {os.uname().nodename}, Python "
          f"{sys.version.split()[0]}; empty launcher cache", flush=True)
    launcher = Launcher(MODULES)
    try:
        seconds, first = timed(lambda: launcher.run(STEP, env=env))
        print(format_doctor(launcher.zygotes[0].status), flush=True)
        print(f"launcher first (zygote start, empty cache): {seconds:.2f} s, via {first.via} "
              f"{first.reason} | {last_line(first.stdout)}", flush=True)
        warm = []
        for rep in range(args.reps):
            seconds, result = timed(lambda: launcher.run(STEP, env=env))
            warm.append(seconds)
            print(f"launcher warm {rep + 1}: {seconds:.2f} s via {result.via} | "
                  f"{last_line(result.stdout)}", flush=True)
    finally:
        launcher.close()
    plain = []
    for rep in range(args.reps):
        seconds, out = timed(lambda: subprocess.run(STEP, env=env, text=True, stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT).stdout)
        plain.append(seconds)
        print(f"torchrun {rep + 1}: {seconds:.2f} s | {last_line(out)}", flush=True)
    print(f"RESULT TE-spec GPT step, {args.nproc} GPU(s): torchrun median {statistics.median(plain):.2f} s; "
          f"launcher warm median {statistics.median(warm):.2f} s "
          f"({statistics.median(plain) / statistics.median(warm):.1f}x)", flush=True)


if __name__ == "__main__":
    main()
