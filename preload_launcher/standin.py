"""Stage 5b: stand-ins for the interpreters a step starts, served by the zygote.

Two kinds of step start interpreters of their own, each paying the full import again:

* a step's ``multiprocessing`` starts ``spawn``/``forkserver`` children and a resource tracker
  (megatron's distributed-checkpoint writer starts one per save). Inside a step,
  ``multiprocessing`` runs the stand-in instead of ``python`` (``set_executable``);
* a step that is not served directly (a shell script, ``env … python``, ``make``) runs as a
  subprocess with a directory of stand-ins first on its ``PATH``: ``python``, ``python3``,
  ``python3.X``, ``torchrun`` and ``accelerate``, links to the same file, for the names that
  start this interpreter there.

A stand-in asks the zygote to fork the same command with its own fds, cwd and environment
(the stand-in directory taken off ``PATH``, so the program reads what it would without it),
then stands for it (``mirroring``): every catchable signal it receives is relayed, it stops
when the program stops and ends as the program ended, a signal included, so the caller's
``wait``/``kill`` and a shell's job control work unchanged. Anything the zygote cannot serve, or a zygote
that is gone, becomes the real program (``execve``), fds intact.

A launcher of ranks (``torchrun``, ``accelerate launch``) started while the zygote still
preloads (or restarts) waits until it serves, then asks: it and its ranks import the stack, and
the preload, started earlier, is usually done sooner than they would be. It waits without
asking (nothing of the program's sits in the zygote's backlog), gives up for the real program
if the zygote goes, and lets a signal sent meanwhile end it as it would end the program at its
start. Any other program runs as itself at once, as a light one (``python -c …`` with a short
timeout) must not wait for a preload it does not need; each such run is noted for the summary.

``install`` writes this source behind a ``#!python -IS`` line, the socket path (``SOCKET``) and
the source of ``protocol`` (``PROTOCOL_SOURCE``, the one wire), of ``process_attrs`` (what a
program inherits from its caller, sent with the request) and of ``mirroring`` (standing for
the program): the standard library only, so a stand-in starts in milliseconds.
"""

import collections
import os
import signal
import socket
import sys
import time
import types

if __name__ != "__main__":  # imported by the launcher; the written executable embeds protocol
    from . import mirroring, process_attrs, protocol
    from .files import zygote_files
    from .rundir import owned_privately

PROGRAM = "standin"  # the file multiprocessing runs; the named links beside it are for PATH
# Set only for a stand-in run in place of a program a test process started (suite_wide):
# "real path\nargv[0]"; taken out of the environment before anything else sees it.
STANDS_IN_FOR = "_PRELOAD_LAUNCHER_STANDS_IN_FOR"
# Beside the stand-ins: a line for each program a stand-in ran as itself because the zygote
# was not serving yet (the zygote never hears of those; the caller's summary counts them).
RAN_REAL = "ran-real"
WHILE_PRELOADING = "the zygote was still preloading"
GONE = "the zygote ended before it served"
SIGNALLED = "signalled"  # while waiting: ends like the program at its start; not counted
WAIT_POLL_S = 0.05  # a launcher's look for the zygote's ready mark while it preloads
ALIVE_EVERY_S = 1.0  # and whether the zygote still listens
# Signals that do not end or stop a program by default: one of these does not end a wait.
HARMLESS = {signal.SIGCHLD, signal.SIGWINCH, signal.SIGURG, signal.SIGCONT}


def nested_names() -> tuple:
    """The programs a step's PATH can have stood in for, in a fixed order."""
    return ("python", "python3", "python%d.%d" % sys.version_info[:2], "torchrun", "accelerate")


# ---------------------------------------------------------------- the launcher's side

def install(socket_path: str) -> str:
    """Write the stand-in for the zygote at ``socket_path`` into its stand-ins' directory;
    returns its path, or "" where it could not run (a ``noexec`` directory, a shebang line
    too long)."""
    directory = zygote_files(socket_path)["standins"]
    shebang = f"#!{sys.executable} -IS\n"
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if len(shebang) > 127 or os.statvfs(directory).f_flag & os.ST_NOEXEC:
        return ""
    with open(__file__, encoding="utf-8") as f:
        source = f.read()
    with open(protocol.__file__, encoding="utf-8") as f:
        protocol_source = f.read()
    with open(process_attrs.__file__, encoding="utf-8") as f:
        attrs_source = f.read()
    with open(mirroring.__file__, encoding="utf-8") as f:
        mirroring_source = f.read()
    path = os.path.join(directory, PROGRAM)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(f"{shebang}SOCKET = {socket_path!r}\n"
                f"READY = {zygote_files(socket_path)['ready']!r}\n"
                f"RAN_REAL_LOG = {ran_real_log(socket_path)!r}\n"
                f"PROTOCOL_SOURCE = {protocol_source!r}\n"
                f"PROCESS_ATTRS_SOURCE = {attrs_source!r}\n"
                f"MIRRORING_SOURCE = {mirroring_source!r}\n" + source)
    os.replace(tmp, path)  # a step never runs a half-written stand-in
    # Made here, so that a stand-in appending to it never makes the directory anew after the
    # zygote's files went (it opens it without O_CREAT).
    os.close(os.open(ran_real_log(socket_path),
                     os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    return path if trusted(path) else ""


def installed(socket_path: str) -> str:
    """The stand-in program installed for the zygote at ``socket_path``, or "" when none is
    (or when it is not one we may trust)."""
    program = os.path.join(zygote_files(socket_path)["standins"], PROGRAM)
    return program if os.access(program, os.X_OK) and trusted(program) else ""


def trusted(program: str) -> bool:
    """Whether ``program`` may stand in for a step's interpreters: it, its directory and the
    runtime directory holding that are ours, and no one else can write to them."""
    directory = os.path.dirname(program)
    return all(owned_privately(p) for p in (program, directory, os.path.dirname(directory)))


def ran_real_log(socket_path: str) -> str:
    return os.path.join(zygote_files(socket_path)["standins"], RAN_REAL)


def ran_real(socket_path: str, since: int = 0) -> collections.Counter:
    """{why: how many} of the programs stand-ins ran as themselves without asking the zygote
    at ``socket_path``, from offset ``since`` of its record (``ran_real_size`` earlier)."""
    try:
        with open(ran_real_log(socket_path), "rb") as f:
            f.seek(since)
            return collections.Counter(line.strip().decode() for line in f if line.strip())
    except OSError:
        return collections.Counter()


def ran_real_size(socket_path: str) -> int:
    try:
        return os.stat(ran_real_log(socket_path)).st_size
    except OSError:
        return 0


def path_entry(directory: str, names: list) -> str:
    """A directory holding stand-ins for exactly ``names`` (links to the installed program),
    made once per set of names: a step's ``command -v`` finds only what its PATH has; ""
    when the one there is not ours alone."""
    mask = sum(1 << i for i, name in enumerate(nested_names()) if name in names)
    entry = os.path.join(directory, format(mask, "x"))
    if not os.path.isdir(entry):
        tmp = f"{entry}.{os.getpid()}.{id(names)}.tmp"
        os.makedirs(tmp, mode=0o700)
        for name in names:
            os.symlink(os.path.join("..", PROGRAM), os.path.join(tmp, name))
        try:
            os.rename(tmp, entry)
        except OSError:  # another thread or process made it first
            for name in names:
                os.unlink(os.path.join(tmp, name))
            os.rmdir(tmp)
    return entry if owned_privately(entry) else ""


# ---------------------------------------------------------------- the stand-in's side

def open_stdio() -> list:
    """Which of fds 0-2 are open."""
    found = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            continue
        found.append(fd)
    return found


def inherited_fds() -> list:
    """The fds the starting process passed, besides stdio (nothing else is open yet)."""
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


class Invocation:
    """What this stand-in was started as: the command to ask for, and the real program."""

    def __init__(self, argv: list, environ: dict) -> None:
        here = os.path.dirname(os.path.abspath(argv[0]))
        self.name = os.path.basename(argv[0])
        self.env = dict(environ)
        self.mirror = mirroring.Mirror()
        redirected = self.env.pop(STANDS_IN_FOR, None)
        if redirected is not None:  # a test process's launch (suite_wide): the program it named
            self.real, argv0 = redirected.split("\n", 1)
            self.name, self.spawned = os.path.basename(self.real), False
            self.args = [argv0, *argv[1:]]  # the kernel's #! handling replaced argv[0]
            return
        self.spawned = self.name not in nested_names()
        if self.spawned:  # multiprocessing's interpreter: this one, as multiprocessing named it
            self.real, self.args = sys.executable, [sys.executable, *argv[1:]]
            return
        # Named on PATH: the program the name finds once the stand-ins are off PATH, called as
        # the caller typed it (python's messages quote argv[0]).
        entries = environ.get("PATH", os.defpath).split(os.pathsep)
        self.env["PATH"] = os.pathsep.join(e for e in entries if os.path.abspath(e or ".") != here)
        self.real = which(self.name, self.env["PATH"])
        self.args = [self.name, *argv[1:]]

    def waits_for_preload(self) -> bool:
        """Whether this program is a launcher of ranks, worth waiting for a preload under way
        (not for its help or version)."""
        if {"-h", "--help", "--version"} & set(self.args[1:]):
            return False
        return self.name == "torchrun" or (self.name == "accelerate"
                                           and self.args[1:2] == ["launch"])

    def request(self, fds: list) -> dict:
        return {"args": self.args, "env": self.env, "cwd": os.getcwd(), "spawned": self.spawned,
                "nested": not self.spawned, "fd_targets": fds,
                "process": dict(process_attrs.capture(), **process_attrs.place())}

    def become_real(self) -> None:
        """Run the real program, as if this stand-in had never been there (a signal held for
        a program that never ran is ours again, as it would have met the program's start)."""
        self.mirror.uninstall()
        if not self.real:
            os.write(2, f"{self.name}: command not found\n".encode())
            mirroring.die_like(127)
        os.execve(self.real, self.args, self.env)


def which(name: str, path: str) -> str:
    for entry in path.split(os.pathsep):
        candidate = os.path.join(entry or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return ""


def embedded_module(name: str, source: str) -> types.ModuleType:
    """A module made from source text carried in this file (no package to import it from)."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def listening(socket_path: str) -> bool:
    """Whether a live socket is bound to ``socket_path`` (a zygote killed while preloading
    leaves its file behind; ``/proc/net/unix`` lists live sockets only)."""
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            return any(line.rstrip("\n").endswith(" " + socket_path) for line in f)
    except OSError:
        return os.path.exists(socket_path)


def wait_until_serving(socket_path: str, ready: str, mirror) -> str:
    """A launcher's wait for a zygote that preloads: "" once it serves; why not otherwise (it
    has gone, or a signal that ends or stops a program came meanwhile: the real program then
    meets it at its start, as without us)."""
    alive_at = time.monotonic() + ALIVE_EVERY_S
    while not os.path.exists(ready):
        if set(mirror.held) - HARMLESS:
            return SIGNALLED
        if not os.path.exists(socket_path):
            return GONE
        if time.monotonic() >= alive_at:
            if not listening(socket_path):
                return GONE
            alive_at = time.monotonic() + ALIVE_EVERY_S
        time.sleep(WAIT_POLL_S)
    return ""


def submit(socket_path: str, ready: str, ran_real_log: str, invocation: Invocation,
           fds: list) -> socket.socket:
    """The request sent to the zygote, or the real program where none serves now."""
    if not os.path.exists(ready):
        why = (wait_until_serving(socket_path, ready, invocation.mirror)
               if invocation.waits_for_preload() else WHILE_PRELOADING)
        if why:
            if why != SIGNALLED:
                note_ran_real(ran_real_log, why)
            invocation.become_real()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
        if protocol.peer_uid(sock) != os.getuid():  # not our zygote: never tell it anything
            raise ConnectionRefusedError(socket_path)
        protocol.send_request(sock, {"op": "step", "spec": invocation.request(fds)}, fds)
    except OSError:
        sock.close()
        invocation.become_real()  # the zygote is gone: the plain way
    return sock


def note_ran_real(log: str, reason: str) -> None:
    try:  # one line in one write: appends from many stand-ins never interleave
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # a zygote gone with its files: nobody is left to count it
    try:
        os.write(fd, (reason + "\n").encode())
    finally:
        os.close(fd)


def main(socket_path: str, ready: str, ran_real_log: str) -> None:
    invocation = Invocation(sys.argv, dict(os.environ))
    stdio = open_stdio()  # a closed stdin stays closed in the program
    fds = stdio + inherited_fds()
    # In place before the request: the program may say it is ready at once, and what is sent
    # to us from then on is meant for it (held until the request is sent).
    invocation.mirror.install()
    sock = submit(socket_path, ready, ran_real_log, invocation, fds)
    mirror = invocation.mirror
    mirror.relay_to(lambda signum: protocol.send_op(sock, "signal", signum=signum))
    running = False
    reader = protocol.EventReader()
    while True:
        try:
            data = sock.recv(65536)
        except InterruptedError:
            continue
        except ConnectionResetError:  # the zygote ended with our request unread in its backlog
            data = b""
        if not data:
            if not running:
                invocation.become_real()
            mirroring.die_like(-signal.SIGKILL)  # the zygote died, and the child with it
        for event in reader.feed(data):
            kind = event.get("event")
            if kind == "started":
                mirror.program = lambda pid=int(event["pid"]): pid
            elif kind == "exec" and not running:
                running = True
                for fd in fds[len(stdio):]:  # the child holds them now
                    os.close(fd)
            elif kind == "stopped":
                mirror.on_stopped(int(event["signum"]), int(event["relayed"]))
            elif kind == "fresh" and not event.get("rank"):  # it re-ran fresh: not a fork
                protocol.send_op(sock, "ran_fresh", reason=event["reason"])
            elif kind in ("fallback", "error", "refused") and not running:
                # The program itself reports what went wrong, if anything; a stale zygote that
                # restarts would keep it waiting for a whole preload.
                sock.close()
                invocation.become_real()
            elif kind == "exit":
                mirroring.die_like(int(event["returncode"]))


if __name__ == "__main__":  # the written executable: SOCKET and the sources precede this
    protocol = embedded_module("preload_launcher_protocol", PROTOCOL_SOURCE)  # noqa: F821
    process_attrs = embedded_module("preload_launcher_process_attrs", PROCESS_ATTRS_SOURCE)  # noqa: F821
    mirroring = embedded_module("preload_launcher_mirroring", MIRRORING_SOURCE)  # noqa: F821
    main(SOCKET, READY, RAN_REAL_LOG)  # noqa: F821
