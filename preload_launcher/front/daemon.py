"""A warm zygote that outlives its starter, for manual example runs (``preload-launcher serve``).

One daemon per (interpreter, preload set), found by name in the per-user runtime directory
(mode 0700; socket 0600; every connection's peer uid checked by the zygote); its files are
named in ``daemon_files``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Mapping, Optional, Sequence

from ..caller.zygote_handle import ZygoteProcess
from ..command import runner_env_of
from ..files import lock_file, read_json, remove_all, unlink_all, write_json, zygote_files
from ..result import LauncherError
from .daemon_files import (daemon_paths, list_daemons, pid_alive, read_starting, starting_file,
                           write_starting)

__all__ = ["daemon_paths", "find_daemon", "start_daemon", "spawn_daemon", "mark_starting",
           "wait_for_starting", "stop_daemon", "list_daemons"]

START_WAIT_S = 600.0  # how long to wait for a daemon that another process is starting


def find_daemon(modules: Sequence[str]) -> tuple[Optional[ZygoteProcess], Optional[dict]]:
    """(handle, metadata) of a live daemon; (None, metadata) when one was started but is gone."""
    sock, meta_path = daemon_paths(modules)
    meta = read_json(meta_path)
    if meta is None:
        return None, None
    try:
        return ZygoteProcess.attach(sock), meta
    except OSError:
        return None, meta


def start_daemon(modules: Sequence[str], env: Mapping[str, str],
                 idle_timeout_s: Optional[float] = None, progress=None,
                 implicit: bool = False) -> ZygoteProcess:
    """Start a detached daemon (replacing a dead one) and wait until it serves; when another
    process starts one or runs one meanwhile, that one. Every way a daemon starts goes through
    here: its lock (taken here, then held by the daemon for life) lets one live at a time, and
    only its holder replaces the socket and writes the metadata. ``implicit``: `run` started it
    on its own, so it pre-warms no CUDA context unless a variable asks."""
    sock, meta_path = daemon_paths(modules)
    lock = zygote_files(sock)["lock"]
    deadline = time.monotonic() + START_WAIT_S
    while True:
        lock_fd = lock_file(lock)
        if lock_fd is not None:
            break
        try:  # another daemon lives or is starting: it answers once its preload is done
            return ZygoteProcess.attach(sock)
        except OSError:
            if time.monotonic() > deadline:
                raise LauncherError(f"a daemon holds {lock} but does not answer at {sock}")
            time.sleep(0.1)
    zygote: Optional[ZygoteProcess] = None
    try:
        zygote = ZygoteProcess(modules, env, socket_path=sock, daemon=True,
                               idle_timeout_s=idle_timeout_s, lock_fd=lock_fd,
                               implicit=implicit)
        zygote.launch()
        # Written before it serves: it takes this file with it when it stops, even at once.
        meta = {"pid": zygote.process.pid, "socket": sock, "modules": list(modules),
                "python": sys.executable, "started_at": time.time(), "log": zygote.log_path}
        write_json(meta_path, meta)
        try:
            zygote.wait_ready(progress)
        except BaseException:
            unlink_all(meta_path)  # it never served (the lock is still ours)
            raise
    except BaseException:
        if zygote is None or zygote.process is None or zygote.process.poll() is not None:
            unlink_all(lock)  # no daemon holds it: nothing stale stays behind
        raise
    finally:
        os.close(lock_fd)  # the daemon holds it now (or, if it failed, no one)
    zygote.process.returncode = 0  # detached: never reaped (or warned about) by this process
    return zygote


def _claim_starting(modules: Sequence[str]) -> Optional[int]:
    """An fd on a new ``.starting`` marker, or None while another live starter holds it (a
    dead starter's marker is taken over)."""
    lock = starting_file(modules)
    for _ in range(2):
        try:
            return os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            starter = read_starting(lock)
            if starter and pid_alive(starter["pid"]):
                return None
            unlink_all(lock)  # its starter died: take over
    return None


def spawn_daemon(modules: Sequence[str], command: Sequence[str] = ()) -> bool:
    """Start ``serve --detach`` in the background (for the next ``run``) unless one is starting
    already; returns whether this call started it. Its ``.starting`` file holds the starter's
    pid until the daemon serves. After a ``command`` that runs pytest, the daemon preloads as
    pytest runs (``serve --pytest``): the next one is served by it."""
    fd = _claim_starting(modules)
    if fd is None:
        return False
    pytest = ["--pytest"] if runner_env_of(list(command)) else []
    proc = subprocess.Popen([sys.executable, "-m", "preload_launcher.cli", "serve", "--detach",
                             "--implicit", *pytest,
                             "--preload", ",".join(modules)],
                            start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.returncode = 0  # detached: never reaped (or warned about) by this process
    write_starting(fd, proc.pid, modules)
    os.close(fd)
    return True


def mark_starting(modules: Sequence[str]) -> None:
    """`serve` shows that it is starting (`run` marked the daemons it starts already), so that
    `status` and `stop` see it before it serves."""
    fd = _claim_starting(modules)
    if fd is not None:
        write_starting(fd, os.getpid(), modules)
        os.close(fd)


def wait_for_starting(starters: list[dict], timeout: float = 120.0) -> None:
    """Wait until these starting daemons serve (or fail), so that `stop` finds and stops them
    instead of leaving them to come up afterwards."""
    deadline = time.monotonic() + timeout
    for starter in starters:  # a foreground `serve` lives on: its marker goes once it serves
        while (os.path.exists(starter["marker"]) and pid_alive(starter["pid"])
               and time.monotonic() < deadline):
            time.sleep(0.1)


def stop_daemon(modules: Sequence[str], timeout: float = 10.0,
                sock: Optional[str] = None) -> Optional[int]:
    """Stop the daemon and every step it runs; returns its pid, or None if none ran. ``sock``:
    its socket (default: this interpreter's daemon for ``modules``). What a daemon that died
    left behind goes too, but never the files of one that lives."""
    sock = sock or daemon_paths(modules)[0]
    try:
        zygote: Optional[ZygoteProcess] = ZygoteProcess.attach(sock)
    except OSError:
        zygote = None
    pid = None
    if zygote is not None:
        pid = zygote.status["pid"]
        zygote.request("stop")
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    files = zygote_files(sock)
    lock_fd = lock_file(files["lock"], wait_s=timeout)  # free once the daemon's pid is gone
    if lock_fd is not None:
        remove_all(*files.values())  # socket, log, stand-ins, metadata, then the lock (held)
        os.close(lock_fd)
    return pid
