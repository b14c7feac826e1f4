"""A running step as the zygote sees it, and how a signal for it is delivered."""

from __future__ import annotations

import os
import socket

from .. import protocol
from ..step import runtime

__all__ = ["Step", "Hold"]


class Step:
    """A running step as the zygote sees it: its process and its caller's connection.
    ``standin``: a program a stand-in asked for owns what the real one would: a signal is its
    own, and the processes it leaves behind live on; other steps' groups go with them."""

    def __init__(self, pid: int, conn: socket.socket, standin: bool = False) -> None:
        self.pid = pid
        self.conn = conn
        self.standin = standin
        self.reader = protocol.EventReader()
        self.relayed = 0  # its caller's signals delivered so far (a stop report says how many)

    def signal(self, signum: int) -> None:
        self.relayed += 1
        if not self.standin:
            runtime.signal_group(self.pid, signum)
            return
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass


class Hold:
    """A caller's step run as a subprocess (a shell step whose interpreters this zygote forks):
    its process group is killed when the caller's connection ends without ``release``, as a
    forked step is when its caller goes (pytest-timeout's ``os._exit``)."""

    def __init__(self, pgid: int, conn: socket.socket) -> None:
        self.pgid = pgid
        self.conn = conn
        self.reader = protocol.EventReader()
        self.released = False
