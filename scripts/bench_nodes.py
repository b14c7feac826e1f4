"""A 2-node torchrun job on this machine: both nodes as plain torchruns against both nodes
through one warm zygote (each node's launch forked, its ranks too), N runs each, alternating.
The wall time is from starting both nodes to both ending.

    PYTHONPATH=. python scripts/bench_nodes.py 5                      # 2 x 2 ranks, gloo, torch
    python3 scripts/bench_nodes.py 3 --nproc 1 --backend nccl --modules torch,megatron.core

Each rank imports the preloaded modules (as a real step does), joins the process group and
all-reduces one tensor (on its GPU with nccl: LOCAL_RANK's device).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from preload_launcher import Launcher  # noqa: E402
from preload_launcher.cuda import nvml_device_count  # noqa: E402

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # wherever the image put torchrun
STEP = """import importlib, os, sys
for name in sys.argv[2].split(","):
    importlib.import_module(name)
import torch, torch.distributed as dist
backend = sys.argv[1]
device = f"cuda:{os.environ['LOCAL_RANK']}" if backend == "nccl" else "cpu"
if backend == "nccl":
    torch.cuda.set_device(device)
dist.init_process_group(backend)
t = torch.ones(1, device=device)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(launcher, script: str, opts) -> float:
    """Both nodes at once (c10d at one endpoint); the seconds until both ended."""
    port, codes = free_port(), []
    args = [*TORCHRUN, "--nnodes=2", f"--nproc-per-node={opts.nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench", script, opts.backend,
            opts.modules]

    def node() -> None:
        if launcher is None:
            codes.append(subprocess.run(args, capture_output=True).returncode)
        else:
            result = launcher.run(args)
            assert result.via == "zygote", result.reason
            codes.append(result.returncode)
    start = time.perf_counter()
    threads = [threading.Thread(target=node) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert codes == [0, 0], codes
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", type=int, nargs="?", default=5)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per node")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--modules", default="torch", help="preloaded, and imported by each rank")
    opts = parser.parse_args()
    if opts.backend == "nccl":
        gpus = nvml_device_count()  # without initialising CUDA in this process
        if gpus < 2 * opts.nproc:
            sys.exit(f"nccl: both nodes run on this machine, so each of the {2 * opts.nproc} ranks "
                     f"needs a GPU of its own (NCCL refuses two ranks on one GPU); {gpus} here")
    launcher = Launcher(opts.modules.split(","))
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "step.py")
        with open(script, "w") as f:
            f.write(STEP)
        try:
            launcher.zygote_for(dict(os.environ))
            job(launcher, script, opts)  # not counted: the first
            times: dict[str, list[float]] = {"plain torchrun": [], "forked": []}
            for _ in range(opts.runs):
                times["plain torchrun"].append(job(None, script, opts))
                times["forked"].append(job(launcher, script, opts))
            for name, values in times.items():
                print(f"{name:15} median {statistics.median(values):6.2f} s   "
                      f"fastest {min(values):6.2f} s   ({opts.runs} runs, 2 nodes x {opts.nproc} "
                      f"ranks, {opts.backend}, {opts.modules})", flush=True)
        finally:
            launcher.close()


if __name__ == "__main__":
    main()
