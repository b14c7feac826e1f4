"""How the caller waits for a step: a zygote's forked child (``StepWait``, ``wait_for_step``)
or a plain subprocess (``run_subprocess``), with ``subprocess.run``'s rules: the timeout, the
kill-on-any-exception rule, Ctrl-C. A zygote that dies under a running step takes the step's
process group with it, and the caller learns it at once (not when the last grandchild ends)."""

from __future__ import annotations

import codecs
import io
import locale
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from .. import protocol
from ..mirroring import Mirror
from ..result import StepResult

__all__ = ["StepWait", "wait_for_step", "wait_relaying", "run_subprocess", "decode",
           "kill_group"]

EXIT_DRAIN_S = 0.5  # after the step's exit, how long escaped grandchildren may hold the output
KILL_WAIT_S = 10.0
INTERRUPT_GRACE_S = 0.25  # as subprocess.run gives a child on Ctrl-C
# Popen(process_group=0) is Python >= 3.11; setpgid in the child is the same on 3.10.
OWN_PROCESS_GROUP = ({"process_group": 0} if sys.version_info >= (3, 11)
                     else {"preexec_fn": os.setpgrp})
ENDED_SETUP = ("exit", "fallback", "error", "refused")  # events after which EOF is expected


class StepWait:
    """Collects a step's events (and its output, when captured) until it exits, honouring a
    deadline. ``out_r`` None: the step writes to the caller's own fds. ``zygote_pid``: watched,
    so that its death ends the wait even while a grandchild holds the connection."""

    def __init__(self, sock: socket.socket, out_r: Optional[int], echo: bool,
                 zygote_pid: Optional[int] = None) -> None:
        self.sock = sock
        self.out_r = out_r
        self.echo = echo
        self.output = bytearray()
        self.events: dict[str, dict] = {}
        self.zygote_died = False
        self.on_stopped = None  # called with a "stopped" event (the step stopped), if set
        self._reader = protocol.EventReader()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ, "events")
        if out_r is not None:
            self.selector.register(out_r, selectors.EVENT_READ, "output")
        self._zygote_fd = _pidfd(zygote_pid)
        if self._zygote_fd is not None:
            self.selector.register(self._zygote_fd, selectors.EVENT_READ, "zygote")

    def _pending(self) -> bool:
        """Whether the events (until EOF) or the output (until EOF) are still to come."""
        watched = {self.sock.fileno(), self.out_r}
        return any(key.fd in watched for key in self.selector.get_map().values())

    def pump(self, deadline: Optional[float]) -> bool:
        """Run until exit + output EOF (True) or the deadline (False)."""
        exit_seen_at: Optional[float] = None
        while self._pending():
            now = time.monotonic()
            wait = None if deadline is None else max(0.0, deadline - now)
            if exit_seen_at is not None:
                grace = exit_seen_at + EXIT_DRAIN_S - now
                if grace <= 0:
                    self.events.setdefault("held_output", {})
                    break
                wait = grace if wait is None else min(wait, grace)
            if deadline is not None and wait == 0 and now >= deadline:
                return False
            for key, _ in self.selector.select(wait):
                if key.data == "output":
                    self._read_output()
                elif key.data == "events":
                    self._read_events()
                else:
                    self._zygote_gone()
            if ("exit" in self.events or self.zygote_died) and exit_seen_at is None:
                exit_seen_at = time.monotonic()
            if "fallback" in self.events:
                return True
        return True

    def _read_output(self) -> None:
        data = os.read(self.out_r, 1 << 16)
        if not data:
            self.selector.unregister(self.out_r)
            return
        self.output += data
        if self.echo:
            sys.stdout.write(self._decoder.decode(data))
            sys.stdout.flush()

    def _read_events(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(self.sock)
            if not any(event in self.events for event in ENDED_SETUP):
                self._zygote_gone()
            return
        for event in self._reader.feed(data):
            if event["event"] == "stopped":
                if self.on_stopped is not None:
                    self.on_stopped(int(event["signum"]), int(event["relayed"]))
                continue
            # The first report wins: a step reports its exit before its process is torn down,
            # and the zygote reports it again when it reaps the process.
            self.events.setdefault(event["event"], event)

    def _zygote_gone(self) -> None:
        """The zygote died under the step: nobody reaps or reports it any more. Its process
        group goes now (the step itself dies with its parent; what it started would not)."""
        if self.zygote_died:
            return
        self.zygote_died = True
        if self._zygote_fd is not None:
            self.selector.unregister(self._zygote_fd)
        if "started" in self.events and "exit" not in self.events:
            kill_group(int(self.events["started"]["pid"]))

    def send_signal(self, signum: int) -> None:
        protocol.send_op(self.sock, "signal", signum=int(signum))

    def close(self) -> None:
        self.selector.close()
        if self.out_r is not None:
            os.close(self.out_r)
        if self._zygote_fd is not None:
            os.close(self._zygote_fd)
        self.sock.close()


def _pidfd(pid: Optional[int]) -> Optional[int]:
    """An fd that becomes readable when ``pid`` exits (Linux >= 5.3), or None."""
    if not pid or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def wait_for_step(waiter: StepWait, args, timeout: Optional[float], start: float) -> None:
    """Wait as ``subprocess.run`` waits: after ``timeout``, the step and everything it started
    are killed and TimeoutExpired raised; Ctrl-C reaches the step (SIGINT, then SIGKILL after a
    grace); any other exception kills it."""
    deadline = None if timeout is None else start + timeout
    try:
        finished = waiter.pump(deadline)
        if not finished:
            waiter.send_signal(signal.SIGKILL)
            waiter.pump(time.monotonic() + KILL_WAIT_S)
            raise subprocess.TimeoutExpired(args, timeout, output=_captured(waiter))
    except KeyboardInterrupt:
        waiter.send_signal(signal.SIGINT)
        if not waiter.pump(time.monotonic() + INTERRUPT_GRACE_S):
            waiter.send_signal(signal.SIGKILL)
            waiter.pump(time.monotonic() + KILL_WAIT_S)
        raise
    except BaseException:
        waiter.send_signal(signal.SIGKILL)
        raise
    finally:
        waiter.close()


def wait_relaying(waiter: StepWait, args, timeout: Optional[float], start: float,
                  mirror: Mirror) -> None:
    """Wait as the process standing for the step (the CLI): every catchable signal is
    relayed and the step's stops are mirrored (``mirror``, installed before the step was
    submitted); a Ctrl-C is the step's to act on, with no kill after a grace (the shell waits
    for its command as long as it runs). After ``timeout`` the step and everything it started
    are killed."""
    waiter.on_stopped = mirror.on_stopped
    mirror.program = lambda: waiter.events.get("started", {}).get("pid")
    mirror.relay_to(waiter.send_signal)
    try:
        if not waiter.pump(None if timeout is None else start + timeout):
            waiter.send_signal(signal.SIGKILL)
            waiter.pump(time.monotonic() + KILL_WAIT_S)
            raise subprocess.TimeoutExpired(args, timeout, output=_captured(waiter))
    except BaseException:
        waiter.send_signal(signal.SIGKILL)
        raise
    finally:
        mirror.uninstall()
        waiter.close()


def _captured(waiter: StepWait) -> Optional[str]:
    return decode(waiter.output) if waiter.out_r is not None else None


def decode(data: bytes) -> str:
    """Like ``text=True``: locale encoding, universal newlines (never raises on bad bytes)."""
    encoding = locale.getpreferredencoding(False)
    return io.TextIOWrapper(io.BytesIO(bytes(data)), encoding=encoding, errors="replace").read()


def run_subprocess(args, cwd, env, timeout, check, echo, reason, capture=True,
                   relay=False, held_by=None) -> StepResult:
    """The plain path: ``subprocess.run`` semantics, the step in its own process group.
    ``capture`` False: the step writes to the caller's own stdout and stderr. ``relay``: this
    process stands for the step (``wait_relaying``), its signals going to the step's group.
    ``held_by``: connects to the zygote that forks the step's interpreters, which then ends the
    step's group if this process ends first (``hold``)."""
    start = time.monotonic()
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT} if capture else {}
    mirror = Mirror() if relay else None  # in place before the step runs (``wait_relaying``)
    if mirror is not None:
        mirror.install()
    try:
        proc = subprocess.Popen(args, cwd=cwd, env=env, **pipe, **OWN_PROCESS_GROUP)
    except BaseException:
        if mirror is not None:
            mirror.uninstall()
        raise
    held = hold(held_by, proc.pid)
    try:
        return _finish_subprocess(proc, args, timeout, check, echo, reason, capture, mirror, start)
    finally:
        if held is not None:  # the step ended while we were here: the zygote lets it be
            protocol.send_op(held, "release")
            held.close()


def hold(connect, pgid: int) -> Optional[socket.socket]:
    """A connection on which the zygote holds process group ``pgid``: it kills the group when
    the connection ends without ``release`` (this process died: a step lives as long as its
    caller, as a forked step does). None without a zygote."""
    if connect is None:
        return None
    try:
        sock = connect()
    except OSError:
        return None
    try:
        protocol.send_request(sock, {"op": "hold", "pgid": pgid}, [])
    except OSError:
        sock.close()
        return None
    return sock


def _finish_subprocess(proc: subprocess.Popen, args, timeout, check, echo, reason, capture,
                       mirror: Optional[Mirror], start: float) -> StepResult:
    with proc:
        chunks: list[bytes] = []
        reader = threading.Thread(target=_pump_pipe, args=(proc, chunks, echo), daemon=True)
        if capture:
            reader.start()
        try:
            if mirror is not None:
                _wait_relaying_for(proc, timeout, mirror)
            else:
                proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
            _join(reader)
            raise subprocess.TimeoutExpired(args, timeout, output=decode(b"".join(chunks))
                                            if capture else None)
        except BaseException:
            kill_group(proc.pid)
            raise
        kill_group(proc.pid)  # grandchildren go with the step, as in the zygote path
        _join(reader)
    output = decode(b"".join(chunks)) if capture else None
    result = StepResult(args, proc.returncode, output, None, via="subprocess", reason=reason)
    result.seconds = time.monotonic() - start
    if check and result.returncode:
        raise subprocess.CalledProcessError(result.returncode, args, output)
    return result


def _wait_relaying_for(proc: subprocess.Popen, timeout: Optional[float],
                       mirror: Mirror) -> None:
    """``proc.wait(timeout)`` as the process standing for it: signals relayed to its group,
    its stops mirrored."""
    mirror.relay_to(lambda signum: kill_group(proc.pid, signum))
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while proc.returncode is None:
            flags = os.WEXITED | os.WSTOPPED | (0 if deadline is None else os.WNOHANG)
            relayed = mirror.sent  # a SIGCONT relayed from here on may have ended the stop
            info = os.waitid(os.P_PID, proc.pid, flags | os.WNOWAIT)
            if info is not None and info.si_code == os.CLD_STOPPED:
                os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WNOHANG)  # reported once
                mirror.on_stopped(info.si_status, relayed)
            elif info is not None:
                proc.wait()
            elif time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            else:
                time.sleep(min(0.05, deadline - time.monotonic()))
    finally:
        mirror.uninstall()


def _pump_pipe(proc: subprocess.Popen, chunks: list, echo: bool) -> None:
    for chunk in iter(lambda: proc.stdout.read1(1 << 16), b""):
        chunks.append(chunk)
        if echo:
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()


def _join(reader: threading.Thread) -> None:
    if reader.ident is not None:
        reader.join(EXIT_DRAIN_S)


def kill_group(pgid: int, signum: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
