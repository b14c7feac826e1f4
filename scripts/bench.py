"""Times the same steps as plain subprocesses and through the launcher, in one run.

    python scripts/bench.py                 # CPU or GPU picked automatically
    python scripts/bench.py --steps 9 --json out.json

Prints per-step medians for both ways, their ratio, the zygote's preload time (paid once) and
the launcher's own overhead: request -> first line of user code in the forked child.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from preload_launcher import Launcher  # noqa: E402

STEPS = os.path.join(HERE, "steps")
PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
STACK = ["torch", "megatron.core", "modelopt.torch"]


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return len([l for l in out.stdout.splitlines() if l.startswith("GPU ")])
    except (OSError, subprocess.SubprocessError):
        return 0


def workloads(gpus: int) -> list[tuple[str, list[str]]]:
    step = lambda name: os.path.join(STEPS, name)  # noqa: E731
    tests = os.path.join(os.path.dirname(HERE), "tests", "programs")
    work = [("import torch + matmul (1 rank)", [PY, step("torch_step.py")]),
            ("import torch+megatron.core+modelopt.torch (1 rank)", [PY, step("stack_step.py")])]
    if gpus:
        work.append(("megatron-core GPT fwd+bwd (1 GPU)",
                     [TORCHRUN, "--nproc_per_node=1", step("gpt_step.py")]))
        if gpus > 1:
            work.append((f"megatron-core GPT TP={gpus} (NCCL)",
                         [TORCHRUN, f"--nproc_per_node={gpus}", step("gpt_step.py")]))
    else:
        work.append(("megatron parallel state, 2 gloo ranks",
                     [TORCHRUN, "--nproc_per_node=2",
                      os.path.join(tests, "megatron_parallel_state.py")]))
    return work


def time_subprocess(args: list[str]) -> float:
    start = time.perf_counter()
    out = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    elapsed = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"subprocess step failed: {args}\n{out.stdout[-3000:]}")
    return elapsed


def time_launcher(launcher: Launcher, args: list[str]) -> tuple[float, float]:
    start = time.perf_counter()
    result = launcher.run(args)
    elapsed = time.perf_counter() - start
    if result.returncode or result.via != "zygote":
        raise SystemExit(f"launcher step failed ({result.via} {result.reason}): {args}\n"
                         f"{result.stdout[-3000:]}")
    return elapsed, result.exec_delay_s or 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="runs of each step each way")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    gpus = gpu_count()
    machine = f"{platform.node()}: {os.cpu_count()} CPUs, {gpus} GPUs, Python {platform.python_version()}"
    print(f"# preload_launcher benchmark on {machine}; {args.steps} runs per step and way")

    launcher = Launcher(STACK)
    start = time.perf_counter()
    zygote = launcher.zygote_for(dict(os.environ))
    preload_s = time.perf_counter() - start
    report = zygote.status["preload"]
    print(f"# zygote preload of {','.join(report['loaded'])}: {preload_s:.1f} s (paid once), "
          f"RSS {zygote.status['rss_kb'] / 1024:.0f} MiB\n")

    rows = []
    header = f"{'step':52} {'subprocess':>11} {'launcher':>9} {'ratio':>7} {'overhead':>9}"
    print(header)
    print("-" * len(header))
    for name, cmd in workloads(gpus):
        sub = [time_subprocess(cmd) for _ in range(args.steps)]
        ours = [time_launcher(launcher, cmd) for _ in range(args.steps)]
        row = {"step": name, "subprocess_s": statistics.median(sub),
               "launcher_s": statistics.median(t for t, _ in ours),
               "overhead_ms": 1000 * statistics.median(d for _, d in ours),
               "subprocess_runs": sub, "launcher_runs": [t for t, _ in ours]}
        row["ratio"] = row["subprocess_s"] / row["launcher_s"]
        rows.append(row)
        print(f"{name:52} {row['subprocess_s']:10.2f}s {row['launcher_s']:8.3f}s "
              f"{row['ratio']:6.1f}x {row['overhead_ms']:7.1f}ms", flush=True)
    print("\noverhead = request sent -> first line of user code in the child (medians)")
    launcher.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "date": time.strftime("%Y-%m-%d"), "preload_s": preload_s,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
