"""The zygote handle: start one zygote (or attach to a running one), connect to it, submit a
step, ask for its status, close it.

``Launcher`` (client.py) chooses among these handles; this module knows one zygote only.
"""

from __future__ import annotations

import errno
import itertools
import os
import select
import socket
import subprocess
import sys
import threading
from typing import Mapping, Optional, Sequence

from .. import cuda, protocol, settings, standin
from ..caller_fds import guarded_stdio
from ..command import StepSpec, resolves_to_this_interpreter
from ..files import remove_all, roomy_pipe, unlink_all, zygote_files
from ..gpus import pool_ids as gpu_pool_ids
from ..interpreter import ZYGOTE_CWD, import_env_mismatch
from ..result import LauncherError
from ..rundir import MAX_SOCKET_PATH
from ..settings import Settings, ZygoteConfig
from .waiting import kill_group

__all__ = ["ZygoteProcess"]

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_zygote_ids = itertools.count()

# The zygote's command line: ``python -u -c BOOTSTRAP PKG_PARENT CONFIG_JSON``. sys.path keeps
# what a fresh interpreter has (minus sys.path[0], which -P/PYTHONSAFEPATH leaves out), whether
# or not the package is installed;
# ``startup`` is what python imported before any code ran (shadowing).
BOOTSTRAP = (
    "import sys; startup = frozenset(sys.modules); "
    "base = sys.path[0 if getattr(sys.flags, 'safe_path', 0) else 1:]; "
    "sys.path.insert(0, sys.argv[1]); from preload_launcher.step import shadowing; "
    "from preload_launcher.zygote import server; sys.path[:] = base; "
    "shadowing.startup_modules = startup; server.main(sys.argv[2], base)"
)


class ZygoteProcess:
    """One zygote: a preloaded interpreter listening on a private Unix socket."""

    def __init__(self, modules: Sequence[str], env: Mapping[str, str],
                 cache_dir: Optional[str] = None, socket_path: Optional[str] = None,
                 daemon: bool = False, project: Optional[str] = None,
                 profile: Optional[str] = None, idle_timeout_s: Optional[float] = None,
                 gpus: Optional[str] = None, implicit: bool = False,
                 lock_fd: int = -1) -> None:
        self.modules = list(modules)
        # Coverage starts per step, in the child; a measured zygote would hand its tracer down.
        # Per-test variables are the step's business, never the preload's; so are thread
        # counts, which each step sets for itself (what torch reports there is the default),
        # and the start-up settings a step applies itself or runs fresh for (``settings``).
        own = (settings.PER_TEST_ENV + settings.THREAD_ENV + settings.STEP_STARTUP_ENV
               + settings.FRESH_START_ENV)
        self.env = {k: v for k, v in env.items()
                    if not k.startswith(settings.COVERAGE_ENV_PREFIXES) and k not in own}
        self.settings = Settings.from_env(env)
        self.cache_dir = cache_dir or self.settings.cache_dir
        runtime = settings.runtime_dir()
        self.socket_path = socket_path or os.path.join(
            runtime, f"z-{os.getpid()}-{next(_zygote_ids)}.sock")
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise LauncherError(f"socket path {self.socket_path!r} is too long for a Unix socket; "
                                "set XDG_RUNTIME_DIR to a shorter directory")
        self.log_path = zygote_files(self.socket_path)["log"]
        self.standins = ""  # the stand-in program for this zygote's steps ("" = none)
        self.ran_real_from = 0  # where this caller's part of the stand-ins' record begins
        self.daemon = daemon
        # A daemon pre-warms by default where there are GPUs, unless `run` started it on its
        # own: that one holds no GPU memory the user did not ask for.
        self.warm_by_default = daemon and not implicit
        self.lock_fd = lock_fd  # a daemon's lock, handed to it to hold for life
        self.project = os.path.abspath(project or os.getcwd())
        profile = profile or self.settings.profile
        self.profile = os.path.abspath(profile) if profile else ""
        self.idle_timeout_s = idle_timeout_s if idle_timeout_s is not None \
            else self.settings.idle_timeout_s
        self.gpus = self.settings.gpus if gpus is None else gpus  # packing: "", auto, or ids
        self.process: Optional[subprocess.Popen] = None
        self.status: dict = {}
        self._alive: Optional[socket.socket] = None  # its end is EOF once we are done with it
        self._ready_r = -1
        self._ready, self._ready_lock = threading.Event(), threading.Lock()
        self._start_error: Optional[BaseException] = None

    # -------------------------------------------------------------- lifecycle

    def launch(self) -> "ZygoteProcess":
        """Start the zygote without waiting for its preload (see ``wait_ready``)."""
        with guarded_stdio():  # a closed fd 0-2 must not become the listener's or a pipe's
            self._launch()
        self.install_standins()
        return self

    def _launch(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unlink_all(self.socket_path)
        old_umask = os.umask(0o177)  # socket 0600
        try:
            listener.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        listener.listen(128)
        ready_r, ready_w = roomy_pipe()  # the zygote's status fits before we read it
        # A socket, not a pipe: the zygote answers on it that it stays for its steps.
        alive, alive_theirs = (None, None) if self.daemon else socket.socketpair()
        alive_r = alive_theirs.fileno() if alive_theirs else -1
        config = self.config(listener.fileno(), ready_w, alive_r)
        pass_fds = [fd for fd in (listener.fileno(), ready_w, alive_r, self.lock_fd) if fd >= 0]
        try:
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-u", "-c", BOOTSTRAP, PACKAGE_PARENT, config.to_json()],
                    env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    pass_fds=pass_fds, start_new_session=True, cwd=ZYGOTE_CWD)
        finally:
            listener.close()
            os.close(ready_w)
            if alive_theirs is not None:
                alive_theirs.close()
        self._alive, self._ready_r = alive, ready_r

    def install_standins(self) -> None:
        """Written here, not by the zygote, so a step may run before the preload is done: its
        stand-ins run the real program until the zygote serves (``standin.submit``)."""
        try:
            self.standins = standin.install(self.socket_path)
        except OSError:
            self.standins = ""

    def path_for(self, env: Mapping[str, str], cwd: str) -> Optional[str]:
        """``env``'s PATH with stand-ins first for the names there that start this interpreter
        (python, python3, python3.X, torchrun, accelerate); None when there are none."""
        if not self.standins or not standin.trusted(self.standins):
            return None
        names = [name for name in standin.nested_names()
                 if resolves_to_this_interpreter(name, env, cwd,
                                                 python_sibling=not name.startswith("python"))]
        if not names:
            return None
        entry = standin.path_entry(os.path.dirname(self.standins), names)
        if not entry:
            return None
        return os.pathsep.join([entry, env.get("PATH", os.defpath)])

    def config(self, listen_fd: int, ready_fd: int, alive_fd: int) -> ZygoteConfig:
        """The zygote's settings snapshot. Pre-warming is the daemon's default where there are
        GPUs: its warm children read as fresh processes (docs/performance.md), and a daemon is
        started to be kept warm."""
        s = self.settings
        wanted = s.prewarm if s.prewarm is not None else self.warm_by_default
        gpus = cuda.nvml_device_count(self.env) if wanted else 0
        prewarm = s.prewarm if s.prewarm is not None else self.warm_by_default and gpus > 0
        return ZygoteConfig(modules=self.modules, listen_fd=listen_fd, ready_fd=ready_fd,
                            socket_path=self.socket_path, cache_dir=self.cache_dir,
                            project=self.project, alive_fd=alive_fd, daemon=self.daemon,
                            learn=s.learn, learn_budget_s=s.learn_budget_s, prewarm=prewarm,
                            prewarm_ranks=s.prewarm_ranks if s.prewarm_ranks is not None else gpus,
                            profile=self.profile,
                            idle_timeout_s=self.idle_timeout_s if self.daemon else 0.0,
                            gpus=self.gpu_pool(), gpus_visible=self.env.get("CUDA_VISIBLE_DEVICES"),
                            lock_fd=self.lock_fd)

    def gpu_pool(self) -> list[str]:
        if not self.gpus:
            return []
        visible = self.env.get("CUDA_VISIBLE_DEVICES")
        count = cuda.nvml_device_count(self.env) if self.gpus == "auto" and visible is None else 0
        return gpu_pool_ids(self.gpus, visible, count)

    def wait_ready(self, progress=None) -> dict:
        """Block until the preload finished; returns the zygote's status. ``progress``: a
        stream (a terminal) to show the preload on, module by module, from the zygote's log.
        Threads may wait together: one reads the zygote's answer, the others then have it."""
        with self._ready_lock:
            return self._wait_ready(progress)

    def _wait_ready(self, progress) -> dict:
        if self._ready.is_set():
            if self._start_error:
                raise self._start_error
            return self.status
        data = b""
        shown = 0
        while not data.endswith(b"\n"):
            if progress is not None:
                shown = _show_progress(self.log_path, shown, progress)
                if not select.select([self._ready_r], [], [], 0.2)[0]:
                    continue
            chunk = os.read(self._ready_r, 1 << 16)
            if not chunk:
                break
            data += chunk
        if progress is not None:
            _show_progress(self.log_path, shown, progress)
        os.close(self._ready_r)
        if not data:
            self._start_error = LauncherError(
                f"zygote exited during preload (code {self.process.wait()}); "
                f"log: {self.log_path}\n{_tail(self.log_path)}")
            files = zygote_files(self.socket_path)  # its log stays: the error names it
            remove_all(files["socket"], files["standins"], files["ready"])
            self._ready.set()
            raise self._start_error
        self.status = protocol.EventReader().feed(data)[0]
        self._ready.set()
        return self.status

    def poll_ready(self) -> bool:
        """True once the preload has finished well; never waits for it."""
        if self._ready_lock.acquire(blocking=False):
            try:
                if not self._ready.is_set() and select.select([self._ready_r], [], [], 0)[0]:
                    self._wait_ready(None)
            except LauncherError:
                pass
            finally:
                self._ready_lock.release()
        return self._ready.is_set() and self._start_error is None

    def start(self, progress=None) -> "ZygoteProcess":
        self.launch()
        self.wait_ready(progress)
        return self

    @classmethod
    def attach(cls, socket_path: str) -> "ZygoteProcess":
        """A handle on a running zygote (a daemon); raises OSError when none answers there."""
        z = cls.__new__(cls)
        z.modules, z.env, z.socket_path, z.daemon, z.process = [], {}, socket_path, True, None
        z.lock_fd = -1
        z.settings = Settings()
        z.log_path, z.cache_dir, z._alive, z._ready_r = "", "", None, -1
        z._ready, z._start_error, z._ready_lock = threading.Event(), None, threading.Lock()
        z.status = z.request("status")
        z.modules = list(z.status["modules"])
        z.log_path = zygote_files(socket_path)["log"]
        z.standins = standin.installed(socket_path)
        z.ran_real_from = standin.ran_real_size(socket_path)  # earlier callers' runs are theirs
        z._ready.set()
        return z

    @classmethod
    def parent(cls) -> Optional["ZygoteProcess"]:
        """A handle on the zygote that forked this process (its parent), or None. Its command
        line (``python -u -c BOOTSTRAP PKG_PARENT CONFIG``) names its socket: a fact no module
        table hides. What the zygote's modules held does not reach a forked pytest, whose
        assertion rewriter imports the packages of its plugins' distributions anew."""
        ppid = os.getppid()
        try:
            with open(f"/proc/{ppid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            return None
        if len(argv) < 6 or argv[1:4] != [b"-u", b"-c", BOOTSTRAP.encode()]:
            return None
        try:
            zygote = cls.attach(ZygoteConfig.from_json(os.fsdecode(argv[5])).socket_path)
        except (OSError, ValueError, TypeError):  # gone, or another version's configuration
            return None
        return zygote if zygote.pid == ppid else None

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process is not None else self.status.get("pid")

    @property
    def import_env(self) -> dict[str, Optional[str]]:
        """Environment this zygote's imports depended on (fixed keys and keys read in preload)."""
        return dict(self.status.get("preload", {}).get("import_env", {}))

    def env_mismatch(self, env: Mapping[str, str]) -> list[str]:
        preload = self.status.get("preload", {})
        return import_env_mismatch(self.import_env, env, preload.get("set_while_importing"))

    def matches(self, env: Mapping[str, str]) -> bool:
        return not self.env_mismatch(env)

    def alive(self) -> bool:
        if self.process is None:  # attached: alive while it answers
            try:
                self.request("status")
                return True
            except OSError:
                return False
        return self.process.poll() is None

    def close(self) -> None:
        if self.daemon:
            return  # a daemon outlives its handles; `preload-launcher stop` ends it
        preloading = self.process is not None and self.process.poll() is None \
            and not self.poll_ready() and self._start_error is None
        # EOF on its alive socket: it stops serving (it reads that only once it serves). One
        # that stays for steps whose callers wait for them removed its files itself.
        staying = self._done_with_it(timeout=0 if preloading else 5)
        clean = preloading or staying
        if preloading:
            # A session shorter than the preload would wait for it. Nothing failed; it and its
            # scouts go now, with its files.
            kill_group(self.process.pid)
            self.process.wait()
        elif self.process is not None and not staying:
            try:
                clean = self.process.wait(timeout=5) == 0
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # A zygote that ended well leaves nothing behind; a failed one keeps its log.
        files = zygote_files(self.socket_path)
        remove_all(files["socket"], files["ready"], *([] if staying else [files["standins"]]))
        if clean:
            unlink_all(files["log"])

    def _done_with_it(self, timeout: float) -> bool:
        """Tell the zygote we are done with it; True when it answers that it stays only as the
        parent of steps whose callers wait for them (a program a test left running): the
        session does not wait for those, as it would not for the programs."""
        alive, self._alive = self._alive, None
        if alive is None:
            return False
        with alive:
            try:
                alive.shutdown(socket.SHUT_WR)
                alive.settimeout(timeout)
                events = protocol.read_events_until_eof(alive) if timeout else []
            except OSError:  # it is gone already
                events = []
        return any(event.get("event") == "staying" for event in events)

    # -------------------------------------------------------------- requests

    def connect(self) -> socket.socket:
        """A connection to this zygote; refused unless the listener runs as us (a socket put
        in our place by another user never sees a step)."""
        with guarded_stdio():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
            uid = protocol.peer_uid(sock)
            if uid != os.getuid():
                raise ConnectionRefusedError(errno.ECONNREFUSED, f"not ours: served by uid {uid}",
                                             self.socket_path)
        except OSError:
            sock.close()
            raise
        return sock

    def request(self, op: str) -> dict:
        """A one-shot request (``status`` or ``stop``); returns the reply event."""
        with self.connect() as sock:
            protocol.send_request(sock, {"op": op}, [])
            events = protocol.read_events_until_eof(sock)
        if not events:
            raise ConnectionResetError(f"no answer from the zygote at {self.socket_path}")
        return events[0]

    def submit(self, spec: StepSpec, fds: list[int]) -> socket.socket:
        """Send a step with the fds it gets (at ``spec.fd_targets``); returns the connection."""
        sock = self.connect()
        try:
            protocol.send_request(sock, {"op": "step", "spec": spec.to_json_dict()}, fds)
        except BaseException:
            sock.close()
            raise
        return sock


def _show_progress(log_path: str, offset: int, stream) -> int:
    """Print the zygote's new "preloading …" log lines; returns the new offset."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset
    complete = data[:data.rfind(b"\n") + 1]
    for line in complete.decode(errors="replace").splitlines():
        if " preloading " in line:
            stream.write("  " + line.split(" preloading ", 1)[1] + "…\n")
            stream.flush()
    return offset + len(complete)


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
