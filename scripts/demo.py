"""The demo: an example-test suite run under pytest twice, steps as plain subprocesses and
through the launcher, with the wall time of each and of every step.

    python scripts/demo.py            (scripts/demo.sh installs everything first)
"""
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE = os.path.join(HERE, "example_suite")


def run_suite(lane: str) -> tuple[float, str]:
    # The stack the install brings and the suite's steps import (megatron.bridge needs Python
    # >= 3.12 and Transformer Engine: naming it here would report it as not importable).
    # Its steps start `python` and torchrun by name: this interpreter's come first on PATH, as
    # in an activated virtualenv (`PYTHON=venv/bin/python bash scripts/demo.sh` needs no more).
    env = dict(os.environ, PRELOAD_LAUNCHER=lane,
               PRELOAD_LAUNCHER_MODULES="torch,megatron.core,modelopt.torch",
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", SUITE, "-q", "-p", "no:cacheprovider",
                          "--durations=0", "--durations-min=0", "-o", "console_output_style=classic"],
                         cwd=SUITE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    if out.returncode:
        print(out.stdout)
        raise SystemExit(f"the example suite failed with PRELOAD_LAUNCHER={lane}")
    return wall, out.stdout


def durations(output: str) -> dict[str, float]:
    times = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "call" and parts[0].endswith("s"):
            times[parts[2].split("::", 1)[1]] = float(parts[0][:-1])
    return times


def main() -> None:
    print("Running the example suite (7 tests, 8 steps, 1-2 ranks) twice ...\n", flush=True)
    off_wall, off_out = run_suite("0")
    on_wall, on_out = run_suite("1")
    off, on = durations(off_out), durations(on_out)
    print(f"{'test':42} {'subprocess':>11} {'launcher':>9} {'ratio':>7}")
    for name in off:
        ratio = off[name] / on[name] if on.get(name) else float("nan")
        why = "   <- waited for the zygote's preload (once per session)" if ratio < 1 else ""
        print(f"{name:42} {off[name]:10.2f}s {on.get(name, float('nan')):8.2f}s {ratio:6.1f}x{why}")
    print(f"\n{'whole pytest session (wall)':42} {off_wall:10.1f}s {on_wall:8.1f}s "
          f"{off_wall / on_wall:6.1f}x")
    summary = on_out[on_out.find("preload_launcher -"):].splitlines()
    print("\nA test slower through the launcher is the first one to need the zygote: it waits for "
          "the preload\nthe session started before its conftests loaded (paid once, counted in "
          "the wall time).")
    print("\nlauncher summary from the pytest session:")
    for line in summary[1:8]:
        if line.startswith("="):
            break
        print("  " + line)


if __name__ == "__main__":
    main()
