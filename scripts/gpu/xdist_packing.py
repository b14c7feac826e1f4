"""A 4-worker pytest-xdist run of 8 CUDA steps: plain subprocesses, through the launcher (one
zygote shared by the workers), and through the launcher with GPU packing
(PRELOAD_LAUNCHER_GPUS=auto). Wall time, host memory (the session's processes, PSS summed,
sampled every 0.2 s) and GPU memory (NVML, summed over GPUs) peaks, from an empty cache.

    python3 scripts/gpu/xdist_packing.py [--workers 4] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from preload_launcher import procfs  # noqa: E402

STEP = textwrap.dedent("""\
    import os, sys, time, torch
    x = torch.randn(8192, 8192, device="cuda")
    for _ in range(40):
        x = (x @ x).tanh()
    torch.cuda.synchronize()
    print("step", sys.argv[1], "on CUDA_VISIBLE_DEVICES=%s" % os.environ.get("CUDA_VISIBLE_DEVICES"),
          "peak %.1f GiB" % (torch.cuda.max_memory_allocated() / 2**30), flush=True)
    """)
TESTS = textwrap.dedent("""\
    import os, sys
    import pytest

    @pytest.mark.parametrize("i", range(int(os.environ["STEPS"])))
    def test_cuda_step(preload_launcher, i):
        r = preload_launcher.run([sys.executable, os.path.join(os.path.dirname(__file__), "step.py"),
                                  str(i)], timeout=600)
        print(r.stdout, r.via, r.gpus, r.gpu_wait_s)
        assert r.returncode == 0, r.stdout
    """)


def gpu_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return sum(int(x) for x in out.split())


class Peaks:
    """Samples the session's host memory (PSS of its process tree) and GPU memory."""

    def __init__(self, root_pid: int) -> None:
        self.root, self.host_kb, self.gpu_mib, self.done = root_pid, 0, 0, False
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while not self.done:
            self.host_kb = max(self.host_kb, procfs.tree_pss_kb(self.root))
            self.gpu_mib = max(self.gpu_mib, gpu_used_mib())
            time.sleep(0.2)

    def stop(self) -> None:
        self.done = True
        self.thread.join()


def session(project: str, env: dict, workers: int) -> tuple[float, Peaks, str]:
    start = time.perf_counter()
    # -p: the plugin by name, also where the package is on PYTHONPATH rather than installed.
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-p", "preload_launcher.pytest_plugin",
                             "-n", str(workers), project], env=env, cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    peaks = Peaks(proc.pid)
    out, _ = proc.communicate()
    peaks.stop()
    return time.perf_counter() - start, peaks, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    project = tempfile.mkdtemp(prefix="xdist-packing-")
    with open(os.path.join(project, "step.py"), "w") as f:
        f.write(STEP)
    with open(os.path.join(project, "test_steps.py"), "w") as f:
        f.write(TESTS)
    with open(os.path.join(project, "pytest.ini"), "w") as f:
        f.write("[pytest]\npreload_launcher_modules = torch\n")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {os.uname().nodename}: {args.workers} xdist "
          f"workers, {args.steps} CUDA steps (8192^2 matmuls), {gpu_count()} GPU(s); "
          "empty launcher cache each way", flush=True)
    ways = [("plain subprocesses", {"PRELOAD_LAUNCHER": "0"}),
            ("launcher, shared zygote", {}),
            ("launcher, shared zygote + GPU packing", {"PRELOAD_LAUNCHER_GPUS": "auto"})]
    for label, extra in ways:
        cache = tempfile.mkdtemp(prefix="xdist-cache-")
        env = dict(os.environ, STEPS=str(args.steps), PRELOAD_LAUNCHER_CACHE_DIR=cache, **extra)
        seconds, peaks, out = session(project, env, args.workers)
        tail = [line for line in out.splitlines() if "passed" in line or "failed" in line][-1:]
        summary = [line for line in out.splitlines() if "shared zygote" in line or
                   "GPU packing" in line]
        print(f"RESULT {label}: {seconds:.1f} s, host PSS peak {peaks.host_kb / 2**20:.1f} GiB, "
              f"GPU memory peak {peaks.gpu_mib / 1024:.1f} GiB | {' '.join(tail)}", flush=True)
        for line in summary:
            print("   ", line.strip(), flush=True)
        if not tail:
            print(out[-3000:], flush=True)


def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return len(out.splitlines())


if __name__ == "__main__":
    main()
