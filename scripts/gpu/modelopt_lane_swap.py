"""pytest plugin for the Model-Optimizer lane (scripts/gpu/modelopt_lane.py): the one-line swap a
Model-Optimizer-style suite makes to adopt the launcher, applied from outside its checkout.

    python -m pytest -p preload_launcher.pytest_plugin -p modelopt_lane_swap tests/examples/...

Model-Optimizer's ``run_example_command`` calls ``_run_capturing(cmd_parts, cwd, env)`` in
``tests/_test_utils/examples/run_command.py``, which runs ``subprocess.run(..., stdout=PIPE,
stderr=STDOUT, text=True)``, prints the output and returns ``(returncode, output)``. This plugin
replaces that function by one that does the same through ``preload_launcher.run`` (what
``preload_launcher.run_capturing`` does, keeping the result's ``via``/``reason`` for the lane's
log). Nothing of the suite's files is edited. Every way also times the suite's worker pools
(``_test_utils.torch.distributed.utils.DistributedWorkerPool``: its start, until every rank said
ready, and its shutdown), logged as steps of the test whose fixture made the pool. With any other ``MODELOPT_LANE_WAY`` (subprocess,
suite, forked) the suite's own function stays and is only timed. Each step is appended as one JSON line to
``$MODELOPT_LANE_STEPS`` (if set): the way, the test, the command, how it ran and why, seconds;
each test phase (setup, call, teardown) to ``<way>-phases.jsonl`` beside it.
"""

from __future__ import annotations

import json
import os
import time

import preload_launcher

MODULE = "_test_utils.examples.run_command"


def _record(cmd_parts, via: str, reason: str, returncode: int, seconds: float) -> None:
    path = os.environ.get("MODELOPT_LANE_STEPS")
    if not path:
        return
    row = {"way": os.environ.get("MODELOPT_LANE_WAY", "launcher"),
           "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
           "cmd": " ".join(str(p) for p in cmd_parts[:3]), "via": via, "reason": reason,
           "returncode": returncode, "seconds": round(seconds, 2)}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _run_capturing(cmd_parts, cwd, env):
    """The suite's helper, through the launcher: same arguments, same printing, same result."""
    start = time.perf_counter()
    result = preload_launcher.run(cmd_parts, cwd=cwd, env=env)
    print(result.stdout, end="")
    _record(cmd_parts, result.via, result.reason or "", result.returncode,
            time.perf_counter() - start)
    return result.returncode, result.stdout


def _timed(original):
    def _run_capturing(cmd_parts, cwd, env):
        start = time.perf_counter()
        returncode, output = original(cmd_parts, cwd, env)
        _record(cmd_parts, os.environ.get("MODELOPT_LANE_WAY", ""), "the suite's own helper", returncode,
                time.perf_counter() - start)
        return returncode, output
    return _run_capturing


def _time_pools() -> None:
    """Wrap the pool's start and shutdown with a timer, where the suite has such a pool."""
    import importlib

    try:
        pool = importlib.import_module("_test_utils.torch.distributed.utils").DistributedWorkerPool
    except (ImportError, AttributeError):
        return
    start, shutdown = pool.__init__, pool.shutdown

    def timed_init(self, world_size, *args, **kwargs):
        began = time.perf_counter()
        try:
            start(self, world_size, *args, **kwargs)
        except BaseException:
            _record(["pool start", f"world={world_size}"], "pool", "failed", 1,
                    time.perf_counter() - began)
            raise
        _record(["pool start", f"world={world_size}"], "pool", "", 0, time.perf_counter() - began)

    def timed_shutdown(self):
        began = time.perf_counter()
        shutdown(self)
        codes = [p.exitcode for p in self._processes]
        _record(["pool shutdown", f"exit codes {codes}"], "pool", "", 0, time.perf_counter() - began)

    pool.__init__, pool.shutdown = timed_init, timed_shutdown


def pytest_configure(config) -> None:
    _time_pools()
    # The suite's ini puts tests/ on sys.path before plugins are configured; run_example_command
    # looks its helper up at call time, so replacing the module attribute is the whole swap.
    import importlib

    module = importlib.import_module(MODULE)
    if not hasattr(module, "_run_capturing"):
        raise RuntimeError(f"{MODULE} has no _run_capturing: the suite changed its helper")
    if os.environ.get("MODELOPT_LANE_WAY") != "launcher":  # the suite's own helper, timed
        module._run_capturing = _timed(module._run_capturing)
    else:
        module._run_capturing = _run_capturing


def pytest_runtest_logreport(report) -> None:
    """Each test phase's time as it ends, beside the steps (``<way>-phases.jsonl``): a session
    stopped at its limit writes no junit report, and this says where its time went."""
    path = os.environ.get("MODELOPT_LANE_STEPS")
    if path:
        way = os.environ.get("MODELOPT_LANE_WAY", "launcher")
        row = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
               "seconds": round(report.duration, 2), "ended": round(time.time(), 1)}
        with open(os.path.join(os.path.dirname(path), f"{way}-phases.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
