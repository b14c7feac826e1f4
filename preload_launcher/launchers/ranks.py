"""A torchrun launch's ranks: forked (cold for the step, or ahead by the warm pool) before they
know their step, each waiting on its line to the agent for its orders, then becoming the
program's rank. Each leads a session of its own, as torchrun starts its workers.
"""

from __future__ import annotations

import os
import signal
import socket

from .. import cuda, protocol
from ..command import StepSpec
from ..step import child, runtime

__all__ = ["RankHandle", "fork_waiting_ranks", "release_ranks", "signal_rank"]


class RankHandle:
    """A forked rank waiting on ``sock`` for everything it needs to become its step's rank."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid, self.sock = pid, sock


def fork_waiting_ranks(n: int, state: runtime.ZygoteState, warm_cuda: bool,
                       close_fds: tuple[int, ...] = ()) -> dict[int, RankHandle]:
    """Fork n ranks that wait for their orders (and, pre-warmed, first make their CUDA context).
    Each leads a session of its own, as torchrun starts its workers (``start_new_session``):
    a signal to the agent's group is the agent's to forward. A rank dies with its agent."""
    ranks: dict[int, RankHandle] = {}
    for rank in range(n):
        agent_end, rank_end = socket.socketpair()
        others = [h.sock.fileno() for h in ranks.values()]

        def body(rank=rank, rank_end=rank_end, others=others) -> int:
            os.setsid()
            runtime.close_fds([agent_end.fileno(), *others, *close_fds])
            return wait_as_rank(rank, rank_end, state, warm_cuda)

        pid = runtime.fork(body, new_group=False)
        rank_end.close()
        ranks[rank] = RankHandle(pid, agent_end)
    return ranks


def release_ranks(ranks: dict[int, RankHandle]) -> None:
    """Waiting ranks that will not be used exit on EOF; reap them."""
    for handle in ranks.values():
        handle.sock.close()
    for handle in ranks.values():
        try:
            os.waitpid(handle.pid, 0)
        except ChildProcessError:
            pass


def wait_as_rank(rank: int, sock: socket.socket, state: runtime.ZygoteState,
                 warm_cuda: bool) -> int:
    """A rank's life: (make the CUDA context,) wait for its orders (a StepSpec), set up, run."""
    runtime.die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if warm_cuda:
        cuda.warm_context(rank, state.prewarm_cuda)
    try:
        orders, fds = protocol.recv_request_blocking(sock)
    except (OSError, ValueError):
        return 0  # released unused, or the agent gave up before the start
    runtime.keep_for_exit_report(sock.detach())  # the rank reports its exit code to the agent
    spec = StepSpec.from_json_dict(orders)
    runtime.set_up(spec, state, fds)
    return child.run_python_step(spec.target, state, None)


def signal_rank(pid: int, signum: int) -> None:
    """A rank's group, as torch elastic's ``SubprocessHandler.close`` signals it (the rank
    itself while it has not made its session yet)."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
