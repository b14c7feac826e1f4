"""An empty step and a stack-import step through one warm zygote, N runs each: the wall time
the caller sees, and the time from the step's ``exec`` event to its program's first line (what
setting up a fresh module table costs). Run it for two checkouts in turn to compare them:

    PYTHONPATH=. python scripts/bench_table.py 15
"""

from __future__ import annotations

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from preload_launcher import Launcher  # noqa: E402

PY = sys.executable
FIRST_LINE = "import time; print(time.time())"
STEPS = {"empty": [PY, "-c", "pass"], "stack": [PY, os.path.join(HERE, "steps", "stack_step.py")]}


def main(runs: int) -> None:
    launcher = Launcher(["torch", "megatron.core", "modelopt.torch"])
    try:
        launcher.zygote_for(dict(os.environ))
        for args in STEPS.values():  # the first of each is not counted
            launcher.run(args)
        times: dict[str, list[float]] = {name: [] for name in [*STEPS, "exec->first line"]}
        for _ in range(runs):
            for name, args in STEPS.items():
                start = time.perf_counter()
                result = launcher.run(args)
                times[name].append(time.perf_counter() - start)
                assert result.returncode == 0 and result.via == "zygote", result.reason
            requested = time.time()
            result = launcher.run([PY, "-c", FIRST_LINE])
            times["exec->first line"].append(float(result.stdout) - requested
                                             - result.exec_delay_s)
        for name, values in times.items():
            print(f"{name:18} median {statistics.median(values) * 1000:7.1f} ms   "
                  f"fastest {min(values) * 1000:7.1f} ms   ({runs} runs)")
    finally:
        launcher.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
