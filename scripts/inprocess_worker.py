"""The in-process baseline: one long-lived process (per rank) runs step scripts again and
again with runpy, as an in-process test runner would; prints each run's seconds (rank 0).

    python scripts/inprocess_worker.py REPS STEP.py [ARGS...] [-- STEP.py [ARGS...] ...]
    torchrun --nproc_per_node=N scripts/inprocess_worker.py REPS STEP.py ARGS -- ...

Prints ``INPROCESS {"step": "STEP ARGS", "s": seconds}`` after each run; a run that raises (or
hangs) ends the worker: what leaked from the runs before is what the launcher exists to avoid.
"""
import json
import os
import runpy
import sys
import time

reps = int(sys.argv[1])
commands, current = [], []
for word in sys.argv[2:] + ["--"]:
    if word == "--":
        commands.append(current)
        current = []
    else:
        current.append(word)
for _ in range(reps):
    for command in (c for c in commands if c):
        sys.argv = list(command)
        start = time.perf_counter()
        runpy.run_path(command[0], run_name="__main__")
        if os.environ.get("RANK", "0") == "0":
            print("INPROCESS " + json.dumps({"step": " ".join(command),
                                             "s": time.perf_counter() - start}), flush=True)
