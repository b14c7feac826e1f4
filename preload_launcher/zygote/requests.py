"""Stage 3b: the zygote's connections. A request is read as it arrives and answered (status,
stop), held (a caller's subprocess step's group, ended if the caller goes) or forked as a step:
a stand-in's command classified first, a stale or dirty zygote's refusal sent back, a packed
step held until its GPUs are free, and the child handed only its own fds. ``server.Zygote``
owns the start-up, the selector loop, reaping and stopping (and staying for its steps).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import time
from typing import Optional

from .. import cuda, gpus, procfs, protocol
from ..command import Unsupported, import_environment, parse_command
from ..interpreter import import_env_mismatch
from ..process_attrs import affinity_change
from ..step import become, runtime
from . import threads
from .running import Hold, Step

__all__ = ["ZygoteRequests", "say"]


def say(fmt: str, *args) -> None:
    """Log to the zygote's stderr (its log file). The root logger stays unconfigured: children
    inherit it, and a fresh interpreter has no handlers."""
    print(time.strftime("%H:%M:%S"), f"zygote[{os.getpid()}]", fmt % args, file=sys.stderr,
          flush=True)


class ZygoteRequests:
    """The request and step half of ``server.Zygote`` (its state lives there)."""

    def accept(self) -> None:
        """A new connection; its request is read as it arrives (``on_request``)."""
        self.last_request = time.monotonic()
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            same_user = protocol.peer_uid(conn) == os.getuid()
        except OSError:
            same_user = False
        if not same_user:
            say("refused a connection from another uid")
            try:
                protocol.send_event(conn, "refused", reason="peer uid differs")
            except OSError:
                pass
            conn.close()
            return
        conn.setblocking(False)
        pending = protocol.RequestReader(conn)
        self.pending[conn.fileno()] = pending
        self.selector.register(conn, selectors.EVENT_READ, pending)
        self.on_request(pending)  # usually all of it is there already

    def on_request(self, pending: protocol.RequestReader) -> None:
        conn = pending.sock
        try:
            got = pending.feed()
        except (OSError, ValueError) as err:
            got = err
        if got is None:
            return  # more to come; other clients are served meanwhile
        self.selector.unregister(conn)
        del self.pending[conn.fileno()]
        conn.setblocking(True)
        if isinstance(got, Exception):
            say("bad request: %s", got)
            _send_error(conn, f"bad request: {got}")
            conn.close()
            return
        request, fds = got
        spec, pgid = request.get("spec"), request.get("pgid")
        if request.get("op") == "hold" and isinstance(pgid, int) and pgid > 1 and not fds \
                and pgid != os.getpgrp():
            conn.setblocking(False)
            self.holds[conn.fileno()] = Hold(pgid, conn)
            self.selector.register(conn, selectors.EVENT_READ, self.holds[conn.fileno()])
            return
        if request.get("op") == "step" and isinstance(spec, dict) and len(fds) == (
                2 if spec.get("fd_targets") is None else len(spec["fd_targets"])):
            self.fork_step(conn, spec, fds)
            return
        runtime.close_fds(fds)
        self.answer(conn, request.get("op"))
        conn.close()

    def answer(self, conn: socket.socket, op: Optional[str]) -> None:
        if op == "status":
            protocol.send_event(conn, "status", **self.status())
        elif op == "stop":
            protocol.send_event(conn, "stopping", pid=os.getpid())
            self.request_stop("asked to stop")
        else:
            _send_error(conn, f"unknown request {op!r}")

    def fork_step(self, conn: socket.socket, spec: dict, fds: list[int]) -> None:
        arrived = time.monotonic()
        standin = bool(spec.get("nested") or spec.get("spawned"))
        if standin:
            spec = self.classify_standin(spec)
            if isinstance(spec, str):  # the stand-in runs the real program
                self.count_standin_fallback(spec)
                _send_fallback(conn, fds, reason=spec, retire=False)
                return
        elif self.env_differs(import_environment(spec)):
            # The caller chose us by an import environment older than what we learned since:
            # it gets ours, to choose again.
            _send_fallback(conn, fds, reason=self.env_differs(import_environment(spec)),
                           retire=False,
                           import_env=self.report.import_env,
                           set_while_importing=self.report.set_while_importing)
            return
        self.check_staleness()
        dirty = cuda.fork_refusal(self.probe)
        if dirty or self.restart_reason:
            if dirty:
                say("refusing to fork: %s", dirty)
            if standin:
                self.count_standin_fallback(dirty or self.restart_reason)
            # Dirty: the caller retires this zygote. Stale: it retries once we restarted.
            _send_fallback(conn, fds, reason=dirty or self.restart_reason, retire=bool(dirty),
                           retry=not dirty)
            self.restart_if_idle()
            return
        if standin:
            self.standin_steps += 1
        spec["thread_counts"] = self.thread_counts(spec)
        need = self.gpus.need_of(spec) if self.gpus else 0
        if need:  # packed: it starts once enough GPUs are free
            waiting = gpus.Waiting(conn, spec, fds, need, since=arrived)
            self.gpus.wait(waiting)
            conn.setblocking(False)
            self.selector.register(conn, selectors.EVENT_READ, waiting)
            self.start_granted()
            return
        self.start_step(conn, spec, fds)

    def start_step(self, conn: socket.socket, spec: dict, fds: list[int]) -> int:
        # A program whose caller started it in a session of its own leads one (a warm child
        # leads a group already, and so cannot).
        new_session = bool(spec.get("process", {}).get("session_leader"))
        pid = self.warm.hand_over(spec, fds, conn) if self.warm and not new_session else None
        if pid is None:
            conn.settimeout(None)
            state = self.child_state(keep=[*fds, conn.fileno()])
            pid = runtime.fork(lambda: become.become_step(spec, fds, conn.fileno(), state),
                               new_session=new_session)
        runtime.close_fds(fds)
        self.served += 1
        self.steps[pid] = Step(pid, conn, standin=bool(spec.get("nested") or spec.get("spawned")))
        protocol.send_event(conn, "started", pid=pid)
        conn.setblocking(False)
        self.selector.register(conn, selectors.EVENT_READ, self.steps[pid])
        self.fill_warm_pool()
        return pid

    def start_granted(self) -> None:
        """Start the waiting steps that free GPUs now fit, each on its own."""
        for waiting, granted in self.gpus.grants():
            self.selector.unregister(waiting.conn)
            waiting.conn.setblocking(True)
            waiting.spec["env"]["CUDA_VISIBLE_DEVICES"] = ",".join(granted)
            protocol.send_event(waiting.conn, "granted", gpus=granted,
                                waited_s=round(time.monotonic() - waiting.since, 3))
            self.gpus.hold(self.start_step(waiting.conn, waiting.spec, waiting.fds), granted)

    def on_waiting_conn(self, waiting: gpus.Waiting) -> None:
        """The caller of a step still waiting for GPUs went away, or signalled it (a timeout,
        Ctrl-C): it never starts; a signal is answered as the step's death by it."""
        try:
            messages = waiting.reader.feed(waiting.conn.recv(4096) or b"")
        except (OSError, protocol.ProtocolError):
            messages = []
        signals = [m["signum"] for m in messages if m.get("op") == "signal"]
        self.gpus.forget(waiting)
        self.selector.unregister(waiting.conn)
        runtime.close_fds(waiting.fds)
        if signals:
            waiting.conn.setblocking(True)
            protocol.send_event(waiting.conn, "exit", returncode=-int(signals[0]))
        waiting.conn.close()
        self.start_granted()  # the head of the queue may have been holding others back

    def drop_unstarted(self) -> None:
        """The zygote stops serving: requests still being read and steps still waiting for
        GPUs never start here (their callers hear EOF: a stand-in runs the real program)."""
        for pending in self.pending.values():
            self.selector.unregister(pending.sock)
            pending.close_fds()
            pending.sock.close()
        self.pending.clear()
        for waiting in list(self.gpus.queue) if self.gpus else []:
            self.gpus.forget(waiting)
            self.selector.unregister(waiting.conn)
            runtime.close_fds(waiting.fds)
            waiting.conn.close()

    def count_standin_fallback(self, reason: str) -> None:
        """Why stand-ins ran the real program, for ``status`` and the pytest summary."""
        say("a stand-in runs the real program: %s", reason)
        self.standin_fallbacks[reason] = self.standin_fallbacks.get(reason, 0) + 1

    def classify_standin(self, spec: dict):
        """A stand-in's command classified as the client classifies a step: the spec to fork,
        or why the real program must run (not served, or an environment the preload's imports
        would have seen differently). A spawned interpreter's command line is multiprocessing's
        own, parsed by the child; its parent may still have changed the environment."""
        differs = self.env_differs(spec["env"])
        if differs:
            return differs
        if spec.get("spawned"):
            return spec
        try:
            parsed = parse_command(spec["args"], spec["env"], spec["cwd"])
        except OSError as err:
            return str(err)
        if isinstance(parsed, Unsupported):
            return parsed.reason
        differs = self.env_differs(parsed.import_env())  # what a test runner sets for itself
        if differs:
            return differs
        return {**parsed.to_json_dict(), "fd_targets": spec["fd_targets"], "nested": True,
                "process": spec.get("process") or {}}

    def env_differs(self, env: dict) -> str:
        """Why ``env`` is not the environment this zygote's imports (preloaded and learned)
        saw; '' when it is."""
        report = self.report
        differs = import_env_mismatch(report.import_env if report else {}, env,
                                      report.set_while_importing if report else None)
        return f"its environment differs from the preload's in {', '.join(differs[:3])}" \
            if differs else ""

    def check_staleness(self) -> None:
        """A daemon whose preloaded code or packages changed restarts once idle."""
        changes = self.watch.changes() if self.watch and not self.restart_reason else []
        if changes:
            self.restart_reason = f"{changes[0]} changed since preload"
            say("stale: %s; restarting once idle", ", ".join(changes[:5]))

    def thread_counts(self, spec: dict) -> dict:
        """The thread counts (torch's, and each OpenMP/BLAS pool's) for this step as a fresh
        interpreter would have them."""
        defaults = threads.pin_for_preload()  # None without torch
        if self.fresh_counts is None or self.fresh_counts.torch != (defaults is not None):
            self.fresh_counts = threads.FreshCounts(
                os.path.join(self.config.cache_dir, f"threads-{self.preloader.fingerprint}.json"),
                defaults)
        # Launchers give their processes OMP_NUM_THREADS=1 (torchrun for several ranks,
        # accelerate by default): that count is asked for too.
        launcher = spec.get("torchrun_args") is not None or spec.get("accelerate_args") is not None
        return self.fresh_counts.table_for(spec.get("env") or {}, multi_rank=launcher,
                                           cpus=affinity_change(spec.get("process") or {}))

    def child_state(self, keep=()) -> runtime.ZygoteState:
        """What a child needs; ``keep``: the fds it is handed (all others the zygote opened
        after preload are closed in it: other steps' connections, half-read requests and
        their fds, waiting steps' fds, pipes)."""
        others = {s.conn.fileno() for s in self.steps.values()}
        opened = (procfs.open_fds() - self.preload_fds) | set(self.own_fds) | others
        return runtime.ZygoteState(self.base_path, self.signal_handlers, sorted(opened - set(keep)),
                                   self.env_set_by_preload, self.learn_reports_dir,
                                   self.config.project, self.spawn_executable,
                                   self.settings.prewarm_cuda,
                                   {package: info["cut"] for package, info in
                                    (self.report.deferred if self.report else {}).items()},
                                   socket_path=self.config.socket_path,
                                   env_set_at_startup=self.env_set_at_startup)

    def fill_warm_pool(self) -> None:
        if (self.warm and not self.stopping and not self.restart_reason
                and not cuda.fork_refusal(self.probe)):
            self.warm.fill()

    def on_hold_conn(self, held: Hold) -> None:
        """The holding caller released its step's group (the step ended), or went away: then
        the group goes, with the stand-ins in it (and so their programs)."""
        try:
            data = held.conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            try:
                held.released |= any(m.get("op") == "release" for m in held.reader.feed(data))
            except protocol.ProtocolError:
                pass
            return
        self.last_request = time.monotonic()  # idle from the end of the last step
        self.selector.unregister(held.conn)
        del self.holds[held.conn.fileno()]
        held.conn.close()
        if not held.released:
            runtime.signal_group(held.pgid, signal.SIGKILL)

    def on_step_conn(self, running: Step) -> None:
        """A message from the client of a running step: a signal to forward, or EOF."""
        try:
            data = running.conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        try:
            messages = running.reader.feed(data) if data else None
        except protocol.ProtocolError:
            messages = None
        if messages is None:
            # The caller is gone (killed, timed out with os._exit) or talks nonsense: the
            # step goes too.
            running.signal(signal.SIGKILL)
            self.selector.unregister(running.conn)
            return
        for message in messages:
            if message.get("op") == "signal":
                running.signal(int(message["signum"]))
            elif message.get("op") == "ran_fresh" and running.standin:
                # Forked, then it became a fresh interpreter (``rerun``): not served after all.
                self.standin_steps -= 1
                self.count_standin_fallback(f"it ran fresh: {message['reason']}")


def _send_fallback(conn: socket.socket, fds: list[int], **event) -> None:
    """The step is not forked here: the caller runs it elsewhere (``protocol``: fallback)."""
    protocol.send_event(conn, "fallback", **event)
    runtime.close_fds(fds)
    conn.close()


def _send_error(conn: socket.socket, message: str) -> None:
    protocol.send_event(conn, "error", type="LauncherError", errno=None, strerror=message,
                        filename=None)
