"""Stage 5: the caller's side. Choose (or start) a zygote for each step, submit it, collect the
result like ``subprocess.run``; a step no zygote can serve runs as a subprocess, with stand-ins.

``run()`` is to ``ZygoteProcess.submit`` what ``subprocess.run`` is to ``Popen``: it owns the
output pipe, the timeout and the kill-on-any-exception rule. One zygote's handle is
``zygote_handle.ZygoteProcess``.
"""

from __future__ import annotations

import builtins
import collections
import os
import subprocess
import sys
import threading
import time
from typing import Mapping, Optional, Sequence, Union

from .. import process_attrs, settings, standin
from ..caller_fds import guarded_stdio
from ..command import StepSpec, Unsupported, parse_command
from ..mirroring import Mirror
from ..result import LauncherError, StepResult, ZygoteDied, signal_name
from ..settings import Settings
from .arguments import check_args, check_cwd, check_env
from .waiting import StepWait, decode, run_subprocess, wait_for_step, wait_relaying
from .zygote_handle import ZygoteProcess

__all__ = ["ZygoteProcess", "Launcher", "run", "run_capturing", "default_launcher"]


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
        self.lost: list[str] = []  # zygotes that ended on their own, said in the summary
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
            self._forget_dead()
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
            echo=False, capture=True, relay=False) -> StepResult:
        """Like ``subprocess.run(args, cwd=, env=, timeout=, check=, stdout=PIPE, stderr=STDOUT,
        text=True)``, served by a forked child of a preloaded zygote when the command allows.
        ``capture=False``: like ``subprocess.run`` without ``stdout=``, the step gets the
        caller's own fds 0-2 (``result.stdout`` is None). ``relay``: this process stands for
        the step, as the CLI does (``mirroring``): every signal it gets is relayed, it stops
        when the step stops, and Ctrl-C is the step's to act on (no kill after a grace)."""
        args = check_args(args)
        step_env = check_env(os.environ if env is None else env)
        step_cwd = check_cwd(cwd)
        wanted = Settings.from_env(step_env)  # a bad launcher variable in env= is the caller's error

        def plain(reason: str, run_env: Mapping[str, str] = step_env, zygote=None) -> StepResult:
            return run_subprocess(args, cwd, run_env, timeout, check, echo, reason, capture,
                                  relay, held_by=zygote.connect if zygote else None)

        if not Settings.from_env().enabled:
            return self._count(plain("PRELOAD_LAUNCHER=0"))
        parsed = parse_command(args, step_env, step_cwd) if isinstance(args, list) \
            else Unsupported("command given as a string")
        if isinstance(parsed, Unsupported):
            return self._run_with_standins(plain, step_env, step_cwd, parsed.reason,
                                           wanted.nested)
        parsed.process = process_attrs.capture()  # what a subprocess would inherit, as of now
        import_env = parsed.import_env()  # a test runner's own settings included
        waiting = time.monotonic()
        try:
            zygote = self.zygote_for(import_env)
        except LauncherError as err:
            return self._count(plain(f"zygote failed to start: {err}"))
        with self._lock:
            self.stats["waited_s"] += time.monotonic() - waiting
        result = self._run_in_zygote(zygote, parsed, timeout, echo, capture, relay)
        if isinstance(result, dict) and result.get("retry"):
            # A stale daemon restarts itself; its listener queues us until it serves again.
            print(f"preload_launcher: zygote restarting ({result['reason']})", file=sys.stderr)
            result = self._run_in_zygote(zygote, parsed, timeout, echo, capture, relay)
        if isinstance(result, dict) and "import_env" in result:
            # It learned modules that read variables this step sets otherwise: choose again.
            self._learned_env(zygote, result)
            try:
                zygote = self.zygote_for(import_env)
            except LauncherError as err:
                return self._count(plain(f"zygote failed to start: {err}"))
            result = self._run_in_zygote(zygote, parsed, timeout, echo, capture, relay)
        if isinstance(result, dict):  # a "fallback" event: the zygote cannot serve this step
            if result.get("retire", True):
                self._retire(zygote)  # it refused to fork: it is not clean
            return self._count(plain(result["reason"]))
        self._count(result)
        if check and result.returncode:
            raise subprocess.CalledProcessError(result.returncode, args, result.stdout)
        return result

    def _run_with_standins(self, plain, step_env: dict[str, str], step_cwd: str,
                           reason: str, nested: bool) -> StepResult:
        """A step the zygote cannot serve runs as a subprocess; the interpreters it starts
        (python, torchrun, accelerate on its PATH) are forked by the zygote (``standin``)."""
        path = zygote = None
        if nested:
            try:
                zygote = self.zygote_for_standins(step_env)
                path = zygote.path_for(step_env, step_cwd)
            except (LauncherError, OSError):
                path = None
        if path is None:
            return self._count(plain(reason))
        # The zygote holds the step's group: it goes if this process does (pytest-timeout).
        result = plain(f"{reason}; the interpreters it starts are forked by the zygote",
                       dict(step_env, PATH=path), zygote)
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
            self._attach_shared()
            self._forget_dead()
            same = [z for z in self.zygotes if z.modules == modules]
            fitting = [z for z in same if z._ready.is_set() and z.matches(env)]
            if fitting or same:
                return (fitting or same)[0]
            if len(self.zygotes) >= self.max_zygotes:
                self.zygotes.pop(0).close()
            return self._launch(modules, env)

    def standin_steps(self) -> int:
        """Interpreters the stand-ins handed to this launcher's live zygotes, as they count."""
        return self.standin_counts()[0]

    def standin_counts(self) -> tuple[int, dict[str, int]]:
        """(interpreters its zygotes forked for stand-ins, {why others ran the real one: count})."""
        with self._lock:
            zygotes = list(self.zygotes)
        forked, fallbacks = 0, collections.Counter()
        for z in zygotes:
            fallbacks.update(standin.ran_real(z.socket_path, z.ran_real_from))  # never asked it
            try:
                status = z.request("status") if z.poll_ready() else {}
            except (OSError, ValueError):
                continue
            forked += int(status.get("standin_steps", 0))
            fallbacks.update(status.get("standin_fallbacks") or {})
        return forked, dict(fallbacks)

    def _forget_dead(self) -> None:
        """Drop zygotes that are gone (under the lock); one of ours that ended on its own is
        remembered for the summary, with the log it kept."""
        for z in list(self.zygotes):
            if z._ready.is_set() and not z.alive():
                self.zygotes.remove(z)
                self._remember_if_lost(z)
                z.close()

    def _remember_if_lost(self, zygote: ZygoteProcess) -> None:
        code = zygote.process.poll() if zygote.process is not None else None
        # A crash or an outside kill after a good start (a failed start is the caller's
        # LauncherError, with the log's tail): the steps after it ran in another zygote.
        if code and zygote._start_error is None:
            how = f"killed by {signal_name(-code)}" if code < 0 else f"exit status {code}"
            self.lost.append(f"zygote {zygote.pid} ended on its own ({how}); later steps went "
                             f"to a new one; its log: {zygote.log_path}")

    def lost_zygotes(self) -> list[str]:
        """What ended the zygotes this launcher started that did not wait to be stopped."""
        with self._lock:
            for z in self.zygotes:
                z.poll_ready()  # one whose readiness nobody waited for (the xdist controller's)
            self._forget_dead()
            return list(self.lost)

    def _learned_env(self, zygote: ZygoteProcess, fallback: dict) -> None:
        """Take in the import environment a zygote's refusal named (grown by what it learned
        while idle), so that steps are matched against what it holds now."""
        with self._lock:
            preload = zygote.status.setdefault("preload", {})
            preload["import_env"] = fallback["import_env"]
            preload["set_while_importing"] = fallback.get("set_while_importing") or {}

    def _retire(self, zygote: ZygoteProcess) -> None:
        with self._lock:
            if zygote in self.zygotes:
                self.zygotes.remove(zygote)
                self._remember_if_lost(zygote)
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
                       echo: bool, capture: bool, relay: bool = False) -> Union[StepResult, dict]:
        """The step's result, or the ``fallback`` event saying why it cannot be served."""
        requested_at = time.time()
        start = time.monotonic()
        mirror = Mirror() if relay else None  # in place before the step runs (``wait_relaying``)
        if mirror is not None:
            mirror.install()
            spec.process.update(process_attrs.place())  # standing for it: it takes our place
        try:
            zygote, waiter = self._submit(zygote, spec, capture, echo)
        except BaseException:
            if mirror is not None:
                mirror.uninstall()
            raise
        if mirror is not None:
            wait_relaying(waiter, spec.args, timeout, start, mirror)
        else:
            wait_for_step(waiter, spec.args, timeout, start)
        return _result_of(zygote, spec, waiter, time.monotonic() - start, requested_at)

    def _submit(self, zygote: ZygoteProcess, spec: StepSpec, capture: bool,
                echo: bool) -> tuple[ZygoteProcess, StepWait]:
        """The step sent to ``zygote`` (or to its replacement, where it died between steps)."""
        # Our pipe and socket must not take a closed fd's number; the step gets the caller's
        # open ones (``stdio``), as with subprocess.
        with guarded_stdio() as stdio:
            out_r, out_w = os.pipe() if capture else (None, None)
            fds, spec.fd_targets = _step_fds(stdio, out_w)
            try:
                try:
                    sock = zygote.submit(spec, fds)
                except (ConnectionRefusedError, FileNotFoundError):
                    self._retire(zygote)  # it died between steps: replace it once
                    zygote = self.zygote_for(spec.import_env())
                    sock = zygote.submit(spec, fds)
            except BaseException:
                if out_r is not None:
                    os.close(out_r)
                raise
            finally:
                if out_w is not None:
                    os.close(out_w)
            return zygote, StepWait(sock, out_r, echo, zygote.pid)


def _step_fds(stdio: list[int], out_w: Optional[int]) -> tuple[list[int], list[int]]:
    """(fds to pass, where the step gets them): the caller's open stdin, and its stdout and
    stderr or one output pipe for both (interleaved, as with ``stderr=STDOUT``)."""
    if out_w is None:
        return list(stdio), list(stdio)
    stdin = [0] if 0 in stdio else []
    return stdin + [out_w, out_w], stdin + [1, 2]


def _result_of(zygote: ZygoteProcess, spec: StepSpec, waiter: StepWait, seconds: float,
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
    output = decode(waiter.output) if waiter.out_r is not None else None
    if "exit" not in events:
        raise ZygoteDied(zygote.status.get("pid"), spec.args, output)
    reason = "output held open by a daemonised grandchild" if "held_output" in events else ""
    via = "zygote"
    fresh = events.get("fresh")
    if fresh and fresh.get("rank"):  # a rank became a fresh interpreter (rerun), the launch not
        reason = f"a rank ran fresh: {fresh['reason']}"
    elif fresh:  # it became a fresh interpreter (rerun): as a subprocess runs it
        via, reason = "subprocess", f"run fresh: {fresh['reason']}"
    result = StepResult(spec.args, events["exit"]["returncode"], output, None, via=via,
                        reason=reason)
    result.seconds = seconds
    if "granted" in events:  # GPU packing: the GPUs it ran on, and how long it waited
        result.gpus = list(events["granted"]["gpus"])
        result.gpu_wait_s = float(events["granted"]["waited_s"])
    # Request -> first line of user code: the launcher's own overhead.
    result.exec_delay_s = events["exec"]["t"] - requested_at if "exec" in events else None
    return result


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
            # A zygote forked this process (`run -- python x.py`): its preload serves our steps
            # too, where their environment fits it, instead of a second one preloading the same.
            forking = ZygoteProcess.parent()
            shared = forking.socket_path if forking and forking.modules == list(modules) else None
            _launchers[modules] = Launcher(modules, shared_socket=shared)
        return _launchers[modules]


def run(args, *, cwd=None, env=None, timeout=None, check=False, echo=False,
        capture=True) -> StepResult:
    """Drop-in for ``subprocess.run(args, cwd=, env=, stdout=PIPE, stderr=STDOUT, text=True)``.

    ``result.stdout`` holds stdout and stderr interleaved; ``result.via`` says whether a
    zygote's forked child ran it. ``PRELOAD_LAUNCHER=0`` makes this a plain subprocess call.
    """
    return default_launcher().run(args, cwd=cwd, env=env, timeout=timeout, check=check, echo=echo,
                                  capture=capture)


def run_capturing(cmd_parts, cwd=None, env=None, timeout=None) -> tuple[int, str]:
    """For helpers shaped like ``_run_capturing(cmd_parts, cwd, env) -> (returncode, output)``."""
    result = run(cmd_parts, cwd=cwd, env=env, timeout=timeout)
    return result.returncode, result.stdout
