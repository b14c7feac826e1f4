"""A training example's launch script (bash → accelerate launch → a transformers training loop),
as a plain subprocess and through the launcher, from an empty launcher cache.

    python3 scripts/gpu/shell_steps.py [--reps 3] [--nproc 1] [--precision bf16]

The launcher sees `bash`, which it cannot serve: the script runs as a subprocess with stand-ins
for python/torchrun/accelerate first on its PATH, so `accelerate launch` and the training
program are forked from the zygote. The first launcher run includes the zygote's start (its
preload) from an empty cache; the rest are medians of warm runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from preload_launcher import Launcher  # noqa: E402

SCRIPT = ["bash", os.path.join(ROOT, "scripts", "steps", "launch_train.sh")]
MODULES = ["torch", "transformers", "accelerate"]


def timed(run) -> tuple[float, str]:
    start = time.perf_counter()
    output = run()
    return time.perf_counter() - start, output


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nproc", default="1")
    parser.add_argument("--precision", default="bf16")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="shell-steps-")
    env = dict(os.environ, NPROC=args.nproc, PRECISION=args.precision,
               HF_HOME=os.path.join(scratch, "hf"),  # no accelerate config file decides
               PRELOAD_LAUNCHER_CACHE_DIR=os.path.join(scratch, "cache"))  # empty cache
    os.environ.update(env)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {os.uname().nodename}, Python "
          f"{sys.version.split()[0]}; preload {','.join(MODULES)}; empty launcher cache; "
          f"{' '.join(SCRIPT)} (NPROC={args.nproc}, PRECISION={args.precision})", flush=True)
    plain = []
    for rep in range(args.reps):
        seconds, out = timed(lambda: subprocess.run(SCRIPT, env=env, check=True, text=True,
                                                    stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT).stdout)
        plain.append(seconds)
        print(f"plain subprocess {rep + 1}: {seconds:.2f} s | {out.strip().splitlines()[-1]}",
              flush=True)
    launcher = Launcher(MODULES)
    through = []
    try:
        for rep in range(args.reps + 1):
            seconds, result = timed(lambda: launcher.run(SCRIPT, env=env, check=True))
            through.append(seconds)
            label = "first (zygote start, empty cache)" if rep == 0 else f"warm {rep}"
            print(f"launcher {label}: {seconds:.2f} s | {result.stdout.strip().splitlines()[-1]}",
                  flush=True)
        forked = launcher.standin_steps()
    finally:
        launcher.close()
    median_plain, median_warm = statistics.median(plain), statistics.median(through[1:])
    print(f"RESULT plain median {median_plain:.2f} s; launcher first {through[0]:.2f} s, warm "
          f"median {median_warm:.2f} s ({median_plain / median_warm:.1f}x); interpreters "
          f"forked through stand-ins: {forked}", flush=True)


if __name__ == "__main__":
    main()
