"""Stage 3: the zygote. Preloads, proves it is fork-clean, then forks one child per request.

One selector loop and no threads: a listener, a SIGCHLD wakeup fd, the starter's "alive" pipe,
and one connection per running step (its EOF means the caller died: the step is killed). The
zygote decodes only the request envelope (``requests``); the child decodes the step
(``become.become_step``).
Started by ``zygote_handle.ZygoteProcess`` as ``python -u -c BOOTSTRAP PKG_PARENT CONFIG_JSON``.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time
from typing import Optional

from .. import cuda, gpus, procfs, protocol, standin
from ..files import read_json, remove_all, zygote_files
from ..settings import QUARANTINE_ENV, RESTARTED_ENV, Settings, ZygoteConfig
from ..step import runtime
from . import threads
from .culprits import hint_holds
from .preload import Preloader, PreloadReport, Quarantined, StalenessWatch, freeze_image
from .prewarm import WarmPool
from .requests import ZygoteRequests, say
from .running import Hold, Step

__all__ = ["main"]


class Zygote(ZygoteRequests):
    """One preloaded interpreter serving its socket; its requests and steps: ``requests``."""

    def __init__(self, config: ZygoteConfig, settings: Settings, base_path: list[str]) -> None:
        self.config = config
        self.settings = settings
        self.base_path = base_path
        self.listener = socket.socket(fileno=config.listen_fd)
        os.set_inheritable(config.listen_fd, False)  # a listener outliving us keeps stand-ins waiting
        self.selector = selectors.DefaultSelector()
        self.steps: dict[int, Step] = {}  # pid -> step
        self.pending: dict[int, protocol.RequestReader] = {}  # fd -> a request being read
        self.holds: dict[int, Hold] = {}  # fd -> a caller's subprocess step's group held
        self.served = 0
        self.started_at = time.time()
        self.report: Optional[PreloadReport] = None
        self.probe = cuda.probe_for(settings)
        self.signal_handlers: dict[int, object] = {}
        self.own_fds: list[int] = []
        self.stopping = False
        self.ending_steps = False  # the stop ends the running steps too (else: their callers do)
        self.watch: Optional[StalenessWatch] = None
        self.env_set_by_preload: dict[str, str] = {}
        self.env_set_at_startup: dict[str, Optional[str]] = {}
        self.learn_reports_dir = ""
        self.warm = WarmPool(config.prewarm_ranks, self.child_state) if config.prewarm else None
        self.restart_reason = ""
        self.spawn_executable = ""
        self.standin_steps = 0  # interpreters stand-ins asked for and this zygote forked
        self.standin_fallbacks: dict[str, int] = {}  # why the others ran the real program
        self.gpus = gpus.GpuPool(config.gpus, config.gpus_visible) if config.gpus else None
        self.preloader: Optional[Preloader] = None
        self.fresh_counts: Optional[threads.FreshCounts] = None
        self.announced = False  # the starter has our status; the ready fd is closed
        self.learn_due = False  # a step finished: what it imported may be worth learning
        self.last_request = time.monotonic()  # for a daemon's idle timeout

    # -------------------------------------------------------------- start-up

    def start(self) -> None:
        for key in (QUARANTINE_ENV, RESTARTED_ENV):  # read into settings; not for the steps
            os.environ.pop(key, None)
        self.announced = self.settings.restarted
        self.preloader = Preloader(self.config, self.settings, self.probe, log=say)
        try:
            self.report = self.preloader.run()
        except Quarantined as verdict:
            self.restart_without(verdict)
        self.env_set_by_preload = self.preloader.env_set_by_preload
        self.env_set_at_startup = self.preloader.env_set_at_startup
        self.learn_reports_dir = self.preloader.learn_reports_dir

        self.snapshot_signals()  # after preload: handlers that imports install are kept
        self.use_standins()
        freeze_image()
        # A fresh interpreter that imported the same modules has these; every fd opened
        # from here on is the zygote's own and is closed in its children (child_state).
        self.preload_fds = procfs.open_fds()
        self.announce_ready()

    def restart_without(self, verdict: Quarantined) -> None:
        say("%s; restarting without it", verdict)
        os.environ[QUARANTINE_ENV] = json.dumps(verdict.skip)
        self.reexec()

    def reexec(self) -> None:
        """Re-execute: the pid, socket and pipes survive, the preloaded image does not."""
        # Until the new image serves, stand-ins run the real program (launchers of ranks wait)
        remove_all(zygote_files(self.config.socket_path)["ready"])
        fds = [self.config.listen_fd, self.config.alive_fd, self.config.lock_fd]
        if self.announced:
            os.environ[RESTARTED_ENV] = "1"  # the new image must not announce again
        else:
            fds.append(self.config.ready_fd)
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

    def use_standins(self) -> None:
        """A step's multiprocessing runs the stand-in its starter installed instead of python."""
        self.spawn_executable = standin.installed(self.config.socket_path)
        if self.spawn_executable:
            import multiprocessing.spawn  # noqa: F401  (preloaded for the children)
        else:
            say("spawned interpreters will not be served: no stand-in was installed")

    def announce_ready(self) -> None:
        # Every zygote, not only a daemon: a module learned from a test's folder may be edited
        # by the next test, whose step must not run the old code.
        self.watch = StalenessWatch()
        # Stand-ins ask only a zygote that serves (one started while it preloads or restarts
        # runs the real program, or, a launcher of ranks, waits for this mark). Marked before
        # anyone is told: a launch made once the starter heard must find the mark (its request
        # waits in the listener's backlog until the loop runs). Empty: created in one step.
        os.close(os.open(zygote_files(self.config.socket_path)["ready"],
                         os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        if self.announced:
            say("restarted; serving again")
            return  # the starter heard from us already; this fd number is not ours any more
        protocol.send_event(self.config.ready_fd, "status", **self.status())
        os.close(self.config.ready_fd)
        self.announced = True

    def status(self) -> dict:
        return {
            "pid": os.getpid(), "python": sys.executable, "started_at": self.started_at,
            "uptime_s": round(time.time() - self.started_at, 1), "served": self.served,
            "running": len(self.steps), "rss_kb": procfs.rss_kb(), "fds": procfs.fd_count(),
            "native_threads": procfs.native_threads(),
            "native_threads_described": threads.describe(procfs.native_threads()),
            "preload": self.report.to_dict() if self.report else {},
            "driver_initialized": self.probe.initialized(),
            "torch_cuda_initialized": cuda.torch_cuda_initialized(),
            "modules": self.config.modules, "daemon": self.config.daemon,
            "steps_pss_kb": sum(procfs.tree_pss_kb(pid) for pid in self.steps),
            "warm_pid": self.warm.pid("python") if self.warm else None,
            "warm_agent_pid": self.warm.pid("torchrun") if self.warm else None,
            "warm_served": self.warm.served if self.warm else 0,
            "standin_steps": self.standin_steps,
            "standin_fallbacks": self.standin_fallbacks,
            "gpus": self.gpus.describe() if self.gpus else None,
            "stale": self.watch.changes() if self.watch else [],
            "learn_pending": self.learn_due,
        }

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
        if self.config.lock_fd >= 0:  # held for life; never by a child
            self.own_fds.append(self.config.lock_fd)
        if self.config.alive_fd >= 0:
            self.own_fds.append(self.config.alive_fd)
            self.selector.register(self.config.alive_fd, selectors.EVENT_READ, "alive")
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(sig_r, selectors.EVENT_READ, "signal")
        self.verify_hints()
        self.thread_counts({"env": {}})
        self.fresh_counts.ask_ahead({"OMP_NUM_THREADS": "1"})  # ranks' counts, asked ahead
        self.fill_warm_pool()
        while not self.stopping:
            events = self.selector.select(0 if self.learn_due and not self.steps
                                          else self.idle_left())
            if not events and self.learn_due:
                self.learn_while_idle()
            elif not events and self.idle_left() == 0:
                self.request_stop(f"idle for {self.config.idle_timeout_s:.0f} s")
            self.dispatch(events)
        staying = self.stop_serving()
        while (self.steps or self.holds) and not self.ending_steps:  # until their callers go
            self.dispatch(self.selector.select())
        for running in list(self.steps.values()):
            runtime.signal_group(running.pid, signal.SIGKILL)
        if staying:
            remove_all(zygote_files(self.config.socket_path)["standins"])

    def dispatch(self, events: list) -> None:
        """Handle one ``select`` batch in order. An event whose registration an earlier one
        ended is skipped: a step reaped by this batch's SIGCHLD has its connection closed, and
        its client's EOF, in the same batch, is no longer news."""
        for key, _ in events:
            if self.selector.get_map().get(key.fd) is not key:
                continue
            if key.data == "accept":
                self.accept()
            elif key.data == "signal":
                protocol.drain(key.fd)
                self.reap()
            elif key.data == "alive":
                self.request_stop("its starter went away", steps_too=False)
            elif isinstance(key.data, str):
                self.settle_hint(key.data, key.fileobj)
            elif isinstance(key.data, protocol.RequestReader):
                self.on_request(key.data)
            elif isinstance(key.data, gpus.Waiting):
                self.on_waiting_conn(key.data)
            elif isinstance(key.data, Hold):
                self.on_hold_conn(key.data)
            else:
                self.on_step_conn(key.data)

    def verify_hints(self) -> None:
        """Re-verify a portable profile's verdicts for another package set, each in a forked
        child that imports what the verdict names (the zygote stays clean); the result is kept
        in the verdict cache for the next zygote."""
        for key in list(self.preloader.hints):
            result_r, result_w = os.pipe()
            state = self.child_state(keep=[result_w])

            def body(key=key) -> int:
                runtime.close_fds([*state.zygote_fds, result_r])
                runtime.die_with_parent()
                os.write(result_w, b"1" if hint_holds(key, self.probe, self.preloader.blocker)
                         else b"0")
                return 0

            runtime.fork(body)
            os.close(result_w)
            self.selector.register(result_r, selectors.EVENT_READ, "hint:" + key)

    def settle_hint(self, data: str, result_r: int) -> None:
        key = data[len("hint:"):]
        holds = os.read(result_r, 1) != b"0"  # EOF (the check crashed): the verdict stands
        self.selector.unregister(result_r)
        os.close(result_r)
        self.preloader.settle_hint(key, holds)
        self.report.hints[key] = "confirmed" if holds else "cleared"
        say("profile verdict %s %s on this package set", key, self.report.hints[key])

    def learn_while_idle(self) -> None:
        """Import what finished steps imported and this zygote lacks, one module at a time,
        until a request comes in (the same CUDA-clean rules and budget as at start-up)."""
        self.learn_due = False
        before = procfs.open_fds()
        began = time.time_ns()
        try:
            summary = self.preloader.learn_while_idle(lambda: not self.selector.select(0),
                                                      self.report)
        except Quarantined as verdict:
            signal.set_wakeup_fd(-1)
            self.restart_without(verdict)
        self.learn_due = summary.get("interrupted", False)  # go on at the next idle moment
        self.preload_fds |= procfs.open_fds() - before  # what the learned imports opened
        self.watch.add_new(since_ns=began)  # learned modules are watched as preloaded ones
        if summary["imported"]:
            freeze_image()
            learned = self.report.learned
            learned["in_session"] = learned.get("in_session", 0) + summary["imported"]
            say("learned %d modules while idle (%.2f s)", summary["imported"], summary["seconds"])

    def stop_serving(self) -> bool:
        """Take no request from here on; returns whether the zygote stays, as the parent of
        the steps whose callers still wait for them (its starter went away: a test left a
        program running). The socket and files go now, so nothing is left of a session that
        ended (the stand-ins last, once those steps ended: a step's multiprocessing may run
        them), with the warm children and the requests that never started; the starter hears
        that the zygote stays, and does not wait for it."""
        self.selector.unregister(self.listener)
        self.listener.close()
        self.drop_unstarted()
        if self.warm:
            self.warm.empty()
        staying = bool(self.steps or self.holds) and not self.ending_steps
        self.remove_files(keep_standins=staying)
        if self.config.alive_fd >= 0:
            self.selector.unregister(self.config.alive_fd)
            if staying:
                say("staying for %d running steps whose callers wait for them", len(self.steps))
                protocol.send_event(self.config.alive_fd, "staying", steps=len(self.steps))
            os.close(self.config.alive_fd)
        return staying

    def remove_files(self, keep_standins: bool = False) -> None:
        """A zygote that stopped as asked (or because its starter went away) leaves nothing
        behind: its socket, spawn proxy and log, and a daemon's metadata and lock while it
        holds the lock (no other daemon of its name can have started: the files are its own;
        the lock file goes last, while still held)."""
        files = zygote_files(self.config.socket_path)
        if keep_standins:
            del files["standins"]
        if not self.config.daemon or self.config.lock_fd >= 0 or \
                (read_json(files["meta"]) or {}).get("pid") == os.getpid():
            remove_all(*files.values())

    def idle_left(self) -> Optional[float]:
        """Seconds until a daemon idle since its last request stops (None: no limit)."""
        if not self.config.idle_timeout_s or self.steps or self.holds:
            return None
        return max(0.0, self.last_request + self.config.idle_timeout_s - time.monotonic())

    def request_stop(self, why: str, steps_too: bool = True) -> None:
        """Stop serving. ``steps_too``: the running steps end now (`stop`, SIGTERM, also while
        the zygote stays for them); else each lives as long as its caller waits for it."""
        say("stopping: %s", why)
        self.stopping = True
        self.ending_steps = self.ending_steps or steps_too

    def reap(self) -> None:
        reaped = False  # a SIGCHLD may be a tryout's or a scout's, reaped where it was forked
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if info is None:
                break
            if info.si_code == os.CLD_STOPPED:
                self.report_stop(info.si_pid)
                continue
            # The leader is a zombie: its group cannot be recycled yet, so this is safe.
            if not getattr(self.steps.get(info.si_pid), "standin", False):
                runtime.signal_group(info.si_pid, signal.SIGKILL)
            _, status = os.waitpid(info.si_pid, 0)
            reaped = True
            if self.warm:
                self.warm.reaped(info.si_pid)
            self.report_exit(info.si_pid, os.waitstatus_to_exitcode(status))
            if self.gpus and self.gpus.release(info.si_pid):
                self.start_granted()
        if reaped:  # a step ended: what it imported may be worth learning
            self.learn_due = bool(self.learn_reports_dir)
        self.restart_if_idle()

    def report_stop(self, pid: int) -> None:
        """A step stopped (a caller's SIGTSTP relayed, a SIGSTOP): its caller stops too, as the
        process standing for it (``mirroring``)."""
        stopped = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG)  # consumed: reported once
        running = self.steps.get(pid)
        if stopped is None or running is None:
            return
        try:
            protocol.send_event(running.conn, "stopped", signum=stopped.si_status,
                                relayed=running.relayed)
        except OSError:
            pass  # its caller is gone: the step is killed as its connection ends

    def report_exit(self, pid: int, code: int) -> None:
        """The reaper's exit report: the fallback for a step that died without reporting."""
        running = self.steps.pop(pid, None)
        if running is None:
            return
        self.last_request = time.monotonic()  # idle from the end of the last step
        try:
            self.selector.unregister(running.conn)
        except (KeyError, ValueError):
            pass
        running.conn.setblocking(True)
        protocol.send_event(running.conn, "exit", returncode=code)
        running.conn.close()

    def restart_if_idle(self) -> None:
        """A stale daemon re-executes itself once no step of the old image is running and no
        request is half read (exec would drop its connection)."""
        # Held groups do not wait for it (a shell step would keep its stand-ins from a fresh
        # image); the new image holds them no more.
        if self.restart_reason and not (self.steps or self.pending or self.stopping):
            say("restarting: %s", self.restart_reason)
            signal.set_wakeup_fd(-1)
            self.reexec()



def main(config_json: str, base_path: list[str]) -> None:
    zygote = Zygote(ZygoteConfig.from_json(config_json), Settings.from_env(), base_path)
    zygote.start()
    zygote.serve()
    os._exit(0)
