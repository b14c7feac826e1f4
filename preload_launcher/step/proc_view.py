"""What the kernel shows of a step from outside: its command line, environment and name.

``/proc/<pid>/cmdline`` (ps -f, pgrep -f, psutil's ``cmdline()``), ``/proc/<pid>/environ`` and
``/proc/<pid>/comm`` (ps, psutil's ``name()``) are read by the kernel from the process, not
from Python: the first two from the areas ``execve`` filled (the bounds are in
``/proc/self/stat``), the name from the executable's file name. A forked step is a copy of the
zygote, so they would all be the zygote's. The step writes what ``execve`` would have given a
fresh interpreter (its ``sys.orig_argv`` and its starting environment) into one buffer it keeps,
and points the kernel at it with ``PR_SET_MM_MAP`` (allowed to an unprivileged process as long
as the executable link is left alone), and names itself with ``PR_SET_NAME``. The memory map
call is made only while the step has one thread: it also rewrites the program break, read just
before, which another thread's ``malloc`` could move meanwhile. Where the kernel refuses (a
kernel without checkpoint/restore support), the zygote's stay: a known difference.
"""

from __future__ import annotations

import ctypes
import os
from typing import Mapping, Sequence

__all__ = ["show"]

PR_SET_NAME = 15
PR_SET_MM = 35
PR_SET_MM_MAP = 14
NAME_BYTES = 15  # the kernel's TASK_COMM_LEN less its NUL

_FIELDS = ("start_code", "end_code", "start_data", "end_data", "start_brk", "brk",
           "start_stack", "arg_start", "arg_end", "env_start", "env_end")
# Their fields in /proc/self/stat (1-based, as proc(5) numbers them); brk is not there.
_STAT_FIELD = {"start_code": 26, "end_code": 27, "start_stack": 28, "start_data": 45,
               "end_data": 46, "start_brk": 47}


class _MmMap(ctypes.Structure):  # struct prctl_mm_map, <linux/prctl.h>
    _fields_ = [(name, ctypes.c_uint64) for name in _FIELDS] + [
        ("auxv", ctypes.c_void_p), ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


_kept = None  # the buffer the kernel now reads: it must live as long as the process


def show(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Make the kernel show ``argv`` and ``env`` as this process's command line and
    environment, and the executable's file name as its name; True where it could."""
    global _kept
    libc = ctypes.CDLL(None, use_errno=True)
    name = os.fsencode(os.path.basename(argv[0]))[:NAME_BYTES] if argv else b""
    if name:
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    if len(os.listdir("/proc/self/task")) != 1:
        return False
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return False
    if len(fields) < 51 - 2:
        return False
    args = b"".join(os.fsencode(a) + b"\0" for a in argv)
    envs = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
    buffer = ctypes.create_string_buffer(args + envs, len(args) + len(envs))
    at = ctypes.addressof(buffer)
    libc.sbrk.restype = ctypes.c_void_p
    now = {name: int(fields[number - 3]) for name, number in _STAT_FIELD.items()}
    mm = _MmMap(**now, brk=libc.sbrk(0) or 0, arg_start=at, arg_end=at + len(args),
                env_start=at + len(args), env_end=at + len(args) + len(envs),
                auxv=None, auxv_size=0, exe_fd=0xFFFFFFFF)  # (u32)-1: the executable stays
    if libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.byref(mm), ctypes.sizeof(mm), 0) != 0:
        return False
    _kept = buffer
    return True
