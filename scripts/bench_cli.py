"""What a one-off `preload-launcher run` costs: the same command plain and through `run` with no
daemon (medians of many runs, alternating), and what the CLI's own imports take
(`python -X importtime`).

    python scripts/bench_cli.py [--runs 21] [--command "python -c pass"]

The launcher runs from this checkout, in private runtime and cache directories; a command that
used under a second of CPU starts no daemon, so every run is a one-off.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(args: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def _self_times(code: str, env: dict) -> dict[str, int]:
    """Module -> its own import time (µs) in a fresh ``python -X importtime -c code``."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env,
                         capture_output=True, text=True, check=True).stderr
    rows = (re.match(r"import time:\s+(\d+) \|\s+\d+ \| *(\S+)", line) for line in out.splitlines())
    return {m[2]: int(m[1]) for m in rows if m}


def import_time_ms(env: dict) -> tuple[float, list[str]]:
    """What the CLI's imports for `run` add to the interpreter's start-up (the modules that
    ``-c pass`` does not load), and the costliest of them."""
    baseline = _self_times("pass", env)
    cli = _self_times("import preload_launcher.cli, preload_launcher.cli_run", env)
    extra = sorted(((us, name) for name, us in cli.items() if name not in baseline), reverse=True)
    return sum(us for us, _ in extra) / 1000, [f"{name} {us / 1000:.1f} ms" for us, name in extra[:6]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21, help="runs each way (default 21)")
    parser.add_argument("--command", default=f"{sys.executable} -c pass",
                        help="the command to time (default: this python -c pass)")
    args = parser.parse_args()
    command = shlex.split(args.command)
    scratch = tempfile.mkdtemp(prefix="pl-bench-", dir="/tmp")
    env = dict(os.environ, XDG_RUNTIME_DIR=scratch, PRELOAD_LAUNCHER_CACHE_DIR=scratch,
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    launcher = [sys.executable, "-m", "preload_launcher.cli", "run", "--"]
    try:
        plain, through = [], []
        for _ in range(args.runs):  # alternating: both ways see the same machine load
            plain.append(timed(command, env))
            through.append(timed(launcher + command, env))
        leftovers = [n for n in os.listdir(os.path.join(scratch, f"preload_launcher-{os.getuid()}"))]
        imports_ms, costliest = import_time_ms(env)
    finally:
        subprocess.run([sys.executable, "-m", "preload_launcher.cli", "stop", "--all"], env=env,
                       capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    p, t = statistics.median(plain), statistics.median(through)
    print(f"command: {' '.join(command)}  ({args.runs} runs each way, medians; {os.cpu_count()} CPUs)")
    print(f"  plain                        {p:.3f} s")
    print(f"  preload-launcher run (no daemon) {t:.3f} s   overhead {t - p:+.3f} s")
    print(f"CLI imports for run (python -X importtime, beyond the interpreter's own): "
          f"{imports_ms:.1f} ms; costliest: {', '.join(costliest)}")
    if leftovers:
        print(f"note: the runs left {leftovers} (a daemon was started)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
