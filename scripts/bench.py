"""Times the same steps four ways in one run: plain subprocess/torchrun, the launcher, the
launcher with pre-warmed children, and an in-process baseline (each step re-run with runpy in
one long-lived process per rank, as an in-process test runner does).

    python scripts/bench.py                 # CPU or GPU picked automatically
    python scripts/bench.py --steps 9 --json out.json --scaling

Prints per-step medians, the ratio subprocess/launcher, the zygote's preload time (paid once),
its RSS and a running step's PSS, and the launcher's own overhead: request -> first line of
user code in the forked child. --scaling adds an all-reduce step at 1, 2, 4, 8 ranks (CPU) or
1..N GPUs, launcher against torchrun.
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


def time_inprocess(cmd: list[str], reps: int) -> list[float]:
    """Run the step reps times inside one process (per rank); the first run pays the imports."""
    worker = os.path.join(HERE, "inprocess_worker.py")
    script = cmd[-1]
    prefix = cmd[:-1] if cmd[0] == TORCHRUN else [PY]
    out = subprocess.run(prefix + [worker, script, str(reps + 1)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    line = next((l for l in out.stdout.splitlines() if l.startswith("INPROCESS ")), None)
    if out.returncode or line is None:
        return []
    return json.loads(line.split(" ", 1)[1])[1:]  # steady state: without the importing run


def step_pss_mib(launcher: Launcher, cmd: list[str]) -> float:
    """PSS of a running step (and its ranks), sampled from the zygote's status mid-step."""
    import threading
    probe = [PY, "-c", "import time, torch; time.sleep(1.5)"]
    t = threading.Thread(target=launcher.run, args=(probe,))
    t.start()
    time.sleep(0.8)
    pss = launcher.zygotes[0].request("status")["steps_pss_kb"] / 1024
    t.join()
    return pss


def scaling(launcher: Launcher, gpus: int, reps: int) -> list[dict]:
    ranks = [n for n in (1, 2, 4, 8) if not gpus or n <= gpus]
    rows = []
    print(f"\n{'all-reduce step, ranks':28} {'torchrun':>9} {'launcher':>9} {'ratio':>7} {'overhead':>9}")
    for n in ranks:
        cmd = [TORCHRUN, f"--nproc_per_node={n}", os.path.join(STEPS, "allreduce_step.py")]
        sub = [time_subprocess(cmd) for _ in range(reps)]
        ours = [time_launcher(launcher, cmd) for _ in range(reps)]
        row = {"ranks": n, "torchrun_s": statistics.median(sub),
               "launcher_s": statistics.median(t for t, _ in ours),
               "overhead_ms": 1000 * statistics.median(d for _, d in ours)}
        rows.append(row)
        print(f"{n:28d} {row['torchrun_s']:8.2f}s {row['launcher_s']:8.3f}s "
              f"{row['torchrun_s'] / row['launcher_s']:6.1f}x {row['overhead_ms']:7.1f}ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="runs of each step each way")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--scaling", action="store_true", help="also scale ranks 1..8")
    parser.add_argument("--only", default="", help="run only steps whose name contains this")
    parser.add_argument("--preload", default=",".join(STACK), help="the zygote's preload list")
    args = parser.parse_args()
    gpus = gpu_count()
    machine = f"{platform.node()}: {os.cpu_count()} CPUs, {gpus} GPUs, Python {platform.python_version()}"
    print(f"# preload_launcher benchmark on {machine}; {args.steps} runs per step and way")

    stack = args.preload.split(",")
    launcher = Launcher(stack)
    start = time.perf_counter()
    zygote = launcher.zygote_for(dict(os.environ))
    preload_s = time.perf_counter() - start
    report = zygote.status["preload"]
    os.environ["PRELOAD_LAUNCHER_PREWARM"] = "1"
    warm = Launcher(stack)
    warm.zygote_for(dict(os.environ))
    os.environ.pop("PRELOAD_LAUNCHER_PREWARM")
    print(f"# zygote preload of {','.join(report['loaded'])}: {preload_s:.1f} s (paid once), "
          f"RSS {zygote.status['rss_kb'] / 1024:.0f} MiB; a running torch step's PSS: "
          f"{step_pss_mib(launcher, []):.0f} MiB\n")

    rows = []
    header = (f"{'step':50} {'subprocess':>10} {'launcher':>9} {'prewarm':>8} {'in-proc':>8} "
              f"{'ratio':>6} {'overhead':>8}")
    print(header)
    print("-" * len(header))
    for name, cmd in workloads(gpus):
        if args.only not in name:
            continue
        sub = [time_subprocess(cmd) for _ in range(args.steps)]
        ours = [time_launcher(launcher, cmd) for _ in range(args.steps)]
        warmed = [time_launcher(warm, cmd) for _ in range(args.steps)]
        inproc = time_inprocess(cmd, args.steps)
        row = {"step": name, "subprocess_s": statistics.median(sub),
               "launcher_s": statistics.median(t for t, _ in ours),
               "prewarm_s": statistics.median(t for t, _ in warmed),
               "inprocess_s": statistics.median(inproc) if inproc else None,
               "overhead_ms": 1000 * statistics.median(d for _, d in ours),
               "subprocess_runs": sub, "launcher_runs": [t for t, _ in ours],
               "prewarm_runs": [t for t, _ in warmed], "inprocess_runs": inproc}
        row["ratio"] = row["subprocess_s"] / row["launcher_s"]
        rows.append(row)
        inproc_text = f"{row['inprocess_s']:7.3f}s" if inproc else "   fails"
        print(f"{name:50} {row['subprocess_s']:9.2f}s {row['launcher_s']:8.3f}s "
              f"{row['prewarm_s']:7.3f}s {inproc_text} {row['ratio']:5.1f}x "
              f"{row['overhead_ms']:6.1f}ms", flush=True)
    print("\noverhead = request sent -> first line of user code in the child (medians); "
          "in-proc = steady-state re-runs in one process, no isolation")
    scale = scaling(launcher, gpus, max(2, args.steps // 2)) if args.scaling else []
    launcher.close()
    warm.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "date": time.strftime("%Y-%m-%d"), "preload_s": preload_s,
                       "rows": rows, "scaling": scale}, f, indent=1)


if __name__ == "__main__":
    main()
