"""Second GPU proof: pre-warmed children and the learned preload, in one short run.

1. a CUDA step (`python scripts/steps/torch_step.py`): cold forked child vs a pre-warmed one
   (CUDA context made ahead), medians of --reps;
2. learned preload: `scripts/steps/hf_step.py` (transformers & co.) through run() twice, with a
   fresh zygote in between; the step's own import time before and after learning;
3. torchrun GPT steps (1 GPU and all GPUs): cold agent vs a pre-warmed agent and ranks.

    python scripts/gpu_extra.py [--reps 3]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from preload_launcher import Launcher  # noqa: E402

PY = sys.executable
STEPS = os.path.join(HERE, "steps")
BASE = ["torch", "megatron.core"]


def timed_runs(launcher, cmd, reps):
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        r = launcher.run(cmd, timeout=300)
        out.append((time.perf_counter() - start, r))
    return out


def prewarm(reps):
    print("== pre-warmed children: CUDA tensor step ==", flush=True)
    cmd = [PY, os.path.join(STEPS, "torch_step.py")]
    cold = Launcher(BASE)
    cold.zygote_for(dict(os.environ))
    os.environ["PRELOAD_LAUNCHER_PREWARM"] = "1"
    warm = Launcher(BASE)
    warm.zygote_for(dict(os.environ))
    os.environ.pop("PRELOAD_LAUNCHER_PREWARM")
    time.sleep(2)  # the first warm child makes its context
    c = timed_runs(cold, cmd, reps)
    w = []
    for _ in range(reps):
        w += timed_runs(warm, cmd, 1)
        time.sleep(1.5)  # the next warm child makes its context off the critical path
    status = warm.zygotes[0].request("status")
    for name, runs in (("cold fork", c), ("pre-warmed", w)):
        print(f"   {name}: median {statistics.median(t for t, _ in runs):.3f} s "
              f"(runs {[round(t, 3) for t, _ in runs]}), rc {[r.returncode for _, r in runs]}, "
              f"{runs[-1][1].stdout.strip()}", flush=True)
    print(f"   warm children used: {status['warm_served']}; zygote driver clean: "
          f"{not status['driver_initialized']}", flush=True)
    cold.close()
    warm.close()


def learned():
    print("== learned preload: HF-style step, fresh zygote in between ==", flush=True)
    project = tempfile.mkdtemp(prefix="learn-project-")
    cmd = [PY, os.path.join(STEPS, "hf_step.py")]
    for attempt in (1, 2):
        launcher = Launcher(BASE, project=project)
        start = time.perf_counter()
        zygote = launcher.zygote_for(dict(os.environ))
        startup = time.perf_counter() - start
        t0 = time.perf_counter()
        r = launcher.run(cmd, timeout=300)
        wall = time.perf_counter() - t0
        info = zygote.status["preload"]["learned"]
        print(f"   zygote {attempt}: start-up {startup:.1f} s (learned: {info.get('loaded')} of "
              f"{info.get('listed')} modules in {info.get('seconds')} s); step {wall:.2f} s: "
              f"{r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.returncode}", flush=True)
        launcher.close()


def prewarm_torchrun(reps):
    """GPT steps under torchrun: cold agent + ranks vs a pre-warmed agent whose ranks made their
    CUDA contexts before the step arrived (one GPU, then all GPUs)."""
    import subprocess
    gpus = len([l for l in subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                          text=True).stdout.splitlines() if l.startswith("GPU ")])
    print("== pre-warmed torchrun agents: megatron-core GPT step ==", flush=True)
    for n in sorted({1, gpus}):
        cmd = [os.path.join(os.path.dirname(PY), "torchrun"), f"--nproc_per_node={n}",
               os.path.join(STEPS, "gpt_step.py")]
        cold = Launcher(BASE)
        cold.zygote_for(dict(os.environ))
        os.environ.update(PRELOAD_LAUNCHER_PREWARM="1", PRELOAD_LAUNCHER_PREWARM_RANKS=str(n))
        warm = Launcher(BASE)
        warm.zygote_for(dict(os.environ))
        time.sleep(3)
        c = timed_runs(cold, cmd, reps)
        w = []
        for _ in range(reps):
            w += timed_runs(warm, cmd, 1)
            time.sleep(3)  # the next agent's ranks make their contexts off the critical path
        served = warm.zygotes[0].request("status")["warm_served"]
        for name, runs in (("cold", c), ("pre-warmed", w)):
            print(f"   {n} GPU(s), {name}: median {statistics.median(t for t, _ in runs):.3f} s "
                  f"(runs {[round(t, 3) for t, _ in runs]}), rc {[r.returncode for _, r in runs]}",
                  flush=True)
        print(f"   warm agents used: {served}", flush=True)
        for key in ("PRELOAD_LAUNCHER_PREWARM", "PRELOAD_LAUNCHER_PREWARM_RANKS"):
            os.environ.pop(key)
        cold.close()
        warm.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", choices=["prewarm", "learned", "torchrun"])
    args = parser.parse_args()
    if args.only in (None, "prewarm"):
        prewarm(args.reps)
    if args.only in (None, "learned"):
        learned()
    if args.only in (None, "torchrun"):
        prewarm_torchrun(args.reps)
