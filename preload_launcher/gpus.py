"""GPU packing (``PRELOAD_LAUNCHER_GPUS``): steps share a machine's GPUs without sharing one.

Every step of every worker on a machine passes through the shared zygote, so the zygote is
where GPUs are handed out: each step asks for what it needs (a torchrun or accelerate launch:
its process count; a python step: one; none when its environment hides the GPUs), gets free
ones as its ``CUDA_VISIBLE_DEVICES``, waits first come, first served until enough are free, and
gives them back when its process is reaped (its ranks and leftovers are gone by then).
"""

from __future__ import annotations

import collections
import socket
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

from . import cuda, protocol

__all__ = ["GpuPool", "Waiting", "pool_ids"]

HIDDEN = ("", "-1")  # CUDA_VISIBLE_DEVICES values that hide every GPU


def pool_ids(wanted: str, visible: Optional[str], device_count: int) -> list[str]:
    """The GPUs to pack steps onto: an explicit list, or ``auto``: the starter's
    ``CUDA_VISIBLE_DEVICES`` entries where it has one, else every GPU NVML counts."""
    if not wanted:
        return []
    if wanted != "auto":
        return [part.strip() for part in wanted.split(",") if part.strip()]
    if visible is not None:
        return [] if visible in HIDDEN else [part.strip() for part in visible.split(",")]
    return [str(i) for i in range(device_count)]


@dataclass
class Waiting:
    """A step waiting for GPUs: its request, kept until it can start."""

    conn: socket.socket
    spec: dict
    fds: list[int]
    need: int
    since: float = field(default_factory=time.monotonic)
    reader: protocol.EventReader = field(default_factory=protocol.EventReader)


class GpuPool:
    def __init__(self, ids: list[str], visible: Optional[str]) -> None:
        self.ids = list(ids)
        self.free = list(ids)
        self.visible = visible  # the starter's CUDA_VISIBLE_DEVICES: a step with another is its own
        self.queue: collections.deque[Waiting] = collections.deque()
        self.held: dict[int, list[str]] = {}  # step pid -> its GPUs
        self.granted_steps = 0
        self.waited_s = 0.0  # all granted steps' waits together

    def need_of(self, spec: dict) -> int:
        """How many GPUs the step asks for (never more than the pool has)."""
        env = spec.get("env") or {}
        if spec.get("spawned") or env.get("CUDA_VISIBLE_DEVICES") != self.visible:
            return 0  # a step's own multiprocessing child, or a step that chose its devices
        if spec.get("torchrun_args") is not None:
            need = _torchrun_processes(spec["torchrun_args"], len(self.ids))
        elif spec.get("accelerate_args") is not None:
            need = _accelerate_processes(spec["accelerate_args"])
        else:
            need = 1
        return min(need, len(self.ids))

    def wait(self, waiting: Waiting) -> None:
        self.queue.append(waiting)

    def forget(self, waiting: Waiting) -> None:
        if waiting in self.queue:
            self.queue.remove(waiting)

    def grants(self) -> Iterator[tuple[Waiting, list[str]]]:
        """Waiting steps that can start now, in arrival order (a larger request at the head
        holds back smaller ones behind it, so it is never starved)."""
        while self.queue and self.queue[0].need <= len(self.free):
            waiting = self.queue.popleft()
            granted, self.free = self.free[:waiting.need], self.free[waiting.need:]
            self.granted_steps += 1
            self.waited_s += time.monotonic() - waiting.since
            yield waiting, granted

    def hold(self, pid: int, granted: list[str]) -> None:
        self.held[pid] = granted

    def release(self, pid: int) -> bool:
        """The step's process is gone: its GPUs are free again. True when it held any."""
        granted = self.held.pop(pid, None)
        if not granted:
            return False
        self.free = [i for i in self.ids if i in self.free or i in granted]
        return True

    def describe(self) -> dict:
        return {"pool": self.ids, "free": self.free, "waiting": len(self.queue),
                "held": {str(pid): ids for pid, ids in self.held.items()},
                "granted_steps": self.granted_steps, "waited_s": round(self.waited_s, 3)}


def _torchrun_processes(args: list[str], pool: int) -> int:
    """``--nproc-per-node`` as torchrun's own parser reads it (``gpu``/``auto``: the pool)."""
    from torch.distributed import run as torchrun
    try:
        value = str(torchrun.get_args_parser().parse_known_args(args)[0].nproc_per_node)
    except SystemExit:
        return 1  # torchrun itself will report the usage error
    return int(value) if value.isdigit() else pool


def _accelerate_processes(args: list[str]) -> int:
    """``--num_processes`` as accelerate's parser reads it (1 when not given). Imported in the
    zygote under the preload's CUDA rules; the zygote checks the driver before every fork."""
    with cuda.cuda_safe_imports():
        from accelerate.commands.launch import launch_command_parser
    try:
        parsed = launch_command_parser().parse_known_args(args)[0]
    except SystemExit:
        return 1
    return max(1, parsed.num_processes or 1)
