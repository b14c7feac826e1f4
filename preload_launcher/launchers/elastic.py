"""torch elastic's own behaviour at a launch's edges, for the agent: the signals torchrun
handles (``--signals-to-handle``, each raising torch's ``SignalException``), the warnings it
logs while it stops its workers, its failure report (``ChildFailedError`` of every failed
rank, terminated ones included) and its ``@record`` error file; and how the launch ends:
exit status 1 with the exception's traceback, as ``torchrun``'s ``main`` ends.
"""

from __future__ import annotations

import signal
import sys
import traceback
from typing import Callable

__all__ = ["handle_signals", "restore_signals", "log_death_signal", "log_closing",
           "log_first_failure", "process_failure", "child_failed", "run_recorded"]


def handle_signals(names: str) -> dict[int, object]:
    """Install torch elastic's handler (raises ``SignalException``) for each signal named, as
    its process context does when it starts workers; returns the handlers it replaced."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler
    replaced = {}
    for name in names.split(","):
        signum = getattr(signal, name.strip(), None)
        if isinstance(signum, signal.Signals):
            replaced[signum] = signal.signal(signum, _terminate_process_handler)
    return replaced


def restore_signals(replaced: dict[int, object]) -> None:
    for signum, handler in replaced.items():
        signal.signal(signum, handler)


def log_death_signal(sigval) -> None:
    from torch.distributed.elastic.agent.server.api import logger
    logger.warning("Received %s death signal, shutting down workers", sigval)


def log_closing(pid: int, sigval) -> None:
    from torch.distributed.elastic.multiprocessing.api import logger
    logger.warning("Sending process %s closing signal %s", pid, signal.Signals(sigval).name)


def log_first_failure(failures: dict, entrypoint: str) -> None:
    """The ``E… failed (exitcode: N) local_rank: …`` line torchrun's process context logs."""
    from torch.distributed.elastic.multiprocessing.api import logger
    first = min(failures.values(), key=lambda f: f.timestamp)
    logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                 first.exitcode, first.local_rank, first.pid, entrypoint)


def process_failure(local_rank: int, pid: int, exitcode: int, error_file: str):
    """torch's record of one failed rank, made when its exit is seen (its timestamp)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode, error_file=error_file)


def child_failed(name: str, failures: dict):
    """torchrun's launch failure over every failed rank's ``ProcessFailure``, in the order they
    were seen (the root cause is the earliest; ties go to the first seen, as in torch)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    return ChildFailedError(name=name, failures=failures)


def run_recorded(launch: Callable[[], None]) -> int:
    """Run ``launch`` under torch elastic's ``@record`` (a failed rank's error file becomes the
    launch's ``TORCHELASTIC_ERROR_FILE``); an exception out of it ends the launch as it ends
    torchrun: its traceback on stderr, exit status 1."""
    from torch.distributed.elastic.multiprocessing.errors import record
    try:
        record(launch)()
    except Exception:
        sys.stdout.flush()
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0
