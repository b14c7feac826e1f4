"""A warm zygote that outlives its starter, for manual example runs (``preload-launcher serve``).

One daemon per (interpreter, preload set), found by name in the per-user runtime directory
(mode 0700; socket 0600; every connection's peer uid checked by the zygote).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Mapping, Optional, Sequence

from . import settings
from .client import ZygoteProcess
from .files import lock_file, read_json, remove_all, unlink_all, write_json, zygote_files
from .result import LauncherError

__all__ = ["daemon_paths", "find_daemon", "start_daemon", "stop_daemon", "list_daemons"]

START_WAIT_S = 600.0  # how long to wait for a daemon that another process is starting


def daemon_paths(modules: Sequence[str]) -> tuple[str, str]:
    """(socket, metadata file) of the daemon for this interpreter and preload set."""
    key = hashlib.sha1(json.dumps([sys.executable, list(modules)]).encode()).hexdigest()[:12]
    base = os.path.join(settings.runtime_dir(), f"d-{key}")
    return base + ".sock", base + ".json"


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
                 idle_timeout_s: Optional[float] = None, progress=None) -> ZygoteProcess:
    """Start a detached daemon (replacing a dead one) and wait until it serves; when another
    process starts one or runs one meanwhile, that one. Every way a daemon starts goes through
    here: its lock (taken here, then held by the daemon for life) lets one live at a time, and
    only its holder replaces the socket and writes the metadata."""
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
    try:
        zygote = ZygoteProcess(modules, env, socket_path=sock, daemon=True,
                               idle_timeout_s=idle_timeout_s, lock_fd=lock_fd).launch()
        # Written before it serves: it takes this file with it when it stops, even at once.
        meta = {"pid": zygote.process.pid, "socket": sock, "modules": list(modules),
                "python": sys.executable, "started_at": time.time(), "log": zygote.log_path}
        write_json(meta_path, meta)
        try:
            zygote.wait_ready(progress)
        except BaseException:
            unlink_all(meta_path)  # it never served (the lock is still ours)
            raise
    finally:
        os.close(lock_fd)  # the daemon holds it now (or, if it failed, no one)
    zygote.process.returncode = 0  # detached: never reaped (or warned about) by this process
    return zygote


def spawn_daemon(modules: Sequence[str]) -> bool:
    """Start ``serve --detach`` in the background (for the next ``run``) unless one is starting
    already; returns whether this call started it. Its ``.starting`` file holds the starter's
    pid until the daemon serves."""
    lock = starting_file(modules)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            break
        except FileExistsError:
            with open(lock) as f:
                pid = f.read().strip()
            if pid.isdigit() and _pid_alive(int(pid)):
                return False
            unlink_all(lock)  # its starter died: take over
    else:
        return False
    proc = subprocess.Popen([sys.executable, "-m", "preload_launcher.cli", "serve", "--detach",
                             "--preload", ",".join(modules)], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    proc.returncode = 0  # detached: never reaped (or warned about) by this process
    os.write(fd, str(proc.pid).encode())
    os.close(fd)
    return True


def starting_file(modules: Sequence[str]) -> str:
    return daemon_paths(modules)[0][:-len(".sock")] + ".starting"


def wait_for_starting(timeout: float = 120.0) -> None:
    """Wait for the daemons `run` is still starting, so that `stop` finds and stops them
    instead of leaving them to come up afterwards."""
    runtime = settings.runtime_dir()
    deadline = time.monotonic() + timeout
    for name in os.listdir(runtime):
        if not name.endswith(".starting"):
            continue
        try:
            with open(os.path.join(runtime, name)) as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            continue
        while pid and _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)


def stop_daemon(modules: Sequence[str], timeout: float = 10.0) -> Optional[int]:
    """Stop the daemon and every step it runs; returns its pid, or None if none ran. What a
    daemon that died left behind goes too, but never the files of one that lives."""
    zygote, meta = find_daemon(modules)
    sock, meta_path = daemon_paths(modules)
    pid = None
    if zygote is not None:
        pid = zygote.status["pid"]
        zygote.request("stop")
        deadline = time.monotonic() + timeout
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    files = zygote_files(sock)
    lock_fd = lock_file(files["lock"], wait_s=timeout)  # free once the daemon's pid is gone
    if lock_fd is not None:
        remove_all(*files.values())  # socket, log, stand-ins, metadata, then the lock (held)
        os.close(lock_fd)
    return pid


def list_daemons() -> list[dict]:
    """Metadata of every daemon started for this user, live or not."""
    runtime = settings.runtime_dir()
    found = []
    for name in sorted(os.listdir(runtime)):
        if name.startswith("d-") and name.endswith(".json"):
            meta = read_json(os.path.join(runtime, name))
            if meta:
                found.append(meta)
    return found


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
