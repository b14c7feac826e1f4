"""A torchrun launch that torch elastic's own agent drives, with only its workers' start
replaced: multi-node launches (c10d rendezvous at any endpoint, static ``--node-rank``) and
elastic ones (``--max-restarts``). The
rendezvous, membership, timeouts, the per-worker environment, failure propagation and the
failure report are torch's ``launch_agent`` and ``LocalElasticAgent``, run as torchrun runs
them. Where that agent calls ``start_processes``, this module's ``ForkedContext`` (torch's
``SubprocessContext`` with a forked start) hands each worker's command and environment to a
rank forked from the zygote, so torch's own polling, closing and log tailing apply unchanged.

Ranks are forked before the rendezvous starts its threads (the agent is still a single thread):
one set for each start the launch may make, its first and one per restart, up to
``PRELOAD_LAUNCHER_MAX_RANKS`` ranks in all. A start that finds no forked set left (more
restarts than that, or torch restarting its workers for a membership change) is torch's own
``start_processes``: fresh interpreters, as torchrun starts them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import time
from typing import Callable, Iterator, Optional

from .. import process_attrs, protocol
from ..caller_fds import open_stdio
from ..command import PythonTarget, StepSpec, parse_python_argv
from ..step import runtime
from . import elastic
from .ranks import RankHandle, fork_waiting_ranks, release_ranks, signal_rank

__all__ = ["needs_torch_agent", "serve_with_torch_agent"]


def needs_torch_agent(args, config, local_hosts: set[str]) -> str:
    """Why torch elastic's own agent drives this launch ('' when the agent of ``agent``
    serves it): what takes more than one node to decide."""
    if config.max_restarts:
        return f"--max-restarts={config.max_restarts}"
    if (config.min_nodes, config.max_nodes) != (1, 1):
        return f"multi-node launch (nnodes={config.min_nodes}:{config.max_nodes})"
    if args.node_rank:
        return f"--node-rank={args.node_rank}"
    host = (config.rdzv_endpoint or "").rsplit(":", 1)[0].strip("[]")
    if config.rdzv_backend == "c10d" and host not in local_hosts:
        return f"remote rendezvous endpoint {config.rdzv_endpoint}"
    return ""


def serve_with_torch_agent(spec: StepSpec, state: runtime.ZygoteState, config, cmd: str,
                           cmd_args: list[str], warm_ranks: dict[int, RankHandle],
                           recorded: bool, temp_log_dir: str, max_ranks: int) -> int:
    """torchrun's ``run()`` after ``config_from_args``: ``elastic_launch`` of the command, under
    ``@record`` when ``recorded`` (else what it raises is the caller's), with forked workers."""
    from torch.distributed.launcher.api import elastic_launch
    if len(warm_ranks) != config.nproc_per_node:
        release_ranks(warm_ranks)
        warm_ranks = {}
    n = config.nproc_per_node
    sets = [warm_ranks] if warm_ranks else []
    while len(sets) < min(1 + config.max_restarts, max(1, max_ranks // n)):
        sets.append(fork_waiting_ranks(n, state, warm_cuda=False, close_fds=_sockets_of(sets)))
    start = ForkedStart(spec, sets)
    code: Optional[int] = None
    try:
        with start.replacing_torchs():
            if recorded:
                code = elastic.run_recorded(lambda: elastic_launch(config, cmd)(*cmd_args))
            else:
                elastic_launch(config, cmd)(*cmd_args)
    finally:
        start.finish(code, temp_log_dir)
    return code or 0


def _sockets_of(sets: list[dict[int, RankHandle]]) -> tuple[int, ...]:
    """The agent's ends of ranks forked earlier: a rank forked later must not hold them (a
    waiting rank learns of its release by EOF)."""
    return tuple(h.sock.fileno() for handles in sets for h in handles.values())


class ForkedStart:
    """torch elastic's ``start_processes`` for one launch: each start of a binary's workers
    goes to the next set of ranks forked for it while there is one; any other is torch's own."""

    def __init__(self, spec: StepSpec, sets: list[dict[int, RankHandle]]) -> None:
        self.spec = spec
        self.sets = sets  # per start to come: local rank -> forked rank waiting for orders
        self.contexts: list = []  # the ForkedContexts started

    @contextlib.contextmanager
    def replacing_torchs(self) -> Iterator[None]:
        """While active, torch's local agent starts its workers through ``self``."""
        from torch.distributed.elastic.agent.server import local_elastic_agent
        real = local_elastic_agent.start_processes
        local_elastic_agent.start_processes = lambda *a, **kw: self(real, *a, **kw)
        try:
            yield
        finally:
            local_elastic_agent.start_processes = real

    def __call__(self, real: Callable, name, entrypoint, args, envs, logs_specs,
                 log_line_prefixes=None, start_method="spawn", numa_options=None,
                 duplicate_stdout_filters=None, duplicate_stderr_filters=None):
        targets = self.targets(entrypoint, args) if not numa_options else None
        if targets is None:
            return real(name, entrypoint, args, envs, logs_specs, log_line_prefixes,
                        start_method, numa_options, duplicate_stdout_filters,
                        duplicate_stderr_filters)
        handles = self.sets.pop(0)
        context = forked_context_class()(
            name, entrypoint, args, envs, logs_specs, log_line_prefixes,
            duplicate_stdout_filters=duplicate_stdout_filters,
            duplicate_stderr_filters=duplicate_stderr_filters)
        context.forked = (self.spec, handles, targets)
        self.contexts.append(context)
        try:
            context.start()
        except Exception:
            context.close()
            raise
        return context

    def targets(self, entrypoint, args) -> Optional[dict[int, PythonTarget]]:
        """Each local rank's python program, if the forked ranks can run them all."""
        if not self.sets or not isinstance(entrypoint, str) or set(args) != set(self.sets[0]):
            return None
        targets = {}
        for rank, rank_args in args.items():
            target = parse_python_argv([entrypoint, *map(str, rank_args)])
            if not isinstance(target, PythonTarget):
                return None
            target.executable = entrypoint
            targets[rank] = target
        return targets

    def finish(self, code: Optional[int], temp_log_dir: str) -> None:
        """Report the launch's exit code (None: the caller will), then reap every forked rank:
        none outlives its agent. Ranks never started exit on EOF."""
        if temp_log_dir:
            import shutil
            shutil.rmtree(temp_log_dir, ignore_errors=True)
        if code is not None:
            runtime.flush_std_streams()
            runtime.report_exit(code)
        for handles in self.sets:
            release_ranks(handles)
        for context in self.contexts:
            for handler in context.subprocess_handlers.values():
                handler.proc.reap()


@functools.lru_cache(maxsize=None)
def forked_context_class():
    """``ForkedContext``, made on first use: torch is imported only by a launch that needs it."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    class ForkedContext(SubprocessContext):
        """torch's ``SubprocessContext`` whose workers are forked ranks: each gets the
        command's environment as ``SubprocessHandler`` builds it (the agent's, updated with
        the worker's) and its log files; polling, closing and tailing are torch's."""

        forked: tuple = ()

        def _start(self) -> None:
            spec, handles, targets = self.forked
            stdio = open_stdio()  # the agent's own, as torchrun's workers inherit them
            for rank, handle in handles.items():
                env = dict(os.environ, **self.envs[rank])
                orders = StepSpec(args=spec.args, env=env, cwd=os.getcwd(), target=targets[rank],
                                  stdout_file=self.stdouts.get(rank) or "",
                                  stderr_file=self.stderrs.get(rank) or "",
                                  thread_counts=spec.thread_counts, fd_targets=stdio,
                                  process=process_attrs.capture())  # the agent's, as Popen's
                protocol.send_request(handle.sock, orders.to_json_dict(), stdio)
                self.subprocess_handlers[rank] = ForkedHandler(ForkedProc(handle), rank)


    return ForkedContext


class ForkedHandler:
    """torch's ``SubprocessHandler`` of a forked rank: ``proc`` and ``close(death_sig)``."""

    def __init__(self, proc: "ForkedProc", local_rank: int) -> None:
        self.proc, self.local_rank_id = proc, local_rank

    def close(self, death_sig=None) -> None:
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler \
            import _get_default_signal
        signal_rank(self.proc.pid, death_sig or _get_default_signal())


class ForkedProc:
    """The ``Popen`` view torch's context takes of a forked rank: ``pid``, ``poll``, ``wait``.
    Its exit code is the one it reports before exiting (its teardown is off the agent's path),
    else its exit status."""

    def __init__(self, handle: RankHandle) -> None:
        self.pid, self.sock = handle.pid, handle.sock
        self.sock.setblocking(False)
        self.reader = protocol.EventReader()
        self.returncode: Optional[int] = None
        self.reaped = False

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.read_reports()
        if not self.reaped:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid:
                self.reaped = True
                if self.returncode is None:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def read_reports(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                return
            for event in self.reader.feed(data):
                if event.get("event") == "exit":
                    code = int(event["returncode"])  # as its exit status reads it
                    self.returncode = code & 0xFF if code >= 0 else code
                elif event.get("event") == "fresh":  # the caller hears why (rerun)
                    runtime.tell_caller("fresh", reason=event["reason"], rank=True)

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def reap(self) -> None:
        self.sock.close()
        if not self.reaped:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
            self.reaped = True

