"""megatron-bridge on a GPU machine with Transformer Engine: the doctor for the full default-like
preload from an empty cache, then an AutoBridge step (scripts/steps/bridge_step.py) through the
launcher and under torchrun.

    PYTHONPATH=/tmp/te-site:$PYTHONPATH python3 scripts/gpu/bridge.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from preload_launcher import Launcher  # noqa: E402
from preload_launcher.front.reporting import format_doctor  # noqa: E402

MODULES = ["torch", "transformer_engine.pytorch", "megatron.core", "megatron.bridge", "modelopt.torch"]
STEP = [shutil.which("torchrun") or "torchrun", "--nproc_per_node=1",
        os.path.join(ROOT, "scripts", "steps", "bridge_step.py")]


def tail(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if "bridge step" in line or "Error" in line]
    return (lines or text.strip().splitlines() or [""])[-1][:300]


def main() -> None:
    os.environ["PRELOAD_LAUNCHER_CACHE_DIR"] = tempfile.mkdtemp(prefix="bridge-cache-")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {os.uname().nodename}; empty launcher cache",
          flush=True)
    launcher = Launcher(MODULES)
    try:
        for label in ("first (zygote start, empty cache)", "warm"):
            start = time.perf_counter()
            result = launcher.run(STEP)
            print(f"launcher {label}: {time.perf_counter() - start:.2f} s via {result.via} "
                  f"rc {result.returncode} | {tail(result.stdout)}", flush=True)
            if result.returncode:
                print("\n".join(result.stdout.strip().splitlines()[-25:]), flush=True)
            if label.startswith("first"):
                print(format_doctor(launcher.zygotes[0].status), flush=True)
    finally:
        launcher.close()
    start = time.perf_counter()
    out = subprocess.run(STEP, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT).stdout
    print(f"torchrun: {time.perf_counter() - start:.2f} s | {tail(out)}", flush=True)


if __name__ == "__main__":
    main()
