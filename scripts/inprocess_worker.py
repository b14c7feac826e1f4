"""The in-process baseline: one long-lived process (per rank) runs a step script again and
again with runpy, as an in-process test runner would; prints each run's seconds (rank 0).

    python scripts/inprocess_worker.py STEP.py REPS
    torchrun --nproc_per_node=N scripts/inprocess_worker.py STEP.py REPS
"""
import json
import os
import runpy
import sys
import time

script, reps = sys.argv[1], int(sys.argv[2])
times = []
for _ in range(reps):
    start = time.perf_counter()
    runpy.run_path(script, run_name="__main__")
    times.append(time.perf_counter() - start)
if os.environ.get("RANK", "0") == "0":
    print("INPROCESS " + json.dumps(times), flush=True)
