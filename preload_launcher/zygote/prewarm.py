"""The warm start strategy: the next steps' processes forked ahead, their CUDA contexts made.

The pool keeps one child for a single-rank step and, with ``prewarm_ranks``, one torchrun
agent whose ranks made theirs. Each waits on a socket for exactly one step, then becomes it
through the same ``become.become_step`` as a cold fork; a step whose CUDA-relevant environment
differs from the zygote's is forked cold instead.
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Callable, Mapping, Optional

from .. import cuda, protocol
from ..launchers.ranks import fork_waiting_ranks, release_ranks
from ..step import become, runtime

__all__ = ["WarmPool", "cuda_env"]

# Environment that shapes a CUDA context: a warm child serves only steps that agree on it.
WARM_ENV_PREFIXES = ("CUDA_", "NVIDIA_", "PYTORCH_CUDA", "PYTORCH_NVML", "TORCH_CUDA", "NCCL_",
                     "LD_", "PRELOAD_LAUNCHER_PROBE")


def cuda_env(env: Mapping[str, str]) -> dict:
    return {k: v for k, v in env.items() if k.startswith(WARM_ENV_PREFIXES)}


class WarmChild:
    """A child forked ahead of its step, waiting on ``sock`` for one."""

    def __init__(self, pid: int, sock: socket.socket, env: dict) -> None:
        self.pid, self.sock, self.env = pid, sock, env


def wait_as_warm_child(sock: socket.socket, state: runtime.ZygoteState) -> int:
    """Make the context, wait for one step, become it."""
    runtime.die_with_parent()
    cuda.warm_context(0, state.prewarm_cuda)
    return become_handed_step(sock, state, None)


def wait_as_warm_agent(sock: socket.socket, state: runtime.ZygoteState, nproc: int) -> int:
    """Fork ``nproc`` ranks that make their CUDA contexts now, then wait for one torchrun step;
    ranks that do not fit it are released."""
    runtime.die_with_parent()
    ranks = fork_waiting_ranks(nproc, state, warm_cuda=True, close_fds=(sock.fileno(),))
    return become_handed_step(sock, state, ranks)


def become_handed_step(sock: socket.socket, state: runtime.ZygoteState,
                       warm_ranks: Optional[dict]) -> int:
    """Wait for the zygote to hand over one step (with the caller's connection last among its
    fds), then become it; nothing to serve (the zygote went away or restarted): exit 0."""
    try:
        spec, fds = protocol.recv_request_blocking(sock)
    except (OSError, ValueError):
        release_ranks(warm_ranks or {})
        return 0
    *step_fds, conn_fd = fds
    state.zygote_fds = [sock.fileno()]  # closed by the step's set-up
    return become.become_step(spec, step_fds, conn_fd, state, warm_ranks=warm_ranks)


class WarmPool:
    """Children forked ahead, by kind ("python", "torchrun")."""

    def __init__(self, ranks: int, state: Callable[..., runtime.ZygoteState]) -> None:
        self.sizes = {"python": 1, "torchrun": ranks}
        self.state = state  # what a child needs of the zygote, as of the fork
        self.waiting: dict[str, Optional[WarmChild]] = {kind: None for kind in self.sizes}
        self.served = 0

    def fill(self) -> None:
        """Fork the missing children (the zygote checked that it may fork)."""
        for kind, nproc in self.sizes.items():
            if self.waiting[kind] is None and nproc > 0:
                self.waiting[kind] = self._fork(kind, nproc)

    def _fork(self, kind: str, nproc: int) -> WarmChild:
        zygote_end, child_end = socket.socketpair()
        state = self.state(keep=[zygote_end.fileno(), child_end.fileno()])

        def body() -> int:
            zygote_end.close()
            runtime.close_fds(state.zygote_fds)  # the waiting child holds nothing of the zygote's
            state.zygote_fds = []
            if kind == "torchrun":
                return wait_as_warm_agent(child_end, state, nproc)
            return wait_as_warm_child(child_end, state)

        pid = runtime.fork(body)
        child_end.close()
        return WarmChild(pid, zygote_end, cuda_env(os.environ))

    def hand_over(self, spec: dict, fds: list[int], conn: socket.socket) -> Optional[int]:
        """Give the step to a waiting child of its kind when its CUDA-relevant environment
        matches; returns its pid, or None to fork a cold child."""
        kind = "torchrun" if spec.get("torchrun_args") is not None else "python"
        warm = self.waiting.get(kind)
        # An accelerate launch forks its program: it must not start from a CUDA context.
        if (warm is None or spec.get("spawned") or spec.get("accelerate_args") is not None
                or cuda_env(spec.get("env") or {}) != warm.env):
            return None
        self.waiting[kind] = None
        try:
            protocol.send_request(warm.sock, spec, [*fds, conn.fileno()])
        except OSError:
            runtime.signal_group(warm.pid, signal.SIGKILL)  # it died waiting: reaped as a non-step
            return None
        finally:
            warm.sock.close()
        self.served += 1
        return warm.pid

    def reaped(self, pid: int) -> None:
        """A waiting child died (or its zygote killed it): it serves nothing any more."""
        for kind, warm in self.waiting.items():
            if warm is not None and warm.pid == pid:
                warm.sock.close()
                self.waiting[kind] = None

    def empty(self) -> None:
        """The zygote stops serving: the waiting children go (none holds a CUDA context for
        a step that will not come)."""
        for kind, warm in self.waiting.items():
            if warm is not None:
                runtime.signal_group(warm.pid, signal.SIGKILL)  # reaped as a non-step
                warm.sock.close()
                self.waiting[kind] = None

    def pid(self, kind: str) -> Optional[int]:
        warm = self.waiting.get(kind)
        return warm.pid if warm else None
