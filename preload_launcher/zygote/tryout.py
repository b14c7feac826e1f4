"""A learned module is imported in a throwaway child of the zygote before the zygote imports it.

A learned module the zygote may not keep (its import warns or prints, reaches pytest, tries a
deferred package, or fails) cannot be taken back once imported: taking its modules out of
``sys.modules`` leaves what their code did to the modules that stay (modelopt's export modules
each register their modes in a registry of ``modelopt.torch.opt``, which a step would then find
there, once more for every retry). So the zygote runs a learned import only after a child of it
ran the same import, from the same state, and found nothing that rules it out. A child the
import left unfit to fork (the CUDA driver initialised, a thread started) says so too, with the
culprit: the zygote refuses the module's package as if its own import had found it, without
dirtying itself and restarting.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
from typing import Optional

from ..cuda import DriverProbe
from ..step import runtime
from . import learn
from .culprits import import_entry, is_dirty, verdict_for
from .deferral import Blocker

__all__ = ["try_import"]

TIMEOUT_S = 300.0  # a child silent this long is killed: its module is not learned


def try_import(module: str, probe: DriverProbe, blocker: Optional[Blocker]) -> dict:
    """What importing ``module`` did in a child of this process: ``{}`` when the zygote may
    import it, else one of ``{"dirty": verdict}`` (it left the child unfit to fork; the verdict
    names the culprit), ``{"unlearnable": why}``, ``{"deferred": True}`` (it tried a deferred
    package) or ``{"failed": why}``."""
    read_end, write_end = os.pipe()

    def child() -> int:
        os.close(read_end)
        runtime.die_with_parent()
        blocked_before = len(blocker.stacks) if blocker is not None else 0
        before = set(sys.modules)
        with learn.ImportEffects() as effects:
            entry = import_entry(module, probe)
        if is_dirty(entry):
            found: dict = {"dirty": verdict_for(entry)}
        elif blocker is not None and len(blocker.stacks) > blocked_before:
            found = {"deferred": True}
        elif not entry.ok:
            found = {"failed": (entry.error or "import failed")[:200]}
        else:
            why = effects.describe() or learn.reaches_test_runner(before)
            found = {"unlearnable": why} if why else {}
        os.write(write_end, json.dumps(found).encode() + b"\n")
        return 0

    pid = runtime.fork(child)
    os.close(write_end)
    try:
        text = _read_line(read_end, TIMEOUT_S)
    finally:
        os.close(read_end)
        runtime.signal_group(pid, signal.SIGKILL)  # its own group: what it started goes too
        _, status = os.waitpid(pid, 0)
    if text is None:
        return {"failed": f"its import took over {TIMEOUT_S:.0f} s in a child"}
    if not text:
        code = os.waitstatus_to_exitcode(status)
        return {"failed": f"a child importing it ended with {code} before it answered"}
    return json.loads(text)


def _read_line(fd: int, timeout: float) -> Optional[bytes]:
    """The child's one line (b"" if it ended without one: a process its import started may
    hold the pipe after it, so the line's end, not EOF, ends the answer); None if it takes
    over ``timeout``."""
    text = b""
    while not text.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return b""
        text += chunk
    return text
