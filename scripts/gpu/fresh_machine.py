"""The users' CI on a GPU machine: an empty cache, modelopt's torch_geometric plugin installed.

Prints, in one run (all from an empty launcher cache unless a line says otherwise):
1. ``doctor`` for the preload list below: modelopt.torch and modelopt.torch.quantization
   preloaded, torch_geometric deferred (its guarded plugin import replayed in steps), the
   driver clean; how many times the zygote restarted to get there;
2. the first ``run()`` (zygote start + a CUDA step) from an empty cache, from the warm cache the
   first call left, and from an empty cache with a portable profile written by the first;
3. a step that quantizes a torch_geometric model: QuantModuleRegistry holds PyG's Linear, as in
   a fresh interpreter (lazy and eager replay);
4. the six-step GPT suite (scripts/steps/gpt_suite.py) against torchrun, from an empty cache,
   through scripts/bench.py (modelopt's CUDA extension is built once, untimed, first: --prime).

    python3 scripts/gpu/fresh_machine.py [--suite-reps 2] [--subprocess-reps 1] [--skip-suite]
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from preload_launcher import Launcher  # noqa: E402
from preload_launcher.front.reporting import format_doctor  # noqa: E402

PY = sys.executable
MODULES = ["torch", "megatron.core", "megatron.core.models.gpt", "modelopt.torch",
           "modelopt.torch.quantization"]
CUDA_STEP = [PY, os.path.join(ROOT, "scripts", "steps", "torch_step.py")]
PYG_STEP = [PY, "-c", """
import torch, torch_geometric.nn
import modelopt.torch.quantization as mtq
from modelopt.torch.quantization.nn import QuantModuleRegistry
pyg = [k for k in QuantModuleRegistry._registry if 'torch_geometric' in str(k)]
print('PyG types in QuantModuleRegistry:', len(pyg), [getattr(k, '__name__', k) for k in pyg])
model = torch.nn.Sequential(torch_geometric.nn.Linear(16, 16)).cuda()
mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(4, 16, device='cuda')))
print('quantized:', type(model[0]).__name__)
"""]
checks: list[tuple[str, bool]] = []


def check(name: str, ok: bool) -> None:
    checks.append((name, ok))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}", flush=True)


def first_call(env: dict, label: str) -> tuple[float, Launcher]:
    """A new launcher's first run(): zygote start (preload) + one CUDA step."""
    os.environ.update(env)
    launcher = Launcher(MODULES)
    start = time.perf_counter()
    result = launcher.run(CUDA_STEP, env=env)
    seconds = time.perf_counter() - start
    print(f"first run() {label}: {seconds:.1f} s (via {result.via}; {result.stdout.strip()})",
          flush=True)
    return seconds, launcher


def restarts(launcher: Launcher) -> int:
    with open(launcher.zygotes[0].log_path) as f:
        return f.read().count("restarting without it")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite-reps", type=int, default=2)
    parser.add_argument("--subprocess-reps", type=int, default=1)
    parser.add_argument("--skip-suite", action="store_true")
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {os.uname().nodename}, Python "
          f"{sys.version.split()[0]}", flush=True)
    base = dict(os.environ)
    cache = tempfile.mkdtemp(prefix="pl-empty-cache-")
    env = dict(base, PRELOAD_LAUNCHER_CACHE_DIR=cache)

    fresh_s, launcher = first_call(env, "from an empty cache")
    status = launcher.zygotes[0].status
    print("\n" + format_doctor(status) + "\n", flush=True)
    report = status["preload"]
    check("modelopt.torch and modelopt.torch.quantization preloaded",
          {"modelopt.torch", "modelopt.torch.quantization"} <= set(report["loaded"]))
    check("torch_geometric deferred", "torch_geometric" in report.get("deferred", {}))
    check("zygote driver clean", not status["driver_initialized"])
    check(f"one restart to find the culprit (found {restarts(launcher)})", restarts(launcher) <= 1)
    for mode in ("lazy", "eager"):
        out = launcher.run(PYG_STEP, env=dict(env, PRELOAD_LAUNCHER_DEFERRED=mode), timeout=300)
        print(out.stdout.strip())
        check(f"PyG Linear registered and quantized in a step ({mode} replay)",
              out.returncode == 0 and "PyG types in QuantModuleRegistry: 0" not in out.stdout)
    plain = subprocess.run(PYG_STEP, env=env, capture_output=True, text=True)
    print("fresh interpreter:", plain.stdout.strip())
    check("the same registry as a fresh interpreter",
          plain.stdout.splitlines()[:1] == out.stdout.splitlines()[:1])
    launcher.close()

    warm_s, warm = first_call(env, "from the warm cache (the first call's)")
    warm.close()
    profile = os.path.join(cache, "profile.json")
    subprocess.run([PY, "-m", "preload_launcher.cli", "profile", "--write", profile], env=env,
                   check=True)
    profiled_s, profiled = first_call(dict(base, PRELOAD_LAUNCHER_CACHE_DIR=tempfile.mkdtemp(),
                                           PRELOAD_LAUNCHER_PROFILE=profile),
                                      "from an empty cache with that profile")
    check(f"profile start: no restart (found {restarts(profiled)})", restarts(profiled) == 0)
    profiled.close()
    print(f"\nfirst call: empty cache {fresh_s:.1f} s = {fresh_s / warm_s:.2f} x warm "
          f"({warm_s:.1f} s); empty cache + profile {profiled_s:.1f} s = "
          f"{profiled_s / warm_s:.2f} x warm\n", flush=True)
    check("empty-cache first call <= 1.25 x warm", fresh_s <= 1.25 * warm_s)

    if not args.skip_suite:
        suite_env = dict(base, PRELOAD_LAUNCHER_CACHE_DIR=tempfile.mkdtemp(prefix="pl-suite-"))
        subprocess.run([PY, os.path.join(ROOT, "scripts", "bench.py"), "--sections", "suite",
                        "--suite-ranks", "1", "--suite-reps", str(args.suite_reps),
                        "--subprocess-reps", str(args.subprocess_reps), "--ways",
                        "subprocess,launcher", "--preload", ",".join(MODULES), "--prime",
                        "--json", os.path.join(os.environ.get("OUT", "/tmp"), "suite.json")],
                       env=suite_env, check=False)
    runtime = glob.glob(f"/tmp/preload_launcher-{os.getuid()}/z-*.log")
    print(f"\nzygote logs left in the runtime directory: {len(runtime)}")
    print(f"\n{sum(ok for _, ok in checks)}/{len(checks)} checks passed")


if __name__ == "__main__":
    main()
