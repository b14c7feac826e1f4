"""What ``/proc`` says about a process: threads, memory and fds, for ``status`` and ``doctor``."""

from __future__ import annotations

import collections
import os
import resource
from typing import Iterator

__all__ = ["per_thread", "native_threads", "rss_kb", "fd_count", "open_fds", "tree_pss_kb"]


def per_thread(name: str) -> Iterator[str]:
    """The text of ``/proc/self/task/<tid>/<name>`` for each thread of this process (one that
    ended while being read is left out)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/{name}") as f:
                yield f.read()
        except OSError:
            continue


def native_threads() -> dict[str, int]:
    """Thread names of this process (``/proc/self/task/*/comm``) with their counts."""
    return dict(collections.Counter(comm.strip() for comm in per_thread("comm")))


def rss_kb() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def open_fds() -> set[int]:
    """This process's open fds (without the one that listing them took)."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
        except OSError:
            continue  # the listing's own fd, closed by now
        fds.add(int(name))
    return fds


def tree_pss_kb(pid: int) -> int:
    """PSS of a process and every process below it (ranks, their workers)."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        return total
    return total + sum(tree_pss_kb(c) for c in children)
