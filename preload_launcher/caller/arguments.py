"""A call's arguments checked and normalised as ``subprocess.run`` checks them: the same types
accepted (str, bytes, PathLike), the same exceptions and messages at the call, before anything
is started."""

from __future__ import annotations

import os
from typing import Mapping, Union

__all__ = ["check_args", "check_env", "check_cwd"]


def _no_null(text: str) -> str:
    if "\0" in text:
        raise ValueError("embedded null byte")
    return text


def check_args(args) -> Union[list[str], str]:
    """The command as text: a sequence of str/bytes/PathLike, or one program name."""
    if isinstance(args, (str, bytes, os.PathLike)):
        return _no_null(os.fsdecode(args))
    return [_no_null(os.fsdecode(a)) for a in args]


def check_env(env: Mapping) -> dict[str, str]:
    """``env`` as text; TypeError for other types, ValueError for a name with ``=`` or a
    ``\\0`` anywhere (subprocess's messages)."""
    out = {}
    for key, value in env.items():
        name = os.fsdecode(key)
        if "=" in name:
            raise ValueError("illegal environment variable name")
        out[name] = os.fsdecode(value)
    for name, value in out.items():
        _no_null(name)
        _no_null(value)
    return out


def check_cwd(cwd) -> str:
    """The absolute working directory the step starts in (str, bytes or PathLike; None: ours)."""
    if cwd is None:
        return os.getcwd()
    return os.path.abspath(_no_null(os.fsdecode(cwd)))
