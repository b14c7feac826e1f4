"""Stage 4b: a multi-rank step. A forked child that parses torchrun's arguments with torchrun's
own parser, forks N sibling ranks with torchrun's environment contract, hosts the rendezvous
store as torchrun's agent does, and supervises the ranks all-or-nothing.

The agent never touches CUDA. Ranks are forked *before* the store starts its thread, so every
rank is forked from a single-threaded process.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from . import child, cuda, protocol, runtime
from .command import PythonTarget, StepSpec, parse_python_argv
from .settings import Settings
from .stdio import open_stdio

__all__ = ["run_agent", "serve_launch", "rank_envs", "unsupported_reason", "fork_waiting_ranks",
           "release_ranks", "RankHandle"]

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "", socket.gethostname()}


@dataclass
class RankFailure:
    """One failed rank, for torchrun's failure summary (torch elastic's ``ProcessFailure``)."""

    local_rank: int
    pid: int
    exitcode: int
    timestamp: float
    error_file: str = ""


class _Shutdown(Exception):
    """The agent was asked to stop (SIGTERM/SIGINT/SIGHUP/SIGQUIT), like torchrun's SignalException."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_shutdown(signum, _frame):
    raise _Shutdown(signum)


def resolve_nproc(value: str) -> Optional[str]:
    """``gpu``/``auto`` counted through NVML, never through a CUDA context; None if unknowable."""
    if value not in ("gpu", "auto"):
        return value
    count = cuda.nvml_device_count()
    if count > 0:
        return str(count)
    return str(os.cpu_count() or 1) if value == "auto" else None


def _explicit_master_port(argv: list[str]) -> bool:
    return any(a.split("=", 1)[0] in ("--master_port", "--master-port") for a in argv) \
        or "PET_MASTER_PORT" in os.environ


def unsupported_reason(args, config) -> str:
    """Why torchrun itself must run this launch ('' when the agent serves it)."""
    if (config.min_nodes, config.max_nodes) != (1, 1):
        return f"multi-node launch (nnodes={config.min_nodes}:{config.max_nodes})"
    if config.max_restarts:
        return f"--max-restarts={config.max_restarts}"
    if args.node_rank:
        return f"--node-rank={args.node_rank}"
    if config.rdzv_backend not in ("static", "c10d"):
        return f"rendezvous backend {config.rdzv_backend}"
    host = (config.rdzv_endpoint or "").rsplit(":", 1)[0].strip("[]")
    if config.rdzv_backend == "c10d" and host not in LOCAL_HOSTS:
        return f"remote rendezvous endpoint {config.rdzv_endpoint}"
    if args.no_python:
        return "--no-python"
    if getattr(args, "local_addr", None):
        return "--local-addr"
    if config.nproc_per_node < 1:
        return f"nproc_per_node={config.nproc_per_node}"
    return ""


def rank_envs(config, master_addr: str, master_port: int, error_files: dict[int, str],
              base_env: dict[str, str]) -> list[dict[str, str]]:
    """torchrun's per-worker environment (local_elastic_agent ``_start_workers``), one node."""
    n = config.nproc_per_node
    envs = []
    for rank in range(n):
        env = dict(base_env)
        env.update({
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_NAME": config.role,
            "LOCAL_WORLD_SIZE": str(n),
            "WORLD_SIZE": str(n),
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(n),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
            "TORCHELASTIC_RUN_ID": config.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": error_files.get(rank, ""),
            "TORCHELASTIC_SIGNALS_TO_HANDLE": getattr(config, "signals_to_handle",
                                                      "SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
        })
        envs.append(env)
    return envs


def _parse(spec: StepSpec):
    """torchrun's own parsing of the step's arguments (raises SystemExit on a usage error)."""
    from torch.distributed import run as torchrun
    # argparse names itself after argv[0]: "torchrun", or "run.py" under python -m.
    program = spec.args[0] if os.path.basename(spec.args[0]) == "torchrun" else torchrun.__file__
    sys.argv = [program, *spec.torchrun_args]
    return torchrun.parse_args(spec.torchrun_args)


def _configure(args):
    """What torchrun's ``run()`` makes of its arguments: (args, config, cmd, cmd_args)."""
    from torch.distributed import run as torchrun
    # The rendezvous defaults of torchrun's ``run()``, which config_from_args does not apply.
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint
                           and args.master_port is None
                           and torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    nproc = resolve_nproc(str(args.nproc_per_node))
    if nproc is None:
        return args, None, None, None
    args.nproc_per_node = nproc
    # LaunchConfig asks torch.cuda.is_available(); through cudaGetDeviceCount that poisons every
    # later fork, so the agent asks NVML instead, as the zygote's preload does.
    with cuda.cuda_safe_imports():
        config, cmd, cmd_args = torchrun.config_from_args(args)
    return args, config, cmd, cmd_args


def run_agent(spec: StepSpec, state: runtime.ZygoteState, conn_fd: int,
              warm_ranks: Optional[dict[int, "RankHandle"]] = None) -> int:
    """Serve one torchrun step; ``warm_ranks`` (local rank -> pre-forked rank) are used when
    they fit the launch and released otherwise."""
    try:
        try:
            args = _parse(spec)
        except SystemExit as exc:  # argparse already printed torchrun's usage error
            protocol.send_event(conn_fd, "exec", t=time.time())
            return exc.code if isinstance(exc.code, int) else 1
        return serve_launch(spec, state, conn_fd, args, _explicit_master_port(spec.torchrun_args),
                            warm_ranks or {})
    finally:
        release_ranks(warm_ranks or {})


def serve_launch(spec: StepSpec, state: runtime.ZygoteState, conn_fd: int, args,
                 explicit_port: bool, warm_ranks: Optional[dict] = None,
                 failure_code: Optional[int] = None) -> int:
    """Serve a launch described by torchrun's arguments (``args``, a namespace from torchrun's
    parser, or from another launcher that hands its launch to torchrun's ``run()``, which
    then exits ``failure_code`` when a rank failed)."""
    warm_ranks = warm_ranks or {}
    try:
        args, config, cmd, cmd_args = _configure(args)
    except ValueError as exc:
        protocol.send_event(conn_fd, "fallback", reason=f"torchrun: {exc}", retire=False)
        return 0
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
    if args.run_path:
        target = PythonTarget(kind="script", value=cmd_args[0], args=list(cmd_args[1:]),
                              prog=sys.executable)
    else:
        target = parse_python_argv([cmd, *cmd_args])
    protocol.send_event(conn_fd, "exec", t=time.time())
    runtime.keep_for_exit_report(conn_fd)
    if len(warm_ranks) != config.nproc_per_node:
        release_ranks(warm_ranks)
        warm_ranks.clear()
    agent = Agent(spec, state, args, config, target, explicit_port, warm_ranks)
    code = agent.run()
    if failure_code is not None and code > 0:
        code = failure_code
    agent.finish(code)
    return code


class RankHandle:
    """A forked rank waiting on ``sock`` for everything it needs to become its step's rank."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid, self.sock = pid, sock


def fork_waiting_ranks(n: int, state: runtime.ZygoteState, warm_cuda: bool,
                       close_fds: tuple[int, ...] = ()) -> dict[int, RankHandle]:
    """Fork n ranks that wait for their orders (and, pre-warmed, first make their CUDA context).
    They stay in the agent's process group: killing the step kills its ranks."""
    ranks: dict[int, RankHandle] = {}
    for rank in range(n):
        agent_end, rank_end = socket.socketpair()
        others = [h.sock.fileno() for h in ranks.values()]

        def body(rank=rank, rank_end=rank_end, others=others) -> int:
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


class Agent:
    def __init__(self, spec: StepSpec, state: runtime.ZygoteState, args, config, target: PythonTarget,
                 explicit_port: bool, warm_ranks: Optional[dict[int, RankHandle]] = None):
        self.spec = spec
        self.explicit_port = explicit_port
        self.state = state
        self.args = args
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
        self.failures: dict[int, RankFailure] = {}

    def master(self) -> tuple[str, int]:
        """Where the agent hosts the store: an explicit port is honoured, else a free one."""
        if self.config.rdzv_backend == "static":
            addr = self.args.master_addr
            port = int(self.args.master_port) if self.explicit_port \
                else int(os.environ.get("MASTER_PORT", 0))
            return addr, port
        host, _, port = (self.config.rdzv_endpoint or "localhost:0").rpartition(":")
        return host or "localhost", int(port or 0) or int(os.environ.get("MASTER_PORT", 0))

    def send_orders(self, addr: str, port: int) -> None:
        """Everything a rank needs: its env (torchrun's contract), cwd, target, log files, stdio."""
        envs = rank_envs(self.config, addr, port, self.logs.error_files, dict(os.environ))
        stdio = open_stdio()  # the agent's own, as torchrun's ranks inherit them
        for rank, handle in self.handles.items():
            orders = StepSpec(args=self.spec.args, env=envs[rank], cwd=os.getcwd(),
                              target=self.target, stdout_file=self.logs.stdouts.get(rank, ""),
                              stderr_file=self.logs.stderrs.get(rank, ""),
                              thread_counts=self.spec.thread_counts, fd_targets=stdio)
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

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(signum, _raise_shutdown)
        if not self.handles:
            self.handles = fork_waiting_ranks(self.config.nproc_per_node, self.state, warm_cuda=False)
        self.ranks = {h.pid: rank for rank, h in self.handles.items()}
        self.alive = set(self.ranks)
        try:
            addr, port = self.master()
            try:
                store = self.start_store(addr, port)
            except Exception as exc:
                print(f"[preload_launcher] cannot host the rendezvous store on {addr}:{port}: {exc}",
                      file=sys.stderr, flush=True)
                self.terminate(signal.SIGKILL)
                return 1
            self.start_tails()
            self.send_orders(addr, store.port)
            self.handles.clear()
            self.wait_all()
        except _Shutdown as stop:
            self.terminate(signal.SIGTERM)
            if not self.failures:
                return -stop.signum
        finally:
            self.stop_tails()
        if self.failures:
            self.report_failures()
            first = min(self.failures.values(), key=lambda f: f.timestamp)
            return first.exitcode
        return 0

    def wait_all(self) -> None:
        """Collect each rank's exit code, from its report or else its exit status; the first
        failure stops the others (all-or-nothing)."""
        wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(wakeup_r, False)
        os.set_blocking(wakeup_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler is needed for the wakeup fd
        previous = signal.set_wakeup_fd(wakeup_w)
        selector = selectors.DefaultSelector()
        selector.register(wakeup_r, selectors.EVENT_READ, None)
        for pid, sock in self.reports.items():
            selector.register(sock, selectors.EVENT_READ, pid)
        try:
            while self.ranks:
                for pid, code in self.reaped() + self.reported(selector):
                    rank = self.ranks.pop(pid, None)
                    if rank is not None and code != 0:
                        self.record_failure(rank, pid, code)
                        self.terminate(signal.SIGTERM)
                        return
                if self.ranks:
                    for key, _ in selector.select():
                        if key.data is None:
                            protocol.drain(wakeup_r)
        finally:
            signal.set_wakeup_fd(previous)
            selector.close()
            os.close(wakeup_r)
            os.close(wakeup_w)

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

    def reported(self, selector: selectors.BaseSelector) -> list[tuple[int, int]]:
        """(pid, exit code) that ranks reported before exiting."""
        done = []
        for key, _ in selector.select(0):
            if key.data is None:
                continue
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:
                selector.unregister(key.fileobj)
                continue
            for event in self.readers[key.data].feed(data):
                if event.get("event") == "exit":
                    done.append((key.data, int(event["returncode"])))
        return done

    def record_failure(self, rank: int, pid: int, code: int) -> None:
        self.failures[rank] = RankFailure(local_rank=rank, pid=pid, exitcode=code,
                                          timestamp=time.time(),
                                          error_file=self.logs.error_files.get(rank, ""))

    def terminate(self, signum: int) -> None:
        """SIGTERM the rest, wait one deadline, then SIGKILL (torch elastic's ``_close``)."""
        for pid in self.ranks:
            _kill(pid, signum)
        deadline = time.monotonic() + self.spec.grace_s
        while set(self.ranks) & self.alive and time.monotonic() < deadline:
            try:
                if not self.reaped():
                    time.sleep(0.05)
            except _Shutdown:
                break
        for pid in self.ranks:
            _kill(pid, signal.SIGKILL)
        self.ranks.clear()

    def finish(self, code: int) -> None:
        """Report the step's exit code, then wait for the ranks' processes to be gone: their
        CUDA teardown is off the caller's path, and no rank outlives its agent."""
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

    def report_failures(self) -> None:
        """Print torchrun's failure summary, root cause first, through its own formatter."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
        failures = {}
        for rank, f in self.failures.items():
            pf = ProcessFailure(local_rank=f.local_rank, pid=f.pid, exitcode=f.exitcode,
                                error_file=f.error_file)
            if not os.path.isfile(f.error_file):
                pf.timestamp = int(f.timestamp)
            failures[rank] = pf
        name = self.target.value
        error = ChildFailedError(name=name, failures=failures)
        sys.stdout.flush()
        print(f"{type(error).__module__}.{type(error).__name__}: \n{error.format_msg()}",
              file=sys.stderr, flush=True)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
