"""Stage 5: the caller's side. Start zygotes, submit steps, collect results like ``subprocess.run``.

``run()`` is to ``ZygoteProcess.submit`` what ``subprocess.run`` is to ``Popen``: it owns the
output pipe, the timeout and the kill-on-any-exception rule.
"""

from __future__ import annotations

import builtins
import codecs
import errno
import io
import itertools
import locale
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Mapping, Optional, Sequence, Union

from . import cuda, protocol, settings, standin
from .command import StepSpec, Unsupported, parse_command, resolves_to_this_interpreter
from .files import remove_all, unlink_all, zygote_files
from .gpus import pool_ids as gpu_pool_ids
from .result import LauncherError, StepResult, ZygoteDied
from .settings import Settings, ZygoteConfig

__all__ = ["ZygoteProcess", "Launcher", "run", "run_capturing", "default_launcher"]

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_DRAIN_S = 0.5  # after the step's exit, how long escaped grandchildren may hold the output
KILL_WAIT_S = 10.0
INTERRUPT_GRACE_S = 0.25  # as subprocess.run gives a child on Ctrl-C
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
_zygote_ids = itertools.count()
# Popen(process_group=0) is Python >= 3.11; setpgid in the child is the same on 3.10.
OWN_PROCESS_GROUP = ({"process_group": 0} if sys.version_info >= (3, 11)
                     else {"preexec_fn": os.setpgrp})
COVERAGE_ENV_PREFIXES = ("COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG", "COV_CORE_")

# The zygote's command line: ``python -u -c BOOTSTRAP PKG_PARENT CONFIG_JSON``. sys.path keeps
# what a fresh interpreter has (minus sys.path[0]), whether or not the package is installed;
# ``startup`` is what python imported before any code ran (shadowing).
BOOTSTRAP = (
    "import sys; startup = frozenset(sys.modules); base = sys.path[1:]; "
    "sys.path.insert(0, sys.argv[1]); from preload_launcher import shadowing, zygote; "
    "sys.path[:] = base; shadowing.startup_modules = startup; zygote.main(sys.argv[2], base)"
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
        # counts, which each step sets for itself (what torch reports there is the default).
        self.env = {k: v for k, v in env.items()
                    if not k.startswith(COVERAGE_ENV_PREFIXES)
                    and k not in settings.PER_TEST_ENV + settings.THREAD_ENV}
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
        self._alive_w = -1
        self._ready_r = -1
        self._ready = threading.Event()
        self._ready_lock = threading.Lock()
        self._start_error: Optional[BaseException] = None

    # -------------------------------------------------------------- lifecycle

    def launch(self) -> "ZygoteProcess":
        """Start the zygote without waiting for its preload (see ``wait_ready``)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unlink_all(self.socket_path)
        old_umask = os.umask(0o177)  # socket 0600
        try:
            listener.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        listener.listen(128)
        ready_r, ready_w = os.pipe()
        alive_r, alive_w = (-1, -1) if self.daemon else os.pipe()
        config = self.config(listener.fileno(), ready_w, alive_r)
        pass_fds = [fd for fd in (listener.fileno(), ready_w, alive_r, self.lock_fd) if fd >= 0]
        try:
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-u", "-c", BOOTSTRAP, PACKAGE_PARENT, config.to_json()],
                    env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    pass_fds=pass_fds, start_new_session=True, cwd="/")
        finally:
            listener.close()
            os.close(ready_w)
            if alive_r >= 0:
                os.close(alive_r)
        self._alive_w, self._ready_r = alive_w, ready_r
        self.install_standins()
        return self

    def install_standins(self) -> None:
        """Written here, not by the zygote, so a step may run before the preload is done: its
        stand-ins wait in the listener's queue."""
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
        z.log_path, z.cache_dir, z._alive_w, z._ready_r = "", "", -1, -1
        z._ready, z._start_error, z._ready_lock = threading.Event(), None, threading.Lock()
        z.status = z.request("status")
        z.modules = list(z.status["modules"])
        z.log_path = zygote_files(socket_path)["log"]
        z.standins = standin.installed(socket_path)
        z._ready.set()
        return z

    @property
    def import_env(self) -> dict[str, Optional[str]]:
        """Environment this zygote's imports depended on (fixed keys and keys read in preload)."""
        return dict(self.status.get("preload", {}).get("import_env", {}))

    def env_mismatch(self, env: Mapping[str, str]) -> list[str]:
        return settings.import_env_mismatch(self.import_env, env)

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
        if self._alive_w >= 0:
            os.close(self._alive_w)  # EOF on its alive pipe: the zygote exits
            self._alive_w = -1
        clean = False
        if self.process is not None:
            try:
                clean = self.process.wait(timeout=5) == 0
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # A zygote that ended well leaves nothing behind; a failed one keeps its log.
        files = zygote_files(self.socket_path)
        remove_all(files["socket"], files["standins"])
        if clean:
            unlink_all(files["log"])

    # -------------------------------------------------------------- requests

    def connect(self) -> socket.socket:
        """A connection to this zygote; refused unless the listener runs as us (a socket put
        in our place by another user never sees a step)."""
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
            events = _read_events_until_eof(sock)
        if not events:
            raise ConnectionResetError(f"no answer from the zygote at {self.socket_path}")
        return events[0]

    def submit(self, spec: StepSpec, out_w: int, stdin_fd: int) -> socket.socket:
        sock = self.connect()
        try:
            protocol.send_request(sock, {"op": "step", "spec": spec.to_json_dict()},
                                  [stdin_fd, out_w])
        except BaseException:
            sock.close()
            raise
        return sock


def _read_events_until_eof(sock: socket.socket) -> list[dict]:
    reader = protocol.EventReader()
    events: list[dict] = []
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return events
        events += reader.feed(data)


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


# ------------------------------------------------------------------ one step's wait loop

class _StepWait:
    """Collects a step's output and events until it exits, honouring a deadline."""

    def __init__(self, sock: socket.socket, out_r: int, echo: bool) -> None:
        self.sock = sock
        self.out_r = out_r
        self.echo = echo
        self.output = bytearray()
        self.events: dict[str, dict] = {}
        self._reader = protocol.EventReader()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ, "events")
        self.selector.register(out_r, selectors.EVENT_READ, "output")

    def pump(self, deadline: Optional[float]) -> bool:
        """Run until exit + output EOF (True) or the deadline (False)."""
        exit_seen_at: Optional[float] = None
        while self.selector.get_map():
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
                else:
                    self._read_events()
            if "exit" in self.events and exit_seen_at is None:
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
            return  # EOF: the zygote died if no "exit" came first
        for event in self._reader.feed(data):
            # The first report wins: a step reports its exit before its process is torn down,
            # and the zygote reports it again when it reaps the process.
            self.events.setdefault(event["event"], event)

    def send_signal(self, signum: int) -> None:
        protocol.send_op(self.sock, "signal", signum=int(signum))

    def close(self) -> None:
        self.selector.close()
        os.close(self.out_r)
        self.sock.close()


def _decode(data: bytes) -> str:
    """Like ``text=True``: locale encoding, universal newlines (never raises on bad bytes)."""
    encoding = locale.getpreferredencoding(False)
    return io.TextIOWrapper(io.BytesIO(bytes(data)), encoding=encoding, errors="replace").read()


# ------------------------------------------------------------------ the launcher

def _check_env(env: Mapping) -> dict[str, str]:
    out = {}
    for key, value in env.items():
        out[os.fsdecode(key)] = os.fsdecode(value)  # TypeError like subprocess for non-str
    return out


def _check_args(args) -> Union[list[str], str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        return os.fsdecode(args)
    return [os.fsdecode(a) for a in args]


class Launcher:
    """Zygotes by preload set and import-relevant environment, reused across steps."""

    def __init__(self, modules: Optional[Sequence[str]] = None, max_zygotes: int = 3,
                 project: Optional[str] = None, profile: Optional[str] = None,
                 gpus: Optional[str] = None, shared_socket: Optional[str] = None) -> None:
        self.modules = tuple(modules) if modules is not None else None
        self.project = project  # where learned-preload profiles are keyed (default: cwd)
        self.profile = profile  # a portable profile to start zygotes from (else the env's)
        self.gpus = gpus  # GPU packing for the zygotes this launcher starts (else the env's)
        # A zygote another process owns (the xdist controller's, a daemon): used first.
        self.shared_socket = shared_socket
        self.max_zygotes = max_zygotes
        self.zygotes: list[ZygoteProcess] = []
        # Measured, never estimated: steps each way and the seconds they took, the seconds
        # callers waited for a zygote's preload, and how many zygotes were started.
        self.stats = {"zygote": 0, "subprocess": 0, "with_standins": 0, "reasons": {},
                      "zygotes_started": 0, "gpu_waits": 0, "gpu_wait_s": 0.0,
                      "seconds": {"zygote": 0.0, "subprocess": 0.0}, "waited_s": 0.0}
        self._lock = threading.Lock()

    def preload_set(self) -> tuple[str, ...]:
        return self.modules if self.modules is not None else settings.preload_modules()

    def zygote_for(self, env: Mapping[str, str]) -> ZygoteProcess:
        """A ready zygote whose preload fits ``env``; starts one when none does."""
        modules = list(self.preload_set())
        with self._lock:
            self._attach_shared()
            for z in list(self.zygotes):
                if not z.alive() and z._ready.is_set():
                    self.zygotes.remove(z)
                    z.close()
            candidates = [z for z in self.zygotes if z.modules == modules]
            for z in candidates:
                z.wait_ready()
                if z.matches(env):
                    return z
            if len(self.zygotes) >= self.max_zygotes:
                oldest = self.zygotes.pop(0)
                oldest.close()
            z = self._launch(modules, env)
        z.wait_ready()
        return z

    def _attach_shared(self) -> None:
        """Use the shared zygote once, if it still answers (its owner may have ended)."""
        if self.shared_socket:
            path, self.shared_socket = self.shared_socket, None
            try:
                self.zygotes.insert(0, ZygoteProcess.attach(path))
            except (OSError, ValueError):
                pass

    def prestart(self, env: Optional[Mapping[str, str]] = None) -> ZygoteProcess:
        """Launch a zygote in the background (its preload overlaps the caller's work)."""
        env = dict(os.environ if env is None else env)
        with self._lock:
            return self._launch(list(self.preload_set()), env)

    def _launch(self, modules: list[str], env: Mapping[str, str]) -> ZygoteProcess:
        z = ZygoteProcess(modules, env, project=self.project, profile=self.profile,
                          gpus=self.gpus).launch()
        self.zygotes.append(z)
        self.stats["zygotes_started"] += 1
        return z

    def close(self) -> None:
        with self._lock:
            for z in self.zygotes:
                z.close()
            self.zygotes.clear()

    # -------------------------------------------------------------- run

    def run(self, args, *, cwd=None, env=None, timeout=None, check=False,
            echo=False) -> StepResult:
        """Like ``subprocess.run(args, cwd=, env=, timeout=, check=, stdout=PIPE, stderr=STDOUT,
        text=True)``, served by a forked child of a preloaded zygote when the command allows."""
        args = _check_args(args)
        step_env = _check_env(os.environ if env is None else env)
        step_cwd = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
        wanted = Settings.from_env(step_env)  # a bad launcher variable in env= is the caller's error
        if not Settings.from_env().enabled:
            return self._count(_run_subprocess(args, cwd, step_env, timeout, check, echo,
                                               "PRELOAD_LAUNCHER=0"))
        parsed = parse_command(args, step_env, step_cwd) if isinstance(args, list) \
            else Unsupported("command given as a string")
        if isinstance(parsed, Unsupported):
            return self._run_with_standins(args, cwd, step_env, step_cwd, timeout, check, echo,
                                           parsed.reason, wanted.nested)
        waiting = time.monotonic()
        try:
            zygote = self.zygote_for(step_env)
        except LauncherError as err:
            return self._count(_run_subprocess(args, cwd, step_env, timeout, check, echo,
                                               f"zygote failed to start: {err}"))
        with self._lock:
            self.stats["waited_s"] += time.monotonic() - waiting
        result = self._run_in_zygote(zygote, parsed, timeout, echo)
        if isinstance(result, dict) and result.get("retry"):
            # A stale daemon restarts itself; its listener queues us until it serves again.
            print(f"preload_launcher: zygote restarting ({result['reason']})", file=sys.stderr)
            result = self._run_in_zygote(zygote, parsed, timeout, echo)
        if isinstance(result, dict):  # a "fallback" event: the zygote cannot serve this step
            if result.get("retire", True):
                self._retire(zygote)  # it refused to fork: it is not clean
            return self._count(_run_subprocess(args, cwd, step_env, timeout, check, echo,
                                               result["reason"]))
        self._count(result)
        if check and result.returncode:
            raise subprocess.CalledProcessError(result.returncode, args, result.stdout)
        return result

    def _run_with_standins(self, args, cwd, step_env: dict[str, str], step_cwd: str,
                           timeout, check, echo, reason: str, nested: bool) -> StepResult:
        """A step the zygote cannot serve runs as a subprocess; the interpreters it starts
        (python, torchrun, accelerate on its PATH) are forked by the zygote (``standin``)."""
        path = None
        if nested:
            try:
                path = self.zygote_for_standins(step_env).path_for(step_env, step_cwd)
            except (LauncherError, OSError):
                path = None
        if path is None:
            return self._count(_run_subprocess(args, cwd, step_env, timeout, check, echo, reason))
        result = _run_subprocess(args, cwd, dict(step_env, PATH=path), timeout, check, echo,
                                 f"{reason}; the interpreters it starts are forked by the zygote")
        with self._lock:
            self.stats["with_standins"] += 1
        return self._count(result)

    def zygote_for_standins(self, env: Mapping[str, str]) -> ZygoteProcess:
        """A zygote for the interpreters a subprocess may start, without waiting for its
        preload (the subprocess may never start one) and without replacing one: a ready one
        that fits ``env``, else any of this preload set (it checks each interpreter's own
        environment and refuses what its preload would have imported differently), else a
        new one."""
        modules = list(self.preload_set())
        with self._lock:
            same = [z for z in self.zygotes if z.modules == modules and
                    (not z._ready.is_set() or z.alive())]
            fitting = [z for z in same if z._ready.is_set() and z.matches(env)]
            if fitting or same:
                return (fitting or same)[0]
            if len(self.zygotes) >= self.max_zygotes:
                self.zygotes.pop(0).close()
            return self._launch(modules, env)

    def standin_steps(self) -> int:
        """Interpreters the stand-ins handed to this launcher's live zygotes, as they count."""
        with self._lock:
            zygotes = [z for z in self.zygotes if z.poll_ready()]
        total = 0
        for z in zygotes:
            try:
                total += int(z.request("status").get("standin_steps", 0))
            except (OSError, ValueError):
                pass
        return total

    def _retire(self, zygote: ZygoteProcess) -> None:
        with self._lock:
            if zygote in self.zygotes:
                self.zygotes.remove(zygote)
        zygote.close()

    def _count(self, result: StepResult) -> StepResult:
        with self._lock:
            self.stats[result.via] += 1
            self.stats["seconds"][result.via] += result.seconds
            if result.reason:
                self.stats["reasons"][result.reason] = self.stats["reasons"].get(result.reason, 0) + 1
            if result.gpus is not None:
                self.stats["gpu_waits"] += 1
                self.stats["gpu_wait_s"] += result.gpu_wait_s
        return result

    def _run_in_zygote(self, zygote: ZygoteProcess, spec: StepSpec, timeout: Optional[float],
                       echo: bool) -> Union[StepResult, dict]:
        """The step's result, or the ``fallback`` event saying why it cannot be served."""
        out_r, out_w = os.pipe()
        requested_at = time.time()
        stdin_fd = 0 if _fd_is_open(0) else os.open(os.devnull, os.O_RDONLY)
        start = time.monotonic()
        try:
            try:
                sock = zygote.submit(spec, out_w, stdin_fd)
            except (ConnectionRefusedError, FileNotFoundError):
                self._retire(zygote)  # it died between steps: replace it once
                zygote = self.zygote_for(spec.env)
                sock = zygote.submit(spec, out_w, stdin_fd)
        except BaseException:
            os.close(out_r)
            raise
        finally:
            os.close(out_w)
            if stdin_fd != 0:
                os.close(stdin_fd)
        waiter = _StepWait(sock, out_r, echo)
        deadline = None if timeout is None else start + timeout
        try:
            finished = waiter.pump(deadline)
            if not finished:
                waiter.send_signal(signal.SIGKILL)
                waiter.pump(time.monotonic() + KILL_WAIT_S)
                raise subprocess.TimeoutExpired(spec.args, timeout, output=_decode(waiter.output))
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
        return _result_of(zygote, spec, waiter, time.monotonic() - start, requested_at)


def _result_of(zygote: ZygoteProcess, spec: StepSpec, waiter: "_StepWait", seconds: float,
               requested_at: float) -> Union[StepResult, dict]:
    """A finished step's result from its events (or the ``fallback`` event, or the error)."""
    events = waiter.events
    if "fallback" in events:
        return events["fallback"]
    if "error" in events:
        err = events["error"]
        exc_type = getattr(builtins, err["type"], None)
        if not (isinstance(exc_type, type) and issubclass(exc_type, OSError)):
            raise LauncherError(err.get("strerror") or "step setup failed")
        raise exc_type(err["errno"], err["strerror"], err["filename"])
    if "exit" not in events:
        raise ZygoteDied(zygote.status.get("pid"), spec.args, _decode(waiter.output))
    reason = "output held open by a daemonised grandchild" if "held_output" in events else ""
    result = StepResult(spec.args, events["exit"]["returncode"], _decode(waiter.output),
                        None, via="zygote", reason=reason)
    result.seconds = seconds
    if "granted" in events:  # GPU packing: the GPUs it ran on, and how long it waited
        result.gpus = list(events["granted"]["gpus"])
        result.gpu_wait_s = float(events["granted"]["waited_s"])
    # Request -> first line of user code: the launcher's own overhead.
    result.exec_delay_s = events["exec"]["t"] - requested_at if "exec" in events else None
    return result


def _fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _run_subprocess(args, cwd, env, timeout, check, echo, reason) -> StepResult:
    """The plain path: ``subprocess.run`` semantics, the step in its own process group."""
    start = time.monotonic()
    with subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, **OWN_PROCESS_GROUP) as proc:
        chunks: list[bytes] = []

        def pump() -> None:
            for chunk in iter(lambda: proc.stdout.read1(1 << 16), b""):
                chunks.append(chunk)
                if echo:
                    sys.stdout.write(chunk.decode(errors="replace"))
                    sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
            reader.join(EXIT_DRAIN_S)
            raise subprocess.TimeoutExpired(args, timeout, output=_decode(b"".join(chunks)))
        except BaseException:
            _kill_group(proc.pid)
            raise
        _kill_group(proc.pid)  # grandchildren go with the step, as in the zygote path
        reader.join(EXIT_DRAIN_S)
        output = _decode(b"".join(chunks))
    result = StepResult(args, proc.returncode, output, None, via="subprocess", reason=reason)
    result.seconds = time.monotonic() - start
    if check and result.returncode:
        raise subprocess.CalledProcessError(result.returncode, args, output)
    return result


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_launchers: dict[tuple, Launcher] = {}
_launchers_lock = threading.Lock()
_session_launcher: Optional[Launcher] = None


def set_session_launcher(launcher: Optional[Launcher]) -> None:
    """Make ``run()`` use ``launcher`` (the pytest plugin's) unless the env names other modules."""
    global _session_launcher
    _session_launcher = launcher


def default_launcher() -> Launcher:
    """The launcher ``run()`` uses: the session's, else one per ``PRELOAD_LAUNCHER_MODULES``."""
    session = _session_launcher
    if session is not None and (Settings.from_env().modules is None
                                or settings.preload_modules() == session.preload_set()):
        return session
    modules = settings.preload_modules()
    with _launchers_lock:
        if modules not in _launchers:
            _launchers[modules] = Launcher(modules)
        return _launchers[modules]


def run(args, *, cwd=None, env=None, timeout=None, check=False, echo=False) -> StepResult:
    """Drop-in for ``subprocess.run(args, cwd=, env=, stdout=PIPE, stderr=STDOUT, text=True)``.

    ``result.stdout`` holds stdout and stderr interleaved; ``result.via`` says whether a
    zygote's forked child ran it. ``PRELOAD_LAUNCHER=0`` makes this a plain subprocess call.
    """
    return default_launcher().run(args, cwd=cwd, env=env, timeout=timeout, check=check, echo=echo)


def run_capturing(cmd_parts, cwd=None, env=None, timeout=None) -> tuple[int, str]:
    """For helpers shaped like ``_run_capturing(cmd_parts, cwd, env) -> (returncode, output)``."""
    result = run(cmd_parts, cwd=cwd, env=env, timeout=timeout)
    return result.returncode, result.stdout
