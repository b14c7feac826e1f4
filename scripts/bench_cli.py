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
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(args: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and everything it waited for): on a busy
    machine the CPU time moves far less than the wall time."""
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime


CLI_IMPORT = "import preload_launcher.cli, preload_launcher.front.cli_run"


def import_time(env: dict, repeats: int = 7) -> tuple[float, float, list[str]]:
    """The CLI's imports for `run`, medians of ``repeats`` fresh interpreters: their time by
    ``python -X importtime`` (ms, wall), their CPU time (ms), and the costliest modules they
    add to the interpreter's own start-up."""
    timed_code = f"import time; t = time.process_time(); {CLI_IMPORT}; print(time.process_time() - t)"
    walls, cpus, added = [], [], {}
    for _ in range(repeats):
        baseline = _import_rows("pass", env)[0]
        rows, out = _import_rows(timed_code, env)
        walls.append(sum(cumulative for name, _, cumulative, depth in rows
                         if depth == 0 and name.startswith("preload_launcher")) / 1000)
        cpus.append(float(out) * 1000)
        for name, own, _, _ in rows:
            if name not in {row[0] for row in baseline}:
                added.setdefault(name, []).append(own)
    costliest = sorted(((statistics.median(v), k) for k, v in added.items()), reverse=True)[:6]
    return (statistics.median(walls), statistics.median(cpus),
            [f"{name} {us / 1000:.1f} ms" for us, name in costliest])


def _import_rows(code: str, env: dict) -> tuple[list[tuple[str, int, int, int]], str]:
    """(module, own µs, cumulative µs, depth) per import of ``python -X importtime -c code``,
    and what the code printed."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env,
                         capture_output=True, text=True, check=True)
    rows = []
    for line in out.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((m[4], int(m[1]), int(m[2]), (len(m[3]) - 1) // 2))
    return rows, out.stdout.strip()


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
        imports_ms, imports_cpu_ms, costliest = import_time(env)
    finally:
        subprocess.run([sys.executable, "-m", "preload_launcher.cli", "stop", "--all"], env=env,
                       capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    p, t = (statistics.median(w for w, _ in plain), statistics.median(w for w, _ in through))
    pc, tc = (statistics.median(c for _, c in plain), statistics.median(c for _, c in through))
    print(f"command: {' '.join(command)}  ({args.runs} runs each way, alternating, medians; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})")
    print(f"  {'':34} {'wall':>8} {'CPU':>8}")
    print(f"  {'plain':34} {p:7.3f}s {pc:7.3f}s")
    print(f"  {'preload-launcher run (no daemon)':34} {t:7.3f}s {tc:7.3f}s")
    print(f"  {'overhead':34} {t - p:+7.3f}s {tc - pc:+7.3f}s")
    print(f"the CLI's imports for run: {imports_ms:.1f} ms (python -X importtime), "
          f"{imports_cpu_ms:.1f} ms of CPU; costliest beyond the interpreter's own: "
          f"{', '.join(costliest)}")
    if leftovers:
        print(f"note: the runs left {leftovers} (a daemon was started)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
