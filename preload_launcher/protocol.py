"""The one wire between a caller, the zygote, a step's agent and its ranks (standard library only).

Requests: a 4-byte big-endian length, then a JSON object; fds ride on the first ``sendmsg``
(SCM_RIGHTS). One request per connection:

    op "step"    spec: StepSpec fields    fds: stdin, output (or a spawned interpreter's fds)
    op "status"                           the zygote answers with a "status" event
    op "stop"                             the zygote answers "stopping" and ends its steps
    op "hold"    pgid                     the caller's own subprocess step (whose interpreters
                                          the zygote forks): the zygote kills its group when
                                          the connection ends without op "release"

The same frame carries a step to a pre-warmed child and a rank's orders (a StepSpec) from its
agent. After a "step" request the caller may write op lines on the connection:

    op "signal"  signum                   forwarded to the step's process group

Events are JSON lines, read by one ``EventReader`` per connection:

    started   pid          the step's process exists
    exec      t            user code begins (wall clock); the launcher's overhead ends here
    error     type, errno, strerror, filename   set-up failed before user code (cwd, stdio)
    fallback  reason, retire, retry   the zygote cannot serve this step: run it as a process
              (import_env, set_while_importing: the zygote's, grown since the caller asked)
    fresh     reason       the step runs on as a fresh interpreter (``rerun``)
    exit      returncode   the step ended (reported by the step itself, and again by its reaper)
    status    (the zygote's status)   answer to op "status"
    stopping  pid          answer to op "stop"
    staying   steps        on a zygote's "alive" socket, once its starter is done with it: it
                           stopped serving and stays only as the parent of these steps
    refused   reason       the peer's uid differs

EOF before ``exit`` means the zygote died.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct

__all__ = ["MAX_FRAME", "OPS", "EVENTS", "ProtocolError", "send_request", "recv_request",
           "recv_request_blocking", "RequestReader", "send_event", "send_op", "EventReader",
           "read_events_until_eof", "drain", "peer_uid"]

HEADER = struct.Struct("!I")
MAX_FRAME = 256 * 1024 * 1024  # argv + env; far above what exec() itself accepts
MAX_FDS = 32  # stdio, the caller's connection, and fds a spawning process passes
FIRST_SEND = 65536

# op -> required fields; event -> required fields.
OPS = {"step": ("spec",), "status": (), "stop": (), "signal": ("signum",),
       "ran_fresh": ("reason",), "hold": ("pgid",), "release": ()}
EVENTS = {"started": ("pid",), "exec": ("t",),
          "error": ("type", "errno", "strerror", "filename"),
          "fallback": ("reason",), "fresh": ("reason",), "exit": ("returncode",),
          "stopped": ("signum", "relayed"), "status": ("pid",),
          "stopping": ("pid",), "staying": ("steps",), "refused": ("reason",), "granted": ("gpus", "waited_s")}


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (as the kernel saw it connect
    or listen): both ends check it is their own."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class ProtocolError(ValueError):
    """A malformed, oversized or unknown frame or line."""


def _check(message: dict, kind: str, table: dict) -> dict:
    name = message.get(kind)
    if name not in table:
        raise ProtocolError(f"unknown {kind} {name!r}")
    missing = [f for f in table[name] if f not in message]
    if missing:
        raise ProtocolError(f"{kind} {name!r} lacks {', '.join(missing)}")
    return message


def send_request(sock: socket.socket, request: dict, fds: list[int]) -> None:
    """One request frame with its fds. ``request`` is an op (checked) or a bare StepSpec/orders
    object handed to a waiting child."""
    if "op" in request:
        _check(request, "op", OPS)
    payload = json.dumps(request).encode("utf-8", "surrogatepass")
    data = HEADER.pack(len(payload)) + payload
    # socket.send_fds, with the flags it takes but does not pass on (CPython up to 3.13)
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data[:FIRST_SEND]], rights, socket.MSG_NOSIGNAL)
    if sent < len(data):  # never send(b""): the zygote may have answered and closed already
        sock.sendall(data[sent:], socket.MSG_NOSIGNAL)


def _read_frame(sock: socket.socket, first: bytes) -> dict:
    if len(first) < HEADER.size:
        raise ProtocolError("short frame")
    (size,) = HEADER.unpack_from(first)
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME}")
    buf = bytearray(first[HEADER.size:])
    while len(buf) < size:
        chunk = sock.recv(min(1 << 20, size - len(buf)))
        if not chunk:
            raise ProtocolError("connection closed mid-frame")
        buf += chunk
    return _json_object(bytes(buf))


def _json_object(data: bytes) -> dict:
    try:
        message = json.loads(data.decode("utf-8", "surrogatepass"))
    except ValueError as err:
        raise ProtocolError(f"bad JSON: {err}") from None
    if not isinstance(message, dict):
        raise ProtocolError("not a JSON object")
    return message


def recv_request(sock: socket.socket) -> tuple[dict, list[int]]:
    """Read one request frame; returns the decoded object and the fds that came with it (closed
    here when the frame is bad)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, FIRST_SEND, MAX_FDS)
    try:
        return _read_frame(sock, data), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def recv_request_blocking(sock: socket.socket) -> tuple[dict, list[int]]:
    """``recv_request`` that waits indefinitely (a warm child or a rank waiting for its step)."""
    sock.settimeout(None)
    request, fds = recv_request(sock)
    if not fds and not request:
        raise ProtocolError("empty hand-off")
    return request, fds


class RequestReader:
    """One request frame read piecewise from a non-blocking socket, as a selector loop reads it:
    a client that sends slowly (or nothing) delays nobody. Reads never go past the frame, so
    op lines sent right after it stay for the connection's ``EventReader``."""

    MAX_READ = 1 << 20

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.fds: list[int] = []

    def _wanted(self) -> int:
        if len(self.buf) < HEADER.size:
            return HEADER.size - len(self.buf)
        (size,) = HEADER.unpack_from(self.buf)
        if size > MAX_FRAME:
            raise ProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME}")
        return HEADER.size + size - len(self.buf)

    def feed(self) -> "tuple[dict, list[int]] | None":
        """Read what has arrived: the request and its fds once the frame is complete, else
        None. A bad or truncated frame raises ProtocolError or OSError (its fds closed)."""
        try:
            while True:
                wanted = self._wanted()
                if wanted == 0:
                    request = _json_object(bytes(self.buf[HEADER.size:]))
                    fds, self.fds = self.fds, []
                    return request, fds
                data, fds, _flags, _addr = socket.recv_fds(self.sock, min(wanted, self.MAX_READ),
                                                           MAX_FDS)
                self.fds += fds
                if not data:
                    raise ProtocolError("connection closed mid-frame" if self.buf
                                        else "short frame")
                self.buf += data
        except BlockingIOError:
            return None
        except BaseException:
            self.close_fds()
            raise

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _line(message: dict) -> bytes:
    return (json.dumps(message) + "\n").encode()


def _write(sock_or_fd, data: bytes) -> None:
    """Write a whole line; never raises on a vanished peer (the reader decides what EOF means).
    A socket's write raises no SIGPIPE either: a process relaying every signal (a stand-in, the
    CLI) would relay its own SIGPIPE over the same dead connection, and again, without end."""
    try:
        if isinstance(sock_or_fd, int):
            view = memoryview(data)
            while view:
                view = view[os.write(sock_or_fd, view):]
        else:
            sock_or_fd.sendall(data, socket.MSG_NOSIGNAL)
    except OSError:
        pass


def send_event(sock_or_fd, event: str, **fields) -> None:
    _write(sock_or_fd, _line(_check({"event": event, **fields}, "event", EVENTS)))


def send_op(sock_or_fd, op: str, **fields) -> None:
    """An op line on a running step's connection (``signal``; ``ran_fresh``: a stand-in heard that its
    program became a fresh interpreter, so the zygote does not count it as forked)."""
    _write(sock_or_fd, _line(_check({"op": op, **fields}, "op", OPS)))


class EventReader:
    """Splits one connection's byte stream into JSON messages; keeps a partial line for the
    next ``feed``, so there is exactly one reader per connection."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[dict]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        messages = []
        for line in lines:
            if not line.strip():
                continue
            message = _json_object(line)
            messages.append(_check(message, "event", EVENTS) if "event" in message
                            else _check(message, "op", OPS))
        return messages


def read_events_until_eof(sock: socket.socket) -> list[dict]:
    """Every event a peer sends until it closes the connection (a one-shot answer)."""
    reader = EventReader()
    events: list[dict] = []
    while data := sock.recv(1 << 16):
        events += reader.feed(data)
    return events


def drain(fd: int) -> None:
    """Empty a non-blocking pipe (a signal wakeup fd) of what has been written so far."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
