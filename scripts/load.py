"""Load figures for docs/reliability.md: steps/s under concurrency, zygote RSS and fds over
many sequential steps.

    python scripts/load.py [--preload torch] [--steps 1000] [--threads 8]
"""
import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from preload_launcher import Launcher  # noqa: E402

PY = sys.executable


def zygote_numbers(launcher):
    pid = launcher.zygotes[0].process.pid
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preload", default="torch")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    launcher = Launcher(args.preload.split(","))
    step = [PY, "-c", "import torch; print('ok')" if "torch" in args.preload else "print('ok')"]
    launcher.run(step)
    rss0, fds0 = zygote_numbers(launcher)
    print(f"preload {args.preload}: zygote RSS {rss0 / 1024:.1f} MiB, {fds0} fds after 1 step")

    times = []
    start = time.perf_counter()
    for i in range(args.steps):
        t = time.perf_counter()
        assert launcher.run(step).returncode == 0
        times.append(time.perf_counter() - t)
        if i + 1 in (10, 100, args.steps):
            rss, fds = zygote_numbers(launcher)
            print(f"after {i + 1:5d} sequential steps: RSS {rss / 1024:.1f} MiB, {fds} fds")
    seq = time.perf_counter() - start
    print(f"sequential: {args.steps / seq:.1f} steps/s, median {1000 * statistics.median(times):.1f} ms, "
          f"p99 {1000 * sorted(times)[int(0.99 * len(times))]:.1f} ms")

    counter = iter(range(args.steps))
    lock = threading.Lock()
    failures = []

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = launcher.run(step)
            if r.returncode or r.stdout != "ok\n":
                failures.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conc = time.perf_counter() - start
    rss, fds = zygote_numbers(launcher)
    print(f"{args.threads} threads: {args.steps / conc:.1f} steps/s, {len(failures)} failures; "
          f"zygote after {2 * args.steps + 1} steps: RSS {rss / 1024:.1f} MiB, {fds} fds")
    launcher.close()


if __name__ == "__main__":
    main()
