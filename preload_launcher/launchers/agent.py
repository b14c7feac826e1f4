"""Stage 4b: a multi-rank step. A forked child that parses torchrun's arguments with torchrun's
own parser (``torchrun_config``), forks N sibling ranks with torchrun's environment contract,
hosts the rendezvous store as torchrun's agent does, and supervises the ranks all-or-nothing.
What torch elastic decides at the edges (signals, failure reports, error files) is its own code
(``elastic``); where ranks meet and what they are given, ``rendezvous``. A launch beyond one
node is torch elastic's own agent with forked workers (``torch_agent``).

The agent never touches CUDA. Ranks are forked *before* the store starts its thread, so every
rank is forked from a single-threaded process.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import shutil
import signal
import socket
import sys
import time
from typing import Optional

from .. import cuda, process_attrs, protocol
from ..caller_fds import open_stdio
from ..command import (PythonTarget, StepSpec, Unsupported, launcher_interpreter, launcher_path0,
                       parse_python_argv)
from ..settings import Settings
from ..step import runtime
from . import elastic, rendezvous, torch_agent
from .ranks import RankHandle, fork_waiting_ranks, release_ranks, signal_rank
from .torchrun_config import configure_launch, parse_torchrun_args, unsupported_reason

__all__ = ["run_agent", "serve_launch", "unsupported_reason"]


def run_agent(spec: StepSpec, state: runtime.ZygoteState, conn_fd: int,
              warm_ranks: Optional[dict[int, "RankHandle"]] = None) -> int:
    """Serve one torchrun step; ``warm_ranks`` (local rank -> pre-forked rank) are used when
    they fit the launch and released otherwise."""
    try:
        try:
            args = parse_torchrun_args(spec)
        except SystemExit as exc:  # argparse already printed torchrun's usage error
            protocol.send_event(conn_fd, "exec", t=time.time())
            return exc.code if isinstance(exc.code, int) else 1
        # torchrun runs its ranks with its own interpreter's sys.executable.
        sys.executable = launcher_interpreter(spec.args, spec.env, spec.cwd)
        return serve_launch(spec, state, conn_fd, args, warm_ranks or {})
    finally:
        release_ranks(warm_ranks or {})


def serve_launch(spec: StepSpec, state: runtime.ZygoteState, conn_fd: int, args,
                 warm_ranks: Optional[dict] = None, recorded: bool = True) -> int:
    """Serve a launch described by torchrun's arguments (``args``, a namespace from torchrun's
    parser, or from another launcher that hands its launch to torchrun's ``run()``).
    ``recorded``: the launch runs under torchrun's ``@record`` ``main`` (its error file, its
    traceback and exit status 1); else what ``run()`` raises is the caller's to handle."""
    warm_ranks = warm_ranks or {}
    try:
        args, config, cmd, cmd_args = configure_launch(args)
    except ValueError as exc:
        protocol.send_event(conn_fd, "fallback", reason=f"torchrun: {exc}", retire=False)
        return 0
    # torchrun's temporary log directory (error files, redirected output) goes with the
    # launch, served or not; torchrun itself leaves it in the temporary directory.
    temp_log_dir = config.logs_specs.root_log_dir if config is not None and not args.log_dir else ""
    try:
        return _serve_configured(spec, state, conn_fd, args, config, (cmd, cmd_args), warm_ranks,
                                 recorded, temp_log_dir)
    finally:
        if temp_log_dir:
            shutil.rmtree(temp_log_dir, ignore_errors=True)


def _serve_configured(spec, state, conn_fd, args, config, command, warm_ranks, recorded,
                      temp_log_dir) -> int:
    cmd, cmd_args = command
    reason = "nproc_per_node=gpu without NVML" if config is None else unsupported_reason(args, config)
    wanted = Settings.from_env()
    max_ranks = wanted.max_ranks
    if not reason and config.nproc_per_node > max_ranks:
        # torchrun would try to start them all; refuse the way torchrun refuses bad values.
        protocol.send_event(conn_fd, "exec", t=time.time())
        print(f"ValueError: --nproc-per-node={config.nproc_per_node} exceeds the limit of "
              f"{max_ranks} local ranks (PRELOAD_LAUNCHER_MAX_RANKS)", file=sys.stderr)
        return 1
    if not reason and cuda.fork_refusal(cuda.probe_for(wanted)):
        reason = "the agent initialised CUDA while parsing; ranks cannot be forked from it"
    if reason:
        protocol.send_event(conn_fd, "fallback", reason=reason, retire=False)
        return 0
    if args.run_path:  # runpy.run_path(path) in a worker spawned with the agent's sys.path
        target = PythonTarget(kind="script", value=cmd_args[0], args=list(cmd_args[1:]),
                              prog=sys.executable, executable=sys.executable,
                              run_path_from=launcher_path0(spec.args, spec.env, spec.cwd))
    else:
        target = parse_python_argv([cmd, *cmd_args])
        if isinstance(target, Unsupported):
            protocol.send_event(conn_fd, "fallback", reason=target.reason, retire=False)
            return 0
        target.executable = cmd
    protocol.send_event(conn_fd, "exec", t=time.time())
    runtime.keep_for_exit_report(conn_fd)
    if torch_agent.needs_torch_agent(args, config, rendezvous.LOCAL_HOSTS):  # beyond one node
        return torch_agent.serve_with_torch_agent(spec, state, config, cmd, cmd_args, warm_ranks,
                                                  recorded, temp_log_dir, max_ranks)
    if len(warm_ranks) != config.nproc_per_node:
        release_ranks(warm_ranks)
        warm_ranks.clear()
    agent = Agent(spec, state, config, target, warm_ranks, temp_log_dir)
    if not recorded:  # the caller's launcher reads what torchrun's run() raises
        try:
            agent.launch()
        finally:
            agent.finish(None)
        return 0
    code = elastic.run_recorded(agent.launch)
    agent.finish(code)
    return code


class Agent:
    def __init__(self, spec: StepSpec, state: runtime.ZygoteState, config, target: PythonTarget,
                 warm_ranks: Optional[dict[int, RankHandle]] = None, temp_log_dir: str = ""):
        self.spec = spec
        self.temp_log_dir = temp_log_dir  # removed before the exit report: nothing left after
        self.state = state
        self.config = config
        self.target = target
        # torchrun's own log layout: <log_dir>/<run_id>/attempt_0/<rank>/{stdout,stderr}.log,
        # error.json; a temporary log_dir when none is given.
        self.logs = config.logs_specs.reify(
            {r: {"TORCHELASTIC_RUN_ID": config.run_id, "TORCHELASTIC_RESTART_COUNT": "0"}
             for r in range(config.nproc_per_node)})
        self.tails: list = []
        self.handles: dict[int, RankHandle] = dict(warm_ranks or {})  # local rank -> waiting rank
        self.ranks: dict[int, int] = {}  # pid -> local rank, until its exit code is known
        self.alive: set[int] = set()  # rank pids not reaped yet (a rank reports, then exits)
        self.reports: dict[int, socket.socket] = {}  # pid -> where the rank reports its code
        self.readers: dict[int, protocol.EventReader] = {}  # pid -> that connection's reader
        self.failures: dict = {}  # local rank -> torch's ProcessFailure, in the order seen
        self.store = None  # the rendezvous store the agent hosts

    def send_orders(self, addr: str, port: int) -> None:
        """Everything a rank needs: its env (torchrun's contract), cwd, target, log files, stdio."""
        envs = rendezvous.rank_envs(self.config, addr, port, self.logs.error_files,
                                    dict(os.environ))
        stdio = open_stdio()  # the agent's own, as torchrun's ranks inherit them
        for rank, handle in self.handles.items():
            target = dataclasses.replace(self.target,
                                         args=rendezvous.rank_args(self.target.args, rank))
            orders = StepSpec(args=self.spec.args, env=envs[rank], cwd=os.getcwd(),
                              target=target, stdout_file=self.logs.stdouts.get(rank, ""),
                              stderr_file=self.logs.stderrs.get(rank, ""),
                              thread_counts=self.spec.thread_counts, fd_targets=stdio,
                              process=process_attrs.capture())  # what torchrun's Popen passes on
            protocol.send_request(handle.sock, orders.to_json_dict(), stdio)
            self.reports[handle.pid] = handle.sock
            self.readers[handle.pid] = protocol.EventReader()

    def start_tails(self) -> None:
        """--tee: copy each rank's log to the step's output with torchrun's line prefix."""
        if not (self.logs.tee_stdouts or self.logs.tee_stderrs):
            return
        from string import Template
        from torch.distributed.elastic.multiprocessing.tail_log import TailLog
        template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
        prefixes = None
        if template:
            prefixes = {r: Template(template).safe_substitute(role_name=self.config.role, rank=r,
                                                               local_rank=r)
                        for r in range(self.config.nproc_per_node)}
        self.tails = [TailLog(self.config.role, self.logs.tee_stdouts, sys.stdout, prefixes).start(),
                      TailLog(self.config.role, self.logs.tee_stderrs, sys.stderr, prefixes).start()]

    def stop_tails(self) -> None:
        for tail in self.tails:
            tail.stop()
        sys.stdout.flush()

    def start_store(self, addr: str, port: int):
        from torch.distributed import TCPStore
        return TCPStore(addr, port,
                        world_size=self.config.nproc_per_node, is_master=True,
                        wait_for_workers=False, use_libuv=True)

    def launch(self) -> None:
        """torch elastic's ``agent.run()`` for this launch's one attempt: returns when every
        rank succeeded; raises ``SignalException`` for a handled signal (the ranks get the same
        signal, once) and ``ChildFailedError`` for failed ranks (the others are terminated)."""
        from torch.distributed.elastic.multiprocessing.api import SignalException
        replaced = elastic.handle_signals(self.config.signals_to_handle)
        try:
            if not self.handles:
                self.handles = fork_waiting_ranks(self.config.nproc_per_node, self.state,
                                                  warm_cuda=False)
            self.ranks = {h.pid: rank for rank, h in self.handles.items()}
            self.alive = set(self.ranks)
            try:
                self.start_ranks()
                self.wait_all()
            except SignalException as stop:
                elastic.log_death_signal(stop.sigval)
                self.close(stop.sigval, self.config.shutdown_timeout)
                raise
            except BaseException:
                self.close(signal.SIGKILL, 0)
                raise
        finally:
            self.stop_tails()
            elastic.restore_signals(replaced)
        if self.failures:
            elastic.log_first_failure(self.failures, self.target.prog)
            raise elastic.child_failed(self.target.value, self.failures)

    def start_ranks(self) -> None:
        """Host the store (its thread starts after every rank was forked), hand out orders."""
        addr, port = rendezvous.store_endpoint(self.config)
        self.store = self.start_store(addr, port)  # served while the agent holds it
        self.start_tails()
        self.send_orders(addr, self.store.port)
        self.handles.clear()

    def wait_all(self) -> None:
        """Collect each rank's exit code, from its report or else its exit status; a failure
        stops the others (all-or-nothing), whose codes are collected too. Like torch's agent,
        which looks at its ranks once per monitor interval, the ranks that fail within one
        interval of the first are failures alike, in local-rank order."""
        with RankWatch(self.reports) as watch:
            while self.ranks:
                failed = [end for end in self.finished(watch) if end[2] != 0]
                if failed:
                    deadline = time.monotonic() + self.config.monitor_interval
                    while self.ranks and time.monotonic() < deadline:
                        watch.wait(max(0.0, deadline - time.monotonic()))
                        failed += [end for end in self.finished(watch) if end[2] != 0]
                    for rank, pid, code in sorted(failed):
                        self.record_failure(rank, pid, code)
                    self.close(signal.SIGTERM, self.spec.grace_s, watch)
                    return
                if self.ranks:
                    watch.wait(None)

    def finished(self, watch: Optional["RankWatch"]) -> list[tuple[int, int, int]]:
        """(local rank, pid, exit code) of the ranks that ended since the last call."""
        ended = []
        for pid, code in self.reaped() + (watch.reported(self.readers) if watch else []):
            rank = self.ranks.pop(pid, None)
            if rank is not None:
                ended.append((rank, pid, code))
        return ended

    def reaped(self) -> list[tuple[int, int]]:
        """(pid, exit code) of ranks that exited since the last call."""
        done = []
        while self.alive:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in self.alive:
                self.alive.discard(pid)
                done.append((pid, os.waitstatus_to_exitcode(status)))
        return done

    def record_failure(self, rank: int, pid: int, code: int) -> None:
        self.failures[rank] = elastic.process_failure(rank, pid, code,
                                                      self.logs.error_files.get(rank, ""))

    def close(self, death_sig: int, timeout: float, watch: Optional["RankWatch"] = None) -> None:
        """torch elastic's ``_close``: ``death_sig`` once to each running rank's group, up to
        ``timeout`` for them to end, then SIGKILL; the codes of those that fail are failures."""
        for pid in self.ranks:
            elastic.log_closing(pid, death_sig)
            signal_rank(pid, death_sig)
        deadline = time.monotonic() + timeout
        while self.ranks and time.monotonic() < deadline:
            ended = self.finished(watch)
            for rank, pid, code in ended:
                if code != 0:
                    self.record_failure(rank, pid, code)
            if self.ranks and not ended:
                if watch:
                    watch.wait(max(0.0, deadline - time.monotonic()))
                else:
                    time.sleep(0.05)
        for pid in self.ranks:
            signal_rank(pid, signal.SIGKILL)
        self.ranks.clear()

    def finish(self, code: Optional[int]) -> None:
        """Report the step's exit code (None: the caller will), then wait for the ranks'
        processes to be gone: their CUDA teardown is off the caller's path, and no rank
        outlives its agent."""
        if self.temp_log_dir:
            shutil.rmtree(self.temp_log_dir, ignore_errors=True)
        if code is not None:
            runtime.flush_std_streams()
            runtime.report_exit(code)
        for sock in self.reports.values():
            sock.close()
        for pid in list(self.alive):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.alive.clear()


class RankWatch:
    """Waits for the ranks' exit reports and for SIGCHLD (through the wakeup fd)."""

    def __init__(self, reports: dict[int, socket.socket]) -> None:
        self.reports = reports

    def __enter__(self) -> "RankWatch":
        self.wakeup_r, self.wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(self.wakeup_w, False)
        self.previous_chld = signal.signal(signal.SIGCHLD, lambda *_: None)  # for the wakeup fd
        self.previous_fd = signal.set_wakeup_fd(self.wakeup_w)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, None)
        for pid, sock in self.reports.items():
            self.selector.register(sock, selectors.EVENT_READ, pid)
        return self

    def __exit__(self, *_exc) -> None:
        signal.set_wakeup_fd(self.previous_fd)
        signal.signal(signal.SIGCHLD, self.previous_chld)
        self.selector.close()
        os.close(self.wakeup_r)
        os.close(self.wakeup_w)

    def wait(self, timeout: Optional[float]) -> None:
        for key, _ in self.selector.select(timeout):
            if key.data is None:
                protocol.drain(self.wakeup_r)

    def reported(self, readers: dict[int, protocol.EventReader]) -> list[tuple[int, int]]:
        """(pid, exit code) that ranks reported before exiting (a code as its exit status
        reads: ``sys.exit(256)`` is 0)."""
        done = []
        for key, _ in self.selector.select(0):
            if key.data is None:
                continue
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:
                self.selector.unregister(key.fileobj)
                continue
            for event in readers[key.data].feed(data):
                if event.get("event") == "exit":
                    code = int(event["returncode"])
                    done.append((key.data, code & 0xFF if code >= 0 else code))
                elif event.get("event") == "fresh":  # the caller hears why (rerun)
                    runtime.tell_caller("fresh", reason=event["reason"], rank=True)
        return done

