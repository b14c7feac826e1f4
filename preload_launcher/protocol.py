"""Wire format between client and zygote: one request frame with fds, then JSON-line events.

Request: 4-byte big-endian length, then a JSON object; the step's stdin and output fds ride
on the first ``sendmsg`` (SCM_RIGHTS). Events (zygote and child -> client) are single JSON
lines: ``started`` (pid), ``exec`` (user code begins), ``error`` (setup failed before user
code), ``fallback`` (the zygote cannot serve this step) and ``exit`` (the wait status).
EOF before ``exit`` means the zygote died.
"""

from __future__ import annotations

import json
import os
import socket
import struct

__all__ = ["MAX_FRAME", "send_request", "recv_request", "send_event", "drain", "EventReader",
           "ProtocolError"]

HEADER = struct.Struct("!I")
MAX_FRAME = 256 * 1024 * 1024  # argv + env; far above what exec() itself accepts
MAX_FDS = 32  # stdio, the caller's connection, and fds a spawning process passes


class ProtocolError(ValueError):
    """A malformed or oversized frame."""


def send_request(sock: socket.socket, request: dict, fds: list[int]) -> None:
    payload = json.dumps(request).encode("utf-8", "surrogatepass")
    data = HEADER.pack(len(payload)) + payload
    sent = socket.send_fds(sock, [data[:65536]], fds)
    if sent < len(data):  # never send(b""): the zygote may have answered and closed already
        sock.sendall(data[sent:])


def recv_request(sock: socket.socket) -> tuple[dict, list[int]]:
    """Read one request frame; returns the decoded object and the fds that came with it."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, MAX_FDS)
    try:
        if len(data) < HEADER.size:
            raise ProtocolError("short frame")
        (size,) = HEADER.unpack_from(data)
        if size > MAX_FRAME:
            raise ProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME}")
        buf = bytearray(data[HEADER.size:])
        while len(buf) < size:
            chunk = sock.recv(min(1 << 20, size - len(buf)))
            if not chunk:
                raise ProtocolError("connection closed mid-frame")
            buf += chunk
        try:
            request = json.loads(bytes(buf).decode("utf-8", "surrogatepass"))
        except ValueError as err:
            raise ProtocolError(f"bad JSON: {err}") from None
        if not isinstance(request, dict):
            raise ProtocolError("request is not an object")
        return request, fds
    except BaseException:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        raise


def recv_request_blocking(sock: socket.socket) -> tuple[dict, list[int]]:
    """``recv_request`` that waits indefinitely (a warm child waiting for its step)."""
    sock.settimeout(None)
    request, fds = recv_request(sock)
    if not fds and not request:
        raise ProtocolError("empty hand-off")
    return request, fds


def send_event(sock_or_fd, event: str, **fields) -> None:
    """Send one event line; never raises on a vanished peer (the caller decides what EOF means)."""
    line = (json.dumps({"event": event, **fields}) + "\n").encode()
    try:
        if isinstance(sock_or_fd, int):
            os.write(sock_or_fd, line)
        else:
            sock_or_fd.sendall(line)
    except OSError:
        pass


def drain(fd: int) -> None:
    """Empty a non-blocking pipe (a signal wakeup fd) of what has been written so far."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


class EventReader:
    """Splits a byte stream into JSON event dicts."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[dict]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]
