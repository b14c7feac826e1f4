"""Where a daemon's files live and what they say, read with the standard library only: `run`
learns whether a daemon exists without importing the client (a one-off `run` starts fast).

One daemon per (interpreter, preload set): its socket, metadata and ``.starting`` marker are
named by a key of the interpreter's identity (``python``, ``python3`` and the console script of
one environment find the same daemon) and the preload set, in the per-user runtime directory.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from .. import settings
from ..files import read_json
from ..identity import interpreter_key

__all__ = ["daemon_paths", "starting_file", "list_daemons", "starting_daemons", "pid_alive",
           "write_starting"]


def daemon_paths(modules: Sequence[str]) -> tuple[str, str]:
    """(socket, metadata file) of the daemon for this interpreter and preload set."""
    key = interpreter_key(json.dumps(list(modules)), length=12)
    base = os.path.join(settings.runtime_dir(), f"d-{key}")
    return base + ".sock", base + ".json"


def starting_file(modules: Sequence[str]) -> str:
    """Present, holding its starter's pid and the preload set, while a daemon is starting."""
    return daemon_paths(modules)[0][:-len(".sock")] + ".starting"


def write_starting(fd: int, pid: int, modules: Sequence[str]) -> None:
    os.write(fd, json.dumps({"pid": pid, "modules": list(modules)}).encode())


def read_starting(path: str) -> dict:
    """{"pid", "modules"} of a starting marker ({} when it is gone or not yet written)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return {}
    if text.isdigit():  # a bare pid: the preload set is not known
        return {"pid": int(text), "modules": None}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else {}


def starting_daemons() -> list[dict]:
    """{"pid", "modules", "marker"} of each daemon of this user's that is starting now."""
    runtime = settings.runtime_dir()
    found = []
    for name in sorted(os.listdir(runtime)):
        if name.endswith(".starting"):
            marker = os.path.join(runtime, name)
            starter = read_starting(marker)
            if starter and pid_alive(starter["pid"]):
                found.append(dict(starter, marker=marker))
    return found


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


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
