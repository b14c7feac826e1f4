"""The launcher's own files (verdicts, learned profiles, daemon metadata, sockets, logs)."""

from __future__ import annotations

import json
import os
from typing import Optional

__all__ = ["read_json", "write_json", "unlink_all", "zygote_files", "remove_all"]


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
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


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
    the directory of its stand-ins (``standin``) and, for a daemon, the metadata its starter
    writes."""
    base = socket_path[:-len(".sock")]
    return {"socket": socket_path, "log": base + ".log", "standins": base + ".bin",
            "meta": base + ".json"}
