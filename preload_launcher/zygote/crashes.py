"""Entries that crash the interpreter at import (a segfault in an extension's init): remembered,
so that only one zygote ever dies of one.

While a zygote imports an entry never seen to import cleanly, ``<cache>/importing-<pid>.txt``
names it (with the verdict cache's key) and ``faulthandler`` is armed to write into that file:
a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) leaves "Fatal Python error: …" there.
The next zygote turns such a record into the entry's quarantine verdict, naming the signal.
A record without one (the zygote was killed, or is still importing) is no verdict.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
from typing import Iterable, Optional

__all__ = ["CrashGuard", "collect_crashes", "crash_verdict"]

PREFIX = "importing-"
FATAL = re.compile(r"Fatal Python error: (.+)")


SIGNALS = {"Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS", "Aborted": "SIGABRT",
           "Floating-point exception": "SIGFPE", "Floating point exception": "SIGFPE",
           "Illegal instruction": "SIGILL"}

def crash_verdict(entry: str, how: str) -> dict:
    return {"culprit": entry, "chain": [entry], "reason": f"crashed the interpreter at import ({how})"}


class CrashGuard:
    """Names the entry being imported in a file that a fatal signal fills in."""

    def __init__(self, cache_dir: str, key: str, known: Iterable[str] = ()) -> None:
        self.path = os.path.join(cache_dir, f"{PREFIX}{os.getpid()}.txt")
        self.key = key
        self.known = set(known)  # entries that imported cleanly before: no record needed
        self.fd = -1
        self.was_enabled = faulthandler.is_enabled()

    def importing(self, entry: str) -> None:
        if entry in self.known:
            self.close()
            return
        header = (json.dumps({"key": self.key, "entry": entry}) + "\n").encode()
        try:
            if self.fd < 0:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.ftruncate(self.fd, 0)
            os.lseek(self.fd, 0, os.SEEK_SET)
            if os.write(self.fd, header) != len(header):
                raise OSError("short write")
        except OSError:
            self.close()  # an unwritable cache: no record, the rest works as before
            return
        faulthandler.enable(file=self.fd, all_threads=False)  # writes after the header

    def close(self) -> None:
        """The entries were imported (or failed) without crashing: no record stays."""
        if self.fd < 0:
            return
        if self.was_enabled:
            faulthandler.enable()  # back to stderr, as the interpreter was started
        else:
            faulthandler.disable()  # children are fresh interpreters: no handler of ours
        os.close(self.fd)
        self.fd = -1
        try:
            os.unlink(self.path)
        except OSError:
            pass


def collect_crashes(cache_dir: str) -> dict[str, dict[str, dict]]:
    """Crash records of zygotes that died of a fatal signal: {cache key: {entry: verdict}}.
    Each record is removed once read; records of dead zygotes without a crash go too."""
    found: dict[str, dict[str, dict]] = {}
    try:
        names = [n for n in os.listdir(cache_dir) if n.startswith(PREFIX) and n.endswith(".txt")]
    except OSError:
        return found
    for name in names:
        path = os.path.join(cache_dir, name)
        pid = _pid_of(name)
        record = _read(path)
        if record is None:
            continue
        header, how = record
        if how is None and pid is not None and pid != os.getpid() and _alive(pid):
            continue  # another zygote is importing right now
        if how is not None and header.get("entry") and header.get("key"):
            found.setdefault(header["key"], {})[header["entry"]] = crash_verdict(header["entry"], how)
        try:
            os.unlink(path)
        except OSError:
            pass
    return found


def _read(path: str) -> Optional[tuple[dict, Optional[str]]]:
    try:
        with open(path, errors="replace") as f:
            first, rest = f.readline(), f.read()
        header = json.loads(first)
    except (OSError, ValueError):
        return None
    match = FATAL.search(rest)
    how = match.group(1).strip() if match else None
    if how in SIGNALS:
        how = f"{SIGNALS[how]}: {how}"
    return (header if isinstance(header, dict) else {}), how


def _pid_of(name: str) -> Optional[int]:
    try:
        return int(name[len(PREFIX):-len(".txt")])
    except ValueError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
