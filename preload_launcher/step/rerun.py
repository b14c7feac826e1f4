"""A step that must run as a fresh interpreter after all, and how it knows it still can.

When a step changes a variable that a preloaded module read at import and then imports that
module (``module_table``), only a fresh import would configure it as the step now asks. The
process then becomes that fresh interpreter: ``execve`` of the real interpreter with the step's
own command line and the environment it started with; pid, fds, cwd and process attributes are
kept, and the caller sees one process. That is exact only while nothing the step did can be
seen from outside: no byte written by the process (``/proc/self/io``; the bytecode files its
imports cached aside, which a fresh run writes the same) and no process started. Output still
in the step's stream buffers was never written: the fresh run writes it again. Otherwise the
step fails with one line naming the variable and the module.
"""

from __future__ import annotations

import importlib._bootstrap_external as _external  # type: ignore[import-not-found]
import os
import resource
import sys
from typing import Callable, NoReturn, Optional

from .. import procfs
from . import runtime

__all__ = ["FreshRun"]


def _bytes_written() -> Optional[int]:
    try:
        with open("/proc/self/io", "rb") as io_file:
            for line in io_file:
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _children_ran() -> int:
    """Page faults of reaped children: any process that ran has some."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt


def _live_children() -> bool:
    return any(children.strip() for children in procfs.per_thread("children"))


class FreshRun:
    """What the step has done since ``start``; ``__call__`` re-executes it fresh or fails."""

    def __init__(self, executable: str, argv: list[str], env: dict[str, str]) -> None:
        self.executable = executable
        self.argv = list(argv)
        self.env = dict(env)
        self.cached_bytes = 0  # what the step's imports wrote as bytecode caches
        self.written = _bytes_written()
        self.children = _children_ran()
        write_atomic: Callable = _external._write_atomic

        def counted(path, data, *args, **kwargs):
            self.cached_bytes += len(data)
            return write_atomic(path, data, *args, **kwargs)

        _external._write_atomic = counted

    def observed(self) -> str:
        """What the step did that a fresh run would do again for all to see ('' = nothing)."""
        written = _bytes_written()
        if written is None or self.written is None:
            return "whether it wrote anything cannot be read (/proc/self/io)"
        if written - self.written > self.cached_bytes:
            return "it had written output"
        if _children_ran() != self.children or _live_children():
            return "it had started a process"
        return ""

    def __call__(self, changed: dict[str, str]) -> NoReturn:
        (key, module), *more = changed.items()
        also = f" (and {', '.join(k for k, _ in more)})" if more else ""
        what = (f"{key}{also} changed before the step imported {module}, which read it at "
                "import in the zygote")
        done = self.observed()
        if not done:
            runtime.become_fresh(self.executable, self.argv, self.env, what)
        print(f"preload_launcher: this step cannot go on: {what}; a fresh interpreter would "
              f"have read the new value, and {done}, so it cannot be run fresh now. Set {key} "
              "in the step's environment, or before the step writes output, or run it with "
              "PRELOAD_LAUNCHER=0.", file=sys.stderr)
        runtime.exit_with(runtime.finish(1))
