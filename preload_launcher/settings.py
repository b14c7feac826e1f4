"""Settings shared by ``run()``, the CLI and the pytest plugin, each validated with its source."""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["DEFAULT_MODULES", "enabled", "preload_modules", "cache_dir", "runtime_dir",
           "IMPORT_ENV_KEYS"]

DEFAULT_MODULES = ("torch", "megatron.core", "megatron.bridge", "modelopt.torch")

# Environment that shapes what an import does in any interpreter; a zygote is only reused for
# steps that agree on these and on every variable its preload was seen reading.
IMPORT_ENV_KEYS = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONUSERBASE",
                   "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONUTF8", "PYTHONPLATLIBDIR",
                   "PYTHONSAFEPATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "VIRTUAL_ENV",
                   "PRELOAD_LAUNCHER_PROBE")


def _validate_bool(value: str, where: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"Invalid boolean {value!r} from {where}")


def _validate_modules(value: str, where: str) -> tuple[str, ...]:
    modules = tuple(m.strip() for m in value.split(",") if m.strip())
    for m in modules:
        if not all(part.isidentifier() for part in m.split(".")):
            raise ValueError(f"Invalid module name {m!r} from {where}")
    return modules


def enabled(environ: Mapping[str, str] = os.environ, default: bool = True) -> bool:
    """``PRELOAD_LAUNCHER=0`` turns the zygote off (the per-lane toggle)."""
    value = environ.get("PRELOAD_LAUNCHER")
    return default if value is None else _validate_bool(value, "PRELOAD_LAUNCHER environment variable")


def prewarm_enabled(environ: Mapping[str, str] = os.environ, default: bool = False) -> bool:
    """``PRELOAD_LAUNCHER_PREWARM=1``: keep a child forked ahead, its CUDA context made.
    Unset, ``default``: on for a daemon on a machine with GPUs, off otherwise."""
    value = environ.get("PRELOAD_LAUNCHER_PREWARM")
    return default if value is None else _validate_bool(value, "PRELOAD_LAUNCHER_PREWARM environment variable")


def prewarm_ranks(environ: Mapping[str, str] = os.environ) -> int:
    """Ranks of the pre-warmed torchrun agent: ``PRELOAD_LAUNCHER_PREWARM_RANKS``, else the
    number of GPUs NVML sees (0 without NVML: no pre-warmed agent)."""
    value = environ.get("PRELOAD_LAUNCHER_PREWARM_RANKS")
    if value is not None:
        return int(value)
    from .preload import nvml_device_count
    return nvml_device_count(environ)


def preload_modules(explicit: Optional[str] = None, ini: Optional[str] = None,
                    environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Precedence: explicit (CLI/argument) > env > ini > default."""
    if explicit is not None:
        return _validate_modules(explicit, "--preload")
    if environ.get("PRELOAD_LAUNCHER_MODULES") is not None:
        return _validate_modules(environ["PRELOAD_LAUNCHER_MODULES"],
                                 "PRELOAD_LAUNCHER_MODULES environment variable")
    if ini is not None:
        return _validate_modules(ini, "preload_launcher_modules ini option")
    return DEFAULT_MODULES


def cache_dir(environ: Mapping[str, str] = os.environ) -> str:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return environ.get("PRELOAD_LAUNCHER_CACHE_DIR") or os.path.join(base, "preload_launcher")


def runtime_dir(environ: Mapping[str, str] = os.environ) -> str:
    """A per-user directory (mode 0700) for sockets and logs."""
    base = environ.get("XDG_RUNTIME_DIR") or "/tmp"
    path = os.path.join(base, f"preload_launcher-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be owned by uid {os.getuid()} with mode 0700")
    return path
