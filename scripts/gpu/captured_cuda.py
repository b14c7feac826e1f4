"""Device queries a preloaded module kept from its import behave as torch's own in a forked step,
and torch.compile runs there (inductor's ``is_big_gpu`` reads ``multi_processor_count`` through
the ``get_device_properties`` torch's device interface bound while the zygote preloaded).

    python3 scripts/gpu/captured_cuda.py [--modules torch,torch._dynamo,megatron.core]

A module preloaded after the given ones keeps ``get_device_properties`` and
``get_device_capability`` (as ``from torch.cuda import …`` does) and a properties object
obtained at import. The same step program runs plainly and through the launcher (a python
step and a one-rank torchrun step); it prints, as JSON, what the kept functions and object say,
what torch's own say, inductor's ``is_big_gpu`` and a torch.compile'd function's result on
cuda. Exit status 0 when every forked answer equals the plain one.
"""

from __future__ import annotations

import argparse
import json
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

KEEPER = '''import os
import torch
IMPORTED_IN = os.getpid()  # another process's pid in a step: the zygote imported this module
from torch.cuda import get_device_capability, get_device_properties
PROPS = torch.cuda.get_device_properties(0)  # an object obtained while importing
'''

STEP = '''import json, os, sys
import torch, keeps_cuda
preloaded = keeps_cuda.IMPORTED_IN != os.getpid()
from torch._dynamo.device_interface import get_interface_for_device
from torch._inductor.utils import is_big_gpu

def fields(p):
    return {k: getattr(p, k, "MISSING") for k in
            ("name", "major", "minor", "total_memory", "multi_processor_count")}

@torch.compile
def f(x):
    return torch.sin(x) * 2 + x

x = torch.arange(4096, device="cuda", dtype=torch.float32) / 4096
seen = {"rank": os.environ.get("RANK"),
        "kept": fields(keeps_cuda.get_device_properties(0)),
        "kept_capability": list(keeps_cuda.get_device_capability(0)),
        "kept_object": fields(keeps_cuda.PROPS),
        "torch": fields(torch.cuda.get_device_properties(0)),
        "interface": fields(get_interface_for_device("cuda").Worker.get_device_properties(0)),
        "is_big_gpu": is_big_gpu(0),
        "compiled_equals_eager": bool(torch.allclose(f(x), torch.sin(x) * 2 + x)),
        "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}
os.write(1, (json.dumps({"preloaded": preloaded, **seen}, sort_keys=True) + "\\n").encode())
'''


def reports(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith('{"')]


def nvml_memory() -> str:
    """NVML's memory figures (the NVML answers' total_memory while preloading is NVML's total)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:  # NVML's init is counted per process: leave the count as found
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
            v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        finally:
            pynvml.nvmlShutdown()
        return f"total {v1.total}; v2 total {v2.total} reserved {v2.reserved} " \
               f"(total - reserved {v2.total - v2.reserved})"
    except Exception as err:  # an older nvidia-ml-py has no v2
        return f"{type(err).__name__}: {err}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modules", default="torch,torch._dynamo",
                        help="preloaded before the module that keeps the queries")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="captured-cuda-")
    with open(os.path.join(scratch, "keeps_cuda.py"), "w") as f:
        f.write(KEEPER)
    step = os.path.join(scratch, "step.py")
    with open(step, "w") as f:
        f.write(STEP)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [scratch, os.environ.get("PYTHONPATH")])),
        PRELOAD_LAUNCHER_CACHE_DIR=os.path.join(scratch, "cache"))
    modules = [m for m in args.modules.split(",") if m] + ["keeps_cuda"]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {os.uname().nodename}, Python "
          f"{sys.version.split()[0]}; preload {','.join(modules)}", flush=True)
    commands = {"python": [sys.executable, step],
                "torchrun": [sys.executable, "-m", "torch.distributed.run",
                             "--nproc-per-node", "1", step]}
    print(f"# NVML: {nvml_memory()}", flush=True)
    launcher = Launcher(modules)
    ok = True
    try:
        for name, command in commands.items():
            plain = subprocess.run(command, env=env, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
            forked = launcher.run(command, env=env)
            want, got = reports(plain.stdout), reports(forked.stdout)
            same = ([{k: v for k, v in r.items() if k != "preloaded"} for r in want]
                    == [{k: v for k, v in r.items() if k != "preloaded"} for r in got])
            served = forked.via == "zygote" and all(r["preloaded"] for r in got)
            ok &= bool(same and served and want and plain.returncode == forked.returncode == 0)
            print(f"{name}: plain exit {plain.returncode}, launcher exit {forked.returncode} "
                  f"via {forked.via}; same answers: {same}", flush=True)
            for label, output in (("plain", plain.stdout), ("launcher", forked.stdout)):
                for line in output.strip().splitlines()[-3:]:
                    print(f"  {label}: {line}")
    finally:
        launcher.close()
        shutil.rmtree(scratch, ignore_errors=True)
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
