"""The launcher's own files (verdicts, learned profiles, daemon metadata, sockets, logs)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from typing import Callable, Optional

__all__ = ["read_json", "write_json", "save_json", "update_json",
           "unlink_all", "zygote_files", "remove_all", "lock_file"]

_warned = False  # an unwritable cache is reported once per process


def read_json(path: str) -> Optional[dict]:
    """The JSON object in ``path``; None when it is missing, unreadable or not an object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: str, data: dict) -> None:
    """Write atomically (a reader sees the old file or the new one, never half of one)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk leaves no half-written file behind
            os.unlink(tmp)
        raise


def update_json(path: str, change: Callable[[dict], None]) -> Optional[dict]:
    """Read-modify-write ``path`` under an exclusive lock (``<path>.lock``): ``change`` edits
    the file's latest contents, so what other processes wrote meanwhile is kept. Returns what
    was written, or None when the directory cannot be written (warned once, as ``save_json``)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as err:
        _warn_once(path, err)
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = read_json(path) or {}
        change(data)
        return data if save_json(path, data) else None
    finally:
        os.close(lock)  # releases the lock


def save_json(path: str, data: dict) -> bool:
    """``write_json`` for caches: a read-only or full cache directory costs the cache, never
    the caller. The first failure is reported on stderr (a zygote's log);
    returns whether the file was written."""
    try:
        write_json(path, data)
        return True
    except OSError as err:
        _warn_once(path, err)
        return False


def _warn_once(path: str, err: OSError) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"preload_launcher: cannot write {path} ({err.strerror or err}); going on without "
              f"that cache", file=sys.stderr, flush=True)


def unlink_all(*paths: str) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def remove_all(*paths: str) -> None:
    """Remove files and directories (the stand-ins' directory) that may be gone already."""
    import shutil  # here: shutil loads the compression modules, which `run` never needs

    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            unlink_all(path)


def zygote_files(socket_path: str) -> dict[str, str]:
    """The files of the zygote listening at ``socket_path`` (``….sock``): its socket, its log,
    the directory of its stand-ins (``standin``), the mark that it serves (``ready``: absent
    while it preloads or restarts) and, for a daemon, the metadata its starter writes."""
    base = socket_path[:-len(".sock")]
    return {"socket": socket_path, "log": base + ".log", "standins": base + ".bin",
            "ready": base + ".ready", "meta": base + ".json", "lock": base + ".lock"}


def lock_file(path: str, wait_s: float = 0.0) -> Optional[int]:
    """An fd holding an exclusive ``flock`` on ``path`` (created 0600), or None when another
    process holds it for ``wait_s`` seconds. Whoever holds the lock may unlink the file: a lock
    taken on a file that was unlinked (or replaced) meanwhile is dropped and taken again."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
            continue
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def roomy_pipe(size: int = 1 << 20) -> tuple[int, int]:
    """A pipe that holds ``size`` bytes unread where the user's pipe-size limit allows (else
    the default): a zygote writes its whole status (tens of KiB) once ready, and a caller
    blocked meanwhile on a launcher that waits for that zygote reads nothing until later."""
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, size)
    except OSError:
        pass
    return r, w
