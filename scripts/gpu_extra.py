"""Second GPU proof: pre-warmed children and the learned preload, in one short run.

1. a CUDA step (`python scripts/steps/torch_step.py`): cold forked child vs a pre-warmed one
   (CUDA context made ahead), medians of --reps;
2. learned preload: `scripts/steps/hf_step.py` (transformers & co.) through run() twice, with a
   fresh zygote in between; the step's own import time before and after learning;
3. torchrun GPT steps (1 GPU and all GPUs): cold agent vs a pre-warmed agent and ranks
   (``PRELOAD_LAUNCHER_PREWARM_CUDA=context``, and ``kernels`` with --kernels);
4. memstats: what a step observes of CUDA memory at its start and after a first matmul, as a
   plain subprocess, a cold forked child and pre-warmed children (context, kernels).

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
        results = {"cold": timed_runs(cold, cmd, reps)}
        for level in LEVELS:
            os.environ.update(PRELOAD_LAUNCHER_PREWARM="1", PRELOAD_LAUNCHER_PREWARM_RANKS=str(n),
                              PRELOAD_LAUNCHER_PREWARM_CUDA=level)
            warm = Launcher(BASE)
            warm.zygote_for(dict(os.environ))
            time.sleep(3)
            runs = []
            for _ in range(reps):
                runs += timed_runs(warm, cmd, 1)
                time.sleep(3)  # the next agent's ranks make their contexts off the critical path
            results[f"pre-warmed ({level})"] = runs
            print(f"   warm agents used ({level}): {warm.zygotes[0].request('status')['warm_served']}")
            warm.close()
        for name, runs in results.items():
            print(f"   {n} GPU(s), {name}: median {statistics.median(t for t, _ in runs):.3f} s "
                  f"(runs {[round(t, 3) for t, _ in runs]}), rc {[r.returncode for _, r in runs]}",
                  flush=True)
        for key in ("PRELOAD_LAUNCHER_PREWARM", "PRELOAD_LAUNCHER_PREWARM_RANKS",
                    "PRELOAD_LAUNCHER_PREWARM_CUDA"):
            os.environ.pop(key)
        cold.close()


def memstats():
    """A pre-warmed child must read as a fresh process: compare what steps observe."""
    import json
    import subprocess
    print("== memstats: CUDA memory as a step observes it ==", flush=True)
    cmd = [PY, os.path.join(STEPS, "memstats_step.py")]

    def observed(output):
        line = next((l for l in output.splitlines() if l.startswith("MEMSTATS ")), None)
        return json.loads(line.split(" ", 1)[1]) if line else output[-800:]

    seen = {"plain subprocess": observed(subprocess.run(cmd, capture_output=True, text=True).stdout)}
    cold = Launcher(BASE)
    seen["cold forked child"] = observed(cold.run(cmd, timeout=300).stdout)
    cold.close()
    for level in ("context", "kernels"):
        os.environ.update(PRELOAD_LAUNCHER_PREWARM="1", PRELOAD_LAUNCHER_PREWARM_CUDA=level)
        warm = Launcher(BASE)
        warm.zygote_for(dict(os.environ))
        time.sleep(4)
        seen[f"pre-warmed ({level})"] = observed(warm.run(cmd, timeout=300).stdout)
        served = warm.zygotes[0].request("status")["warm_served"]
        warm.close()
        seen[f"pre-warmed ({level})"]["warm_served"] = served
    for key in ("PRELOAD_LAUNCHER_PREWARM", "PRELOAD_LAUNCHER_PREWARM_CUDA"):
        os.environ.pop(key)
    reference = seen["plain subprocess"]
    for name, value in seen.items():
        if not isinstance(value, dict):
            print(f"   {name}: FAILED {value}")
            continue
        differs = {k: (value.get(k), reference.get(k)) for k in ("start", "after_first_matmul")
                   if value.get(k) != reference.get(k)}
        print(f"   {name}: {'same as plain' if not differs else 'DIFFERS ' + json.dumps(differs)}"
              f"{'; warm children used ' + str(value['warm_served']) if 'warm_served' in value else ''}",
              flush=True)
    print(f"   plain subprocess observed: {json.dumps(reference)}", flush=True)


LEVELS = ["context"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", choices=["prewarm", "learned", "torchrun", "memstats"])
    parser.add_argument("--kernels", action="store_true",
                        help="also time pre-warmed agents with PRELOAD_LAUNCHER_PREWARM_CUDA=kernels")
    args = parser.parse_args()
    if args.kernels:
        LEVELS.append("kernels")
    if args.only in (None, "memstats"):
        memstats()
    if args.only in (None, "prewarm"):
        prewarm(args.reps)
    if args.only in (None, "learned"):
        learned()
    if args.only in (None, "torchrun"):
        prewarm_torchrun(args.reps)
