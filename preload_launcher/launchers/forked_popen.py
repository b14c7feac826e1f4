"""``subprocess.Popen`` of one command, forked from this process instead of executed.

A launcher that starts its program through ``subprocess.Popen`` (accelerate's single-process
launch, directly or through ``psutil.Popen``, which wraps it) keeps all of its own handling of
that process: its pipes, ``wait``/``poll``, signals, ``psutil``'s view of it. Only the start
differs: while ``forking(command, body)`` is active, a ``Popen`` of exactly that command, with
no options beyond its stdio and environment, forks a child that runs ``body(env)`` where an
exec'd program would start; any other ``Popen`` executes as always.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
from typing import Callable, Iterator, Optional

from ..step import runtime

__all__ = ["forking"]

# Options a forked start honours; a Popen that asks for more (cwd, a new session, ...) is exec'd.
FORKABLE_OPTIONS = frozenset({"env", "stdin", "stdout", "stderr"})


@contextlib.contextmanager
def forking(command: list[str], body: Callable[[dict], int]) -> Iterator[None]:
    """While active, ``subprocess.Popen(command, ...)`` forks ``body`` (see the module)."""
    real = subprocess.Popen
    subprocess.Popen = type("Popen", (ForkingPopen,), {"command": list(command),
                                                        "body": staticmethod(body)})
    try:
        yield
    finally:
        subprocess.Popen = real


class ForkingPopen(subprocess.Popen):
    """``subprocess.Popen`` whose ``command`` starts as a forked child running ``body(env)``;
    both are set per use by ``forking``. Everything but the start is subprocess's own."""

    command: list[str] = []
    body: Optional[Callable[[dict], int]] = None

    def __init__(self, args, *positional, **options) -> None:
        self._forks = (not positional and set(options) <= FORKABLE_OPTIONS
                       and isinstance(args, (list, tuple)) and list(args) == self.command)
        super().__init__(args, *positional, **options)

    # The POSIX signature, stable since python 3.6 up to ``errwrite``; the rest is passed on.
    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                       errread, errwrite, *rest) -> None:
        if not self._forks:
            super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                   startupinfo, creationflags, shell, p2cread, p2cwrite,
                                   c2pread, c2pwrite, errread, errwrite, *rest)
            return
        ends = (p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        program_env = dict(os.environ if env is None else env)

        def child() -> int:
            self._become_stdio(*ends)
            assert self.body is not None
            return self.body(program_env)

        self.pid = runtime.fork(child, new_group=False)
        self._child_created = True
        self._close_pipe_fds(*ends)  # the child's ends, as after an exec

    def _become_stdio(self, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite) -> None:
        """In the child: its ends of the pipes become fds 0-2 and the parent's ends close, as
        an exec'd child has them (subprocess's own fds are close-on-exec)."""
        wanted = [(fd, target) for fd, target in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))
                  if fd != -1]
        parked = [(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3), target) for fd, target in wanted]
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        runtime.close_fds([fd for fd in (p2cwrite, c2pread, errread) if fd != -1])
        for fd, target in parked:
            os.dup2(fd, target)
        runtime.close_fds([fd for fd, _ in parked])
