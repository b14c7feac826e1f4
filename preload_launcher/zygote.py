"""Stage 3: the zygote. Preloads, proves it is fork-clean, then forks one child per request.

One selector loop and no threads: a listener, a SIGCHLD wakeup fd, the starter's "alive" pipe,
and one connection per running step (its EOF means the caller died: the step is killed). The
zygote decodes only the request envelope; the child decodes the step.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from typing import Optional

from . import learn, protocol, spawn_proxy
from .child import ZygoteState, become_step, wait_as_warm_child
from .settings import IMPORT_ENV_KEYS
from .preload import (PreloadReport, VerdictCache, native_threads, package_fingerprint, preload,
                      preload_learned, probe_from_env, recording_env_reads,
                      torch_cuda_initialized, verdict_for)

__all__ = ["main", "BOOTSTRAP"]



def say(fmt: str, *args) -> None:
    """Log to the zygote's stderr (its log file). The root logger stays unconfigured: children
    inherit it, and a fresh interpreter has no handlers."""
    print(time.strftime("%H:%M:%S"), f"zygote[{os.getpid()}]", fmt % args, file=sys.stderr,
          flush=True)

SKIP_ENV = "_PRELOAD_LAUNCHER_QUARANTINE"
LEARNED = "learned:"  # verdict-cache prefix for learned modules
MAX_LEARNED_QUARANTINES = 5
RESTART_ENV = "_PRELOAD_LAUNCHER_RESTARTED"  # set across a staleness re-exec: stay quiet
REQUEST_READ_TIMEOUT_S = 10.0

# Started as ``python -c BOOTSTRAP PKG_PARENT CONFIG_JSON``: sys.path keeps what a fresh
# interpreter has (minus sys.path[0]), whether or not the package is installed.
BOOTSTRAP = (
    "import sys; base = sys.path[1:]; sys.path.insert(0, sys.argv[1]); "
    "from preload_launcher import zygote; sys.path[:] = base; "
    "zygote.main(sys.argv[2], base)"
)


# Environment that shapes a CUDA context: a warm child serves only steps that agree on it.
WARM_ENV_PREFIXES = ("CUDA_", "NVIDIA_", "PYTORCH_CUDA", "PYTORCH_NVML", "TORCH_CUDA", "NCCL_",
                     "LD_", "PRELOAD_LAUNCHER_PROBE")


def cuda_env(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(WARM_ENV_PREFIXES)}


class WarmChild:
    """A child forked ahead of its step: CUDA context made, waiting on ``sock`` for a step."""

    def __init__(self, pid: int, sock: socket.socket, env: dict) -> None:
        self.pid, self.sock, self.env = pid, sock, env


class Step:
    """A running step as the zygote sees it: child pid and its client connection."""

    def __init__(self, pid: int, conn: socket.socket, multi_rank: bool) -> None:
        self.pid = pid
        self.conn = conn
        self.multi_rank = multi_rank
        self.started = time.monotonic()


class Zygote:
    def __init__(self, config: dict, base_path: list[str]) -> None:
        self.config = config
        self.base_path = base_path
        self.listener = socket.socket(fileno=config["listen_fd"])
        self.alive_fd: int = config.get("alive_fd", -1)
        self.selector = selectors.DefaultSelector()
        self.steps: dict[int, Step] = {}  # pid -> step
        self.served = 0
        self.started_at = time.time()
        self.report: Optional[PreloadReport] = None
        self.probe = probe_from_env()
        self.signal_handlers: dict[int, object] = {}
        self.stopping = False
        self.watch: Optional[StalenessWatch] = None
        self.env_set_by_preload: dict[str, str] = {}
        self.learn_reports_dir = ""
        self.warm: dict[str, Optional[WarmChild]] = {}  # "python"/"torchrun" -> waiting child
        self.warm_served = 0
        self.restart_reason = ""
        self.spawn_executable = ""

    # -------------------------------------------------------------- start-up

    def run_preload(self) -> None:
        skip = json.loads(os.environ.pop(SKIP_ENV, "{}"))
        fingerprint = package_fingerprint()
        cache = VerdictCache(self.config["cache_dir"], f"{fingerprint}-{self.probe.name}")
        skip.update({k: v for k, v in cache.get().items()
                     if k in self.config["modules"] or k.startswith(LEARNED)})
        start_env = dict(os.environ)
        with recording_env_reads() as keys:
            report = preload(self.config["modules"], self.probe, skip)
            if report.dirty_entry:
                self.quarantine(report.entries[-1], report.entries[-1].module, cache, skip)
            if self.config.get("learn"):
                report.learned = self.preload_learned(fingerprint, cache, skip)
        keys = (keys | set(IMPORT_ENV_KEYS)) - {"PYTORCH_NVML_BASED_CUDA_CHECK", SKIP_ENV, RESTART_ENV}
        # What the imports saw, not what they left: some set variables while importing.
        report.import_env = {k: start_env.get(k) for k in sorted(keys)}
        self.env_set_by_preload = {k: v for k, v in os.environ.items() if start_env.get(k) != v}
        self.report = report

    def quarantine(self, entry, name: str, cache: VerdictCache, skip: dict) -> None:
        """Remember the verdict and re-exec without ``name``; never returns."""
        verdict = verdict_for(entry)
        say("preload entry %s %s (culprit %s via %s); restarting without it",
            name, verdict["reason"], verdict["culprit"], " -> ".join(verdict["chain"]))
        cache.put(name, verdict)
        skip[name] = verdict
        self.restart_without(skip)

    def preload_learned(self, fingerprint: str, cache: VerdictCache, skip: dict) -> dict:
        """Modules earlier steps imported, within the budget, under the same CUDA-clean rules."""
        project = self.config.get("project", "")
        profile = learn.Profile(self.config["cache_dir"], learn.profile_key(project), project)
        if profile.check_packages(fingerprint):
            say("installed packages changed: the learned preload starts over")
        profile.merge_reports()
        self.learn_reports_dir = profile.reports_dir
        # Verdicts name top-level packages: importing any module of a package runs its
        # __init__ chain, so one dirty module rules out its package, not learning as a whole.
        refused = {k[len(LEARNED):] for k in skip if k.startswith(LEARNED)}
        if len(refused) > MAX_LEARNED_QUARANTINES:
            say("learned preload off: %d learned packages dirtied the zygote", len(refused))
            profile.save()
            return {"disabled": f"{len(refused)} learned packages quarantined"}
        modules = [m for m in profile.to_preload(exclude=set(self.config["modules"]))
                   if m.partition(".")[0] not in refused]
        summary, dirty = preload_learned(modules, self.probe, learn.budget_s())
        for module, seconds in summary.pop("costs").items():
            profile.record_cost(module, seconds)
        profile.save()
        if dirty is not None:
            self.quarantine(dirty, LEARNED + dirty.module.partition(".")[0], cache, skip)
        summary["quarantined"] = sorted(refused)
        summary["profile"] = profile.path
        return summary

    def restart_without(self, skip: dict) -> None:
        """Re-exec with the quarantine: the pid, socket and pipes survive, the dirt does not."""
        os.environ[SKIP_ENV] = json.dumps(skip)
        self.reexec()

    def reexec(self) -> None:
        fds = [self.config["listen_fd"], self.alive_fd]
        if not os.environ.get(RESTART_ENV):
            fds.append(self.config["ready_fd"])
        for fd in fds:
            if fd >= 0:
                os.set_inheritable(fd, True)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, sys.orig_argv)

    def snapshot_signals(self) -> None:
        for signum in signal.valid_signals():
            try:
                handler = signal.getsignal(signum)
            except (OSError, ValueError):
                continue
            if handler is not None:
                self.signal_handlers[signum] = handler

    def install_spawn_proxy(self) -> None:
        """Write the executable a step's multiprocessing runs instead of python."""
        socket_path = self.config.get("socket_path")
        if not socket_path:
            return
        path = spawn_proxy.path_for(socket_path)
        try:
            if spawn_proxy.write_executable(path, socket_path):
                self.spawn_executable = path
                import multiprocessing.spawn  # noqa: F401  (preloaded for the children)
        except OSError as err:
            say("spawned interpreters will not be served: %s", err)

    def announce_ready(self) -> None:
        self.watch = StalenessWatch() if self.config.get("daemon") else None
        if os.environ.pop(RESTART_ENV, None):
            say("restarted after a change; serving again")
            return  # the starter heard from us already; this fd number is not ours any more
        os.write(self.config["ready_fd"], (json.dumps(self.status()) + "\n").encode())
        os.close(self.config["ready_fd"])

    # -------------------------------------------------------------- status

    def status(self) -> dict:
        report = self.report.to_dict() if self.report else {}
        return {
            "pid": os.getpid(), "python": sys.executable, "started_at": self.started_at,
            "uptime_s": round(time.time() - self.started_at, 1), "served": self.served,
            "running": len(self.steps), "rss_kb": _rss_kb(), "fds": _fd_count(),
            "native_threads": native_threads(), "preload": report,
            "driver_initialized": self.probe.initialized(),
            "torch_cuda_initialized": torch_cuda_initialized(),
            "modules": self.config["modules"], "daemon": bool(self.config.get("daemon")),
            "steps_pss_kb": sum(_tree_pss_kb(pid) for pid in self.steps),
            "warm_pid": getattr(self.warm.get("python"), "pid", None),
            "warm_agent_pid": getattr(self.warm.get("torchrun"), "pid", None),
            "warm_served": self.warm_served,
            "stale": self.watch.changes() if self.watch else [],
        }

    def fork_refusal(self) -> str:
        """Why this process may not fork a step right now ('' when it may)."""
        if self.probe.initialized():
            return "zygote CUDA driver is initialised"
        if torch_cuda_initialized():
            return "zygote torch.cuda is initialised"
        if threading.active_count() != 1:
            return f"zygote has {threading.active_count()} Python threads"
        return ""

    # -------------------------------------------------------------- loop

    def serve(self) -> None:
        sig_r, sig_w = os.pipe()
        os.set_blocking(sig_w, False)
        os.set_blocking(sig_r, False)
        signal.set_wakeup_fd(sig_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler is needed for the wakeup fd
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop("SIGTERM"))
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the steps
        self.own_fds = [self.listener.fileno(), sig_r, sig_w, self.selector.fileno()]
        if self.alive_fd >= 0:
            self.own_fds.append(self.alive_fd)
            self.selector.register(self.alive_fd, selectors.EVENT_READ, "alive")
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(sig_r, selectors.EVENT_READ, "signal")
        self.start_warm_children()
        while not self.stopping:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self.accept()
                elif key.data == "signal":
                    protocol.drain(sig_r)
                    self.reap()
                elif key.data == "alive":
                    self.request_stop("its starter went away")
                else:
                    self.on_step_conn(key.data)
        self.shutdown()

    def request_stop(self, why: str) -> None:
        say("stopping: %s", why)
        self.stopping = True

    def shutdown(self) -> None:
        for step in list(self.steps.values()):
            _killpg(step.pid, signal.SIGKILL)
        os._exit(0)

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            if not _peer_is_same_user(conn):
                say("refused a connection from another uid")
                protocol.send_event(conn, "refused", reason="peer uid differs")
                conn.close()
                return
            conn.settimeout(REQUEST_READ_TIMEOUT_S)
            request, fds = protocol.recv_request(conn)
        except (OSError, ValueError) as err:
            say("bad request: %s", err)
            protocol.send_event(conn, "error", type="LauncherError", errno=None,
                                strerror=f"bad request: {err}", filename=None)
            conn.close()
            return
        op = request.get("op")
        if op == "step" and len(fds) >= 2 and isinstance(request.get("spec"), dict):
            self.fork_step(conn, request["spec"], fds)
            return
        for fd in fds:
            os.close(fd)
        if op == "status":
            protocol.send_event(conn, "status", **self.status())
        elif op == "stop":
            protocol.send_event(conn, "stopping", pid=os.getpid())
            self.request_stop("asked to stop")
        else:
            protocol.send_event(conn, "error", type="LauncherError", errno=None,
                                strerror=f"unknown request {op!r}", filename=None)
        conn.close()

    def fork_step(self, conn: socket.socket, spec: dict, fds: list[int]) -> None:
        changes = self.watch.changes() if self.watch and not self.restart_reason else []
        if changes:
            self.restart_reason = f"{changes[0]} changed since preload"
            say("stale: %s; restarting once idle", ", ".join(changes[:5]))
        refusal = self.fork_refusal()
        if refusal or self.restart_reason:
            if refusal:
                say("refusing to fork: %s", refusal)
            protocol.send_event(conn, "fallback", reason=refusal or self.restart_reason,
                                retire=bool(refusal), retry=not refusal)
            for fd in fds:
                os.close(fd)
            conn.close()
            self.restart_if_idle()
            return
        pid = self.hand_to_warm_child(conn, spec, fds)
        if pid is None:
            pid = self.fork()
            if pid == 0:
                conn.settimeout(None)
                become_step(spec, fds, conn.fileno(), self.child_state())
        for fd in fds:
            os.close(fd)
        self.served += 1
        step = Step(pid, conn, multi_rank=spec.get("torchrun_args") is not None)
        self.steps[pid] = step
        conn.setblocking(False)
        protocol_send(conn, "started", pid=pid)
        self.selector.register(conn, selectors.EVENT_READ, step)
        self.start_warm_children()

    def fork(self) -> int:
        """fork() with the step's own process group set on both sides (no race with killpg)."""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)
            return 0
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        return pid

    def child_state(self) -> ZygoteState:
        others = [s.conn.fileno() for s in self.steps.values()]
        return ZygoteState(self.base_path, self.signal_handlers, self.own_fds + others,
                           self.env_set_by_preload, self.learn_reports_dir,
                           self.config.get("project", ""), self.spawn_executable)

    # -------------------------------------------------------------- pre-warmed children

    def start_warm_children(self) -> None:
        """Fork the next steps' processes ahead of time: one for a single-rank step and, with
        ``prewarm_ranks``, an agent with its ranks for a torchrun step. Each makes its CUDA
        context(s) and waits for one step."""
        if (not self.config.get("prewarm") or self.stopping or self.restart_reason
                or self.fork_refusal()):
            return
        for kind in ("python", "torchrun"):
            nproc = self.config.get("prewarm_ranks", 0) if kind == "torchrun" else 1
            if self.warm.get(kind) is None and nproc > 0:
                self.warm[kind] = self.fork_warm_child(kind, nproc)

    def fork_warm_child(self, kind: str, nproc: int) -> "WarmChild":
        zygote_end, child_end = socket.socketpair()
        state = self.child_state()
        pid = self.fork()
        if pid == 0:
            zygote_end.close()
            for fd in state.zygote_fds:  # the waiting child holds nothing of the zygote's
                try:
                    os.close(fd)
                except OSError:
                    pass
            state.zygote_fds = []
            if kind == "torchrun":
                from .agent import wait_as_warm_agent
                wait_as_warm_agent(child_end, state, nproc)
            wait_as_warm_child(child_end, state)
        child_end.close()
        return WarmChild(pid, zygote_end, cuda_env(os.environ))

    def hand_to_warm_child(self, conn: socket.socket, spec: dict, fds: list[int]) -> Optional[int]:
        """Give the step to a warm child of its kind when its CUDA-relevant environment
        matches; each serves one step. Returns its pid, or None to fork a fresh child."""
        kind = "torchrun" if spec.get("torchrun_args") is not None else "python"
        warm = self.warm.get(kind)
        if warm is None or spec.get("spawned") or cuda_env(spec.get("env") or {}) != warm.env:
            return None
        self.warm[kind] = None
        try:
            protocol.send_request(warm.sock, spec, [*fds, conn.fileno()])
        except OSError:
            _killpg(warm.pid, signal.SIGKILL)  # it died waiting: reaped as a non-step
            return None
        finally:
            warm.sock.close()
        self.warm_served += 1
        return warm.pid

    def on_step_conn(self, step: Step) -> None:
        """A message from the client of a running step: a signal to forward, or EOF."""
        try:
            data = step.conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            # The caller is gone (killed, timed out with os._exit): so is its step.
            _killpg(step.pid, signal.SIGKILL)
            self.selector.unregister(step.conn)
            return
        for message in protocol.EventReader().feed(data):
            if message.get("op") == "signal":
                _killpg(step.pid, int(message["signum"]))

    def reap(self) -> None:
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            pid = info.si_pid
            # The leader is a zombie: its group cannot be recycled yet, so this is safe.
            _killpg(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            for kind, warm in self.warm.items():
                if warm is not None and pid == warm.pid:
                    warm.sock.close()
                    self.warm[kind] = None
            step = self.steps.pop(pid, None)
            if step is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            try:
                self.selector.unregister(step.conn)
            except (KeyError, ValueError):
                pass
            step.conn.setblocking(True)
            protocol.send_event(step.conn, "exit", returncode=code)
            step.conn.close()
        self.restart_if_idle()

    def restart_if_idle(self) -> None:
        """A stale daemon re-executes itself once no step of the old image is running."""
        if self.restart_reason and not self.steps:
            say("restarting: %s", self.restart_reason)
            os.environ[RESTART_ENV] = "1"
            signal.set_wakeup_fd(-1)
            self.reexec()


class StalenessWatch:
    """Notices edits to preloaded modules outside site-packages and package installs/removals.

    Local source files are compared by mtime; installed packages through the mtime of each
    site-packages directory (an install or uninstall adds or removes entries there)."""

    def __init__(self) -> None:
        import site
        import sysconfig
        dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        dirs |= set(site.getsitepackages()) | {site.getusersitepackages()}
        self.site_dirs = {d: _mtime(d) for d in dirs if os.path.isdir(d)}
        roots = tuple(os.path.join(os.path.realpath(d), "") for d in self.site_dirs)
        self.local_files: dict[str, int] = {}
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if path and os.path.isfile(path) and not os.path.realpath(path).startswith(roots):
                self.local_files[path] = _mtime(path)

    def changes(self) -> list[str]:
        changed = [p for p, t in self.local_files.items() if _mtime(p) != t]
        changed += [f"packages in {d}" for d, t in self.site_dirs.items() if _mtime(d) != t]
        return changed


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def _tree_pss_kb(pid: int) -> int:
    """PSS of a step and every process below it (ranks, their workers)."""
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
    return total + sum(_tree_pss_kb(c) for c in children)


def protocol_send(conn: socket.socket, event: str, **fields) -> None:
    conn.setblocking(True)
    protocol.send_event(conn, event, **fields)
    conn.setblocking(False)


def _peer_is_same_user(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _rss_kb() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def skip_exit_only_finalizers() -> int:
    """Unhook torch.library's per-library exit finalizers from ``atexit`` (children inherit this).

    Each deregisters an operator library from the dying process: ~30 ms per step with torch
    loaded and nothing a program can observe, like the module teardown ``os._exit`` skips.
    Libraries a step creates itself keep their finalizers."""
    import weakref
    skipped = 0
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        info = finalizer._registry.get(finalizer)  # type: ignore[attr-defined]
        func = getattr(info, "func", None)
        if getattr(func, "__module__", "") == "torch.library" and func.__name__ == "_del_library":
            finalizer.atexit = False
            skipped += 1
    return skipped


def main(config_json: str, base_path: list[str]) -> None:
    config = json.loads(config_json)
    zygote = Zygote(config, base_path)
    zygote.run_preload()
    zygote.snapshot_signals()  # after preload: handlers that imports install are kept
    zygote.install_spawn_proxy()
    skip_exit_only_finalizers()
    gc.collect()
    gc.freeze()  # children never touch (and copy) the preloaded objects' pages in GC
    zygote.announce_ready()
    zygote.serve()
