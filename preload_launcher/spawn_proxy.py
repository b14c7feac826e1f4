"""Stage 5b: the interpreter a step's ``multiprocessing`` starts, served by the zygote.

A step's ``spawn``/``forkserver`` children and its resource tracker are new interpreters that
import the step's main module again: with torch and megatron-core, seconds each (megatron's
distributed-checkpoint writer starts one per save). Inside a step, ``multiprocessing`` runs
this file instead of ``python`` (``set_executable``); it asks the zygote to fork the same
command with the same fds, then stands in for it: signals it receives are forwarded and it
exits with the child's status, so ``Process.pid``/``join``/``terminate`` work unchanged.
Anything the zygote cannot serve becomes the real interpreter (``execv``), fds intact.

The zygote writes this source behind a ``#!python -IS`` line, the socket path (``SOCKET``)
and the source of ``protocol`` (``PROTOCOL_SOURCE``, the one wire) as an executable file: the
standard library only, so it starts in milliseconds.
"""

import os
import signal
import socket
import sys
import types

if __name__ != "__main__":  # imported by the zygote; the written executable embeds protocol
    from . import protocol

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def inherited_fds() -> list:
    """The fds the spawning process passed, besides stdio (nothing else is open yet)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.fstat(fd)
            except OSError:
                continue  # the directory listing's own fd, closed by now
            fds.append(fd)
    return sorted(fds)


def become_python(argv: list) -> None:
    """Run the command with the real interpreter, as if this proxy had never been there."""
    os.execv(sys.executable, [sys.executable, *argv])


def exit_like(code: int) -> None:
    """Exit with the child's status: a code, or death by the same signal."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def send_step(sock: socket.socket, argv: list, fds: list) -> None:
    spec = {"args": [sys.executable, *argv], "env": dict(os.environ), "cwd": os.getcwd(),
            "spawned": True, "fd_targets": [0, 1, 2, *fds]}
    protocol.send_request(sock, {"op": "step", "spec": spec}, [0, 1, 2, *fds])


def forward_signals(sock: socket.socket) -> None:
    def forward(signum, _frame):
        protocol.send_op(sock, "signal", signum=signum)
    for signum in FORWARDED:
        signal.signal(signum, forward)


def write_executable(path: str, socket_path: str) -> bool:
    """Write this proxy as an executable for the zygote at ``socket_path``; False where it
    could not run (a ``noexec`` directory, a shebang line too long for the kernel)."""
    shebang = f"#!{sys.executable} -IS\n"
    if len(shebang) > 127 or os.statvfs(os.path.dirname(path)).f_flag & os.ST_NOEXEC:
        return False
    with open(__file__, encoding="utf-8") as f:
        source = f.read()
    with open(protocol.__file__, encoding="utf-8") as f:
        protocol_source = f.read()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(f"{shebang}SOCKET = {socket_path!r}\nPROTOCOL_SOURCE = {protocol_source!r}\n"
                + source)
    return True


def embedded_module(name: str, source: str) -> types.ModuleType:
    """A module made from source text carried in this file (no package to import it from)."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def main(socket_path: str) -> None:
    argv = sys.argv[1:]
    fds = inherited_fds()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
        send_step(sock, argv, fds)
    except OSError:
        sock.close()
        become_python(argv)  # the zygote is gone: the plain way
    running = False
    reader = protocol.EventReader()
    while True:
        try:
            data = sock.recv(65536)
        except InterruptedError:
            continue
        if not data:
            if not running:
                become_python(argv)
            exit_like(-signal.SIGKILL)  # the zygote died, and the child with it
        for event in reader.feed(data):
            kind = event.get("event")
            if kind == "exec" and not running:
                running = True
                for fd in fds:  # the child holds them now
                    os.close(fd)
                forward_signals(sock)
            elif kind in ("fallback", "error", "refused") and not running:
                sock.close()
                become_python(argv)  # python itself reports what went wrong, if anything
            elif kind == "exit":
                exit_like(int(event["returncode"]))


if __name__ == "__main__":  # the written executable: SOCKET and PROTOCOL_SOURCE precede this
    protocol = embedded_module("preload_launcher_protocol", PROTOCOL_SOURCE)  # noqa: F821
    main(SOCKET)  # noqa: F821
