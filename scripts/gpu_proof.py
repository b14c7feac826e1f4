"""Proves the CUDA behaviour on a real GPU machine, in one run:

1. the preload list torch,megatron.core,modelopt.torch,modelopt.torch.quantization ends in a
   clean zygote, with any driver-initialising import (torch_geometric on the H200 image) named
   and quarantined, as `preload-launcher doctor` prints it; a second start hits the verdict cache;
2. forked children run a CUDA tensor step, a megatron-core GPT step and a modelopt mtq.quantize
   call on the GPU, and the zygote is still driver-clean afterwards;
3. with 2+ GPUs: an NCCL all-reduce and a TP=2 megatron-core GPT step through
   run(["torchrun", "--nproc_per_node=2", ...]) against the real torchrun in the same run, and a
   failing rank that takes its sibling down.

    python scripts/gpu_proof.py [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from preload_launcher import Launcher, ZygoteProcess  # noqa: E402
from preload_launcher.front.reporting import format_doctor  # noqa: E402

STEPS = os.path.join(HERE, "steps")
PROGRAMS = os.path.join(os.path.dirname(HERE), "tests", "programs")
PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
MODULES = ["torch", "megatron.core", "modelopt.torch", "modelopt.torch.quantization"]
results: dict = {"checks": []}


def check(name: str, ok: bool, detail: str = "") -> None:
    results["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
    print(f"[{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True)


def gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    except OSError:
        return 0
    print(out.stdout.strip())
    return len([l for l in out.stdout.splitlines() if l.startswith("GPU ")])


def preload_and_doctor() -> None:
    print("\n== 1. preload under CUDA-safe rules ==", flush=True)
    start = time.perf_counter()
    z = ZygoteProcess(MODULES, os.environ).start()
    first = time.perf_counter() - start
    print(format_doctor(z.status))
    z.close()
    report = z.status["preload"]
    results["doctor"] = z.status
    check("zygote is driver-clean after preload", not z.status["driver_initialized"]
          and not z.status["torch_cuda_initialized"])
    verdicts = {**report["quarantined"], **report.get("deferred", {})}
    culprits = {e: v["culprit"] for e, v in verdicts.items()}
    chains = [" -> ".join(v["chain"]) for v in verdicts.values()]
    import importlib.util
    check("driver-initialising import named, and deferred or quarantined (torch_geometric on the "
          "H200 image)", any("torch_geometric" in c for c in chains)
          or importlib.util.find_spec("torch_geometric") is None, json.dumps(culprits))
    start = time.perf_counter()
    z2 = ZygoteProcess(MODULES, os.environ).start()
    second = time.perf_counter() - start
    z2.close()
    check("second start reuses the cached verdict",
          z2.status["preload"]["quarantined"] == report["quarantined"]
          and z2.status["preload"].get("deferred") == report.get("deferred")
          and second < first, f"first start {first:.1f} s, second {second:.1f} s")


def single_gpu_children(launcher: Launcher) -> None:
    print("\n== 2. forked children use the GPU ==", flush=True)
    for name, cmd in [("CUDA tensor step", [PY, os.path.join(STEPS, "torch_step.py")]),
                      ("modelopt mtq.quantize (FP8)", [PY, os.path.join(STEPS, "quantize_step.py")])]:
        start = time.perf_counter()
        r = launcher.run(cmd, timeout=300)
        elapsed = time.perf_counter() - start
        tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        check(f"{name} in a forked child", r.returncode == 0 and r.via == "zygote",
              f"{elapsed:.2f} s, via {r.via}, rc {r.returncode}: {tail[:160]}")
        if r.returncode:
            print(r.stdout[-4000:])
    status = launcher.zygotes[0].request("status")
    check("zygote still driver-clean after serving GPU steps",
          not status["driver_initialized"] and not status["torch_cuda_initialized"],
          f"served {status['served']}")


def timed(fn, reps):
    times, last = [], None
    for _ in range(reps):
        start = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - start)
    return times, last


def multi_gpu(launcher: Launcher, n: int, reps: int) -> None:
    print(f"\n== 3. torchrun steps (1 and {n} GPUs): forked siblings vs real torchrun ==", flush=True)
    rows = []
    for name, script, ranks in [("megatron-core GPT fwd+bwd, 1 GPU", "gpt_step.py", 1),
                                (f"CUDA tensor + NCCL all-reduce, {n} GPUs", "allreduce_step.py", n),
                                (f"megatron-core GPT, TP={n}, NCCL", "gpt_step.py", n)]:
        cmd = [TORCHRUN, f"--nproc_per_node={ranks}", os.path.join(STEPS, script)]
        ours, r = timed(lambda: launcher.run(cmd, timeout=300), reps)
        check(f"{name} through run(torchrun)", r.returncode == 0 and r.via == "zygote",
              f"rc {r.returncode} via {r.via}")
        if r.returncode:
            print(r.stdout[-4000:])
        theirs, p = timed(lambda: subprocess.run(cmd, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True), reps)
        check(f"{name} under real torchrun", p.returncode == 0)
        row = {"step": name, "ranks": ranks, "torchrun_s": theirs, "launcher_s": ours,
               "ratio": statistics.median(theirs) / statistics.median(ours)}
        rows.append(row)
        print(f"   {name}: torchrun {statistics.median(theirs):.2f} s, launcher "
              f"{statistics.median(ours):.2f} s, {row['ratio']:.1f}x "
              f"(runs: {[round(t, 2) for t in theirs]} vs {[round(t, 2) for t in ours]})", flush=True)
    results["multi_gpu"] = rows
    # Two ranks even on one GPU: the failing rank fails before touching NCCL.
    fail = [TORCHRUN, f"--nproc_per_node={max(n, 2)}", os.path.join(PROGRAMS, "megatron_style.py"),
            "--fail-rank", "1"]
    env = dict(os.environ)
    r = launcher.run(fail, env=env, timeout=300)
    check("failing rank ends the step with torchrun's summary",
          r.returncode == 1 and "ChildFailedError" in r.stdout and "rank 1 failed on purpose" in r.stdout,
          f"rc {r.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    n = gpus()
    preload_and_doctor()
    launcher = Launcher(MODULES)
    try:
        single_gpu_children(launcher)
        if n >= 1:
            multi_gpu(launcher, n, args.reps)
    finally:
        launcher.close()
    ok = all(c["ok"] for c in results["checks"])
    print(f"\n{sum(c['ok'] for c in results['checks'])} passed, "
          f"{sum(not c['ok'] for c in results['checks'])} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
