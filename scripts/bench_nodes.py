"""A 2-node x 2-rank torchrun job (gloo, CPU) on this machine: both nodes as plain torchruns
against both nodes through one warm zygote (each node's launch forked, its ranks too), N runs
each, alternating. The wall time is from starting both nodes to both ending.

    PYTHONPATH=. python scripts/bench_nodes.py 5
"""

from __future__ import annotations

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

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
STEP = ("import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "assert t.item() == dist.get_world_size()\n"
        "dist.destroy_process_group()\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(launcher, script: str) -> float:
    """Both nodes at once (c10d at one endpoint); the seconds until both ended."""
    port, codes = free_port(), []
    args = [TORCHRUN, "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench", script]

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


def main(runs: int) -> None:
    launcher = Launcher(["torch"])
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "step.py")
        with open(script, "w") as f:
            f.write(STEP)
        try:
            launcher.zygote_for(dict(os.environ))
            job(launcher, script)  # not counted: the first
            times: dict[str, list[float]] = {"plain torchrun": [], "forked": []}
            for _ in range(runs):
                times["plain torchrun"].append(job(None, script))
                times["forked"].append(job(launcher, script))
            for name, values in times.items():
                print(f"{name:15} median {statistics.median(values):6.2f} s   "
                      f"fastest {min(values):6.2f} s   ({runs} runs, 2 nodes x 2 ranks)")
        finally:
            launcher.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
