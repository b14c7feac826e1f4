"""The per-user runtime directory (sockets, logs, stand-ins, daemon metadata), made so that no
other user can put anything in it, swap it, or keep us from having one.

The preferred place is ``$XDG_RUNTIME_DIR/preload_launcher-<uid>`` (``/tmp/…`` without
``XDG_RUNTIME_DIR``). It is used only when every directory from ``/`` down to it is safe: the
path is resolved once, then each component must be owned by root or us and writable by no one
else unless sticky (as ``/tmp`` is: there only an entry's owner may rename it), and the directory
itself is checked without following links: ours, a real directory, mode 0700. Such a path cannot
be re-pointed afterwards. When another user holds the predictable name (or made it a link, or
left it open), or when it is too long to hold a Unix socket's path, a directory under our cache
directory is used instead, checked the same way; when neither is usable, ``NoPrivateDirectory``
says why and the caller runs the step as a plain process.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys

from .result import LauncherError

__all__ = ["NoPrivateDirectory", "private_runtime_dir", "unsafe_chain", "owned_privately",
           "MAX_SOCKET_PATH"]

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
# The longest socket name the launcher gives (``z-<pid>-<n>.sock``; pids stay below 2**22,
# ``d-<key>.sock`` is shorter): a directory is usable only when that still fits.
LONGEST_SOCKET_NAME = len("z-4194304-9999.sock")

_warned: set = set()  # fallbacks already reported by this process


class NoPrivateDirectory(LauncherError):
    """Neither the runtime directory nor the fallback is safe to keep sockets in."""


def private_runtime_dir(base: str, cache_dir: str) -> str:
    """The verified real path of this user's runtime directory (see the module's docstring)."""
    name = f"preload_launcher-{os.getuid()}"
    preferred = os.path.join(base, name)
    too_long = _too_long(base, name)
    problem = too_long or _private_dir(base, name)
    if not problem:
        return os.path.join(os.path.realpath(base), name)
    hint = ("set XDG_RUNTIME_DIR to a shorter directory" if too_long
            else "set XDG_RUNTIME_DIR to a directory only you can write")
    # One per machine (a $HOME shared by machines), named short: sockets take 107 bytes at most.
    fallback_name = "run-" + hashlib.sha1(os.uname().nodename.encode()).hexdigest()[:8]
    fallback_problem = (_too_long(cache_dir, fallback_name)
                        or _private_dir(cache_dir, fallback_name))
    if fallback_problem:
        raise NoPrivateDirectory(f"no private runtime directory: {problem}; {fallback_problem} "
                                 f"({hint})")
    fallback = os.path.join(os.path.realpath(cache_dir), fallback_name)
    if preferred not in _warned:
        _warned.add(preferred)
        print(f"preload_launcher: {problem}; using {fallback} instead ({hint})", file=sys.stderr)
    return fallback


def _too_long(base: str, name: str) -> str:
    """"" when the launcher's socket paths fit under ``base/name``, else why not: the kernel
    binds no longer path, so no step could be served from there."""
    longest = len(os.fsencode(os.path.join(os.path.realpath(base), name))) + 1 \
        + LONGEST_SOCKET_NAME
    if longest <= MAX_SOCKET_PATH:
        return ""
    return (f"{os.path.join(base, name)} is too long to hold Unix sockets (their paths would "
            f"take up to {longest} bytes, {MAX_SOCKET_PATH} at most)")


def _private_dir(base: str, name: str) -> str:
    """Make ``base/name`` (mode 0700) where that is safe; "" when it is, else why not."""
    path = os.path.join(base, name)
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        real_base = os.path.realpath(base)
        problem = unsafe_chain(real_base)
        if problem:
            return problem
        try:
            os.mkdir(os.path.join(real_base, name), 0o700)
        except FileExistsError:
            pass
        st = os.lstat(os.path.join(real_base, name))
    except OSError as err:
        return f"{path}: {err.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not 700"
    return ""


def unsafe_chain(real_path: str) -> str:
    """"" when no one but root and us can rename or replace any directory from ``/`` down to
    ``real_path`` (already resolved); else the first one that another user could."""
    uid = os.getuid()
    current = "/"
    for part in ["", *real_path.strip("/").split("/")]:
        current = os.path.join(current, part)
        st = os.lstat(current)
        if stat.S_ISLNK(st.st_mode):  # resolved a moment ago: re-pointed since
            return f"{current} is a symbolic link"
        if st.st_uid not in (0, uid):
            return f"{current} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{current} is writable by other users"
    return ""


def owned_privately(path: str) -> bool:
    """Ours, not a link, and writable by no one else (a stand-in, its directory)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_uid == os.getuid() and not st.st_mode & 0o022
            and not stat.S_ISLNK(st.st_mode))
