"""Every variable the launcher interprets, read here and nowhere else, into one typed snapshot.

``Settings.from_env(environ)`` reads ``PRELOAD_LAUNCHER_*`` (and the XDG directories) with one
boolean rule; a bad value raises ``SettingsError`` (a ``ValueError``) naming the variable it
came from and the values it accepts. The zygote receives its own snapshot as a
``ZygoteConfig`` (JSON on its command line).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional

from .rundir import private_runtime_dir

__all__ = ["DEFAULT_MODULES", "IMPORT_ENV_KEYS", "Settings", "SettingsError", "ZygoteConfig",
           "parse_bool", "preload_modules", "preload_source", "runtime_dir", "QUARANTINE_ENV",
           "RESTARTED_ENV", "PER_TEST_ENV", "TERMINAL_ENV", "THREAD_ENV", "NATIVE_ENV",
           "COVERAGE_ENV_PREFIXES"]

DEFAULT_MODULES = ("torch", "megatron.core", "megatron.bridge", "modelopt.torch")

# Environment that shapes what an import does in any interpreter; a zygote is only reused for
# steps that agree on these and on every variable its preload was seen reading.
IMPORT_ENV_KEYS = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONUSERBASE",
                   "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONUTF8", "PYTHONPLATLIBDIR",
                   "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE", "LD_PRELOAD", "LD_LIBRARY_PATH",
                   "VIRTUAL_ENV", "PRELOAD_LAUNCHER_PROBE")

# Every setting python takes from the environment (``python --help-env``) has one rule here
# (tests/test_differential.py checks that each variable python documents has one), so that
# no step ever gets a start-up setting of another step's:
# - IMPORT_ENV_KEYS (above): a zygote starts with its first step's value and serves only
#   steps that agree (the hash seed, sys.flags.dont_write_bytecode, ...);
# - STARTUP_FLAG_ENV: what they put in ``sys.flags`` keys the zygote the same way
#   (``interpreter.startup_flags``);
STARTUP_FLAG_ENV = ("PYTHONOPTIMIZE", "PYTHONDEVMODE", "PYTHONWARNDEFAULTENCODING",
                    "PYTHONINTMAXSTRDIGITS", "PYTHONUTF8")
# - STEP_STARTUP_ENV: a zygote starts without them, and each step applies its own (``child``);
STEP_STARTUP_ENV = ("PYTHONFAULTHANDLER", "PYTHONTRACEMALLOC")
# - FRESH_START_ENV: a zygote starts without them, and a step that sets one runs as a fresh
#   interpreter (``rerun``): the allocator, code objects' position tables, the interactive
#   prompt after the program, the perf trampoline, the CPU count, frozen modules, the GIL,
#   every import printed or timed, and a debug build's own switches take effect only there;
FRESH_START_ENV = ("PYTHONINSPECT", "PYTHONMALLOC", "PYTHONMALLOCSTATS", "PYTHONNODEBUGRANGES",
                   "PYTHONPERFSUPPORT", "PYTHON_PERF_JIT_SUPPORT", "PYTHON_CPU_COUNT",
                   "PYTHON_FROZEN_MODULES", "PYTHON_GIL", "PYTHON_JIT", "PYTHONVERBOSE",
                   "PYTHONPROFILEIMPORTTIME", "PYTHONCASEOK", "PYTHONDEBUG", "PYTHONDUMPREFS",
                   "PYTHONSHOWREFCOUNT", "PYTHON_PRESITE")
# - STEP_ENV: read by python as the program runs, or set up in each step from the step's own
#   environment (stdio, locale coercion, the bytecode cache folder, breakpoint()), or used only
#   by the interactive prompt, or on another platform.
STEP_ENV = ("PYTHONIOENCODING", "PYTHONUNBUFFERED", "PYTHONCOERCECLOCALE", "PYTHONPYCACHEPREFIX",
            "PYTHONBREAKPOINT", "PYTHONSTARTUP", "PYTHON_HISTORY", "PYTHON_BASIC_REPL",
            "PYTHON_COLORS", "PYTHONEXECUTABLE", "PYTHONLEGACYWINDOWSFSENCODING",
            "PYTHONLEGACYWINDOWSSTDIO", "PYTHON_THREAD_INHERIT_CONTEXT",
            "PYTHON_CONTEXT_AWARE_WARNINGS", "PYTHON_TLBC")

# Set per test by pytest: never in a zygote's environment, never import-relevant (torch_geometric
# allocates CUDA tensors at import when it is set, pyg#10582).
PER_TEST_ENV = ("PYTEST_CURRENT_TEST",)
# Coverage's: a zygote starts without them (a measured zygote would hand its tracer down), and
# each step starts coverage as its start-up hook would (``child.start_coverage_if_requested``).
COVERAGE_ENV_PREFIXES = ("COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG", "COV_CORE_")
# The terminal's size: readline exports it once loaded, and a resize changes it, so it differs
# between a suite's processes for no reason an import cares about. A module that reads it at
# import (accelerate's menus, through shutil.get_terminal_size) keeps the zygote's reading; the
# step's own environment and calls see the step's (a known difference).
TERMINAL_ENV = ("COLUMNS", "LINES")
# Thread counts: set per step, in the step (``threads``); a zygote starts without them.
# OpenBLAS takes OPENBLAS_NUM_THREADS, else GOTO_NUM_THREADS, else OMP_NUM_THREADS.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")

# Read by the stack's native code when its libraries load (getenv calls seen while importing
# torch, numpy, megatron.core and modelopt.torch on a CPU machine; torch+CUDA, Transformer
# Engine, megatron.core, modelopt.torch and transformers on an H200: scripts/native_env_reads.sh,
# docs/runs/2026-12-03-h200-native_env_reads.log), with no API to apply another value later: a
# zygote serves only steps that agree with it on these, as on the variables its imports read.
# (The CUDA driver's own variables are read at cuInit, which happens in the step.)
# "X*" stands for every variable named X... (THREAD_ENV aside: each step sets those itself).
# What a library does offer an API for is re-read in each step instead (``native_env``: the
# time zone, torch.distributed's debug level; ``threads``: pool sizes).
NATIVE_ENV = (
    "OMP_*", "GOMP_*", "ACC_DEVICE_NUM", "ACC_DEVICE_TYPE",  # GNU OpenMP (torch's libgomp):
    # schedule, binding and places, wait policy, stack size, thread limit, nesting
    "OPENBLAS_*", "GFORTRAN_*",  # numpy's OpenBLAS (core type, buffer size, thread timeout,
    # verbosity) and the gfortran runtime it brings
    "MKL_*", "I_MPI_*", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",  # torch's MKL:
    # dynamic threading, memory manager, its count under MPI
    "ONEDNN_*", "DNNL_*", "MKLDNN_*", "INTEL_LIBITTNOTIFY64",  # torch's oneDNN: ISA, fp-math
    # mode, verbosity, primitive cache
    "NPY_ENABLE_CPU_FEATURES", "NPY_DISABLE_CPU_FEATURES",  # numpy's C core: dispatch
    "NUMPY_WARN_IF_NO_MEM_POLICY",
    "TORCH_SHOW_CPP_STACKTRACES", "TORCH_CPP_LOG_LEVEL",  # libtorch: C++ traces in errors,
    "TORCH_CUSTOM_TERMINATE", "PYTORCH_API_USAGE_STDERR",  # its log level and terminate
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "TORCH_LINALG_PREFER_CUSOLVER",  # handler; backend
    "TORCH_BLAS_PREFER_CUBLASLT", "KINETO_USE_DAEMON", "THP_MEM_ALLOC_ENABLE",  # choices,
    "PYTORCH_JIT_LOG_LEVEL", "TORCH_JIT_DISABLE_NEW_EXECUTOR",  # the profiler, the JIT
    "TORCH_LINALG_PREFER_HIPSOLVER", "TORCH_BLAS_PREFER_HIPBLASLT",  # and on ROCm builds
    "TORCH_ROCM_FA_PREFER_CK",
    "OPENSSL_*",  # OpenSSL (through _ssl/_hashlib): CPU features, config, FIPS mode
    "PSUTIL_*",  # psutil's C extension
    "MALLOC_*", "GLIBC_TUNABLES", "GLIBCXX_TUNABLES",  # the C and C++ runtimes, at start
    # CUDA builds of torch: the caching allocator's configuration (a script's own
    # PYTORCH_CUDA_ALLOC_CONF before `import torch` included), launch blocking, device-side
    # assertions, symmetric memory, vitals; the CUDA libraries' logging and switches
    "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF",
    "CUDA_LAUNCH_BLOCKING", "PYTORCH_CUDA_DSA_STACKTRACING", "PYTORCH_USE_CUDA_DSA",
    "TORCH_SYMMMEM", "TORCH_VITAL", "CUDA_LOG_FILE", "ATEN_CPU_CAPABILITY",
    "CUBLAS_*", "CUBLASLT_*", "CUDNN_*", "CASK_*", "NVRTC_*", "LIBNVVM_*", "NV_NVVM_VERSION",
    "LLVM_*", "AS_SECURE_LOG_FILE", "PTXAS_OPTIONS",
    "TRITON_ENABLE_PYTHON_STACKTRACE", "TRITON_INSTRUMENTATION_MODE", "TRITON_DEBUG",
    "TRITON_INTERPRET", "TRITON_CACHE_AUTOTUNING",  # triton's native library
    "TF_*", "GCS_*", "GRPC_*", "MPITRAMPOLINE_*",  # jaxlib's runtime, where jax is installed
    "LOCALTIME", "SQLITE_TMPDIR",  # absl's time zone; SQLite's temporary folder
    # transformers' tokenizers (Rust: its logger), pyarrow (allocator, SIMD level, its bundled
    # SSL and cloud clients), FreeType
    "TOKENIZERS_LOG", "RUST_LOG_STYLE", "NO_COLOR", "CLICOLOR", "CLICOLOR_FORCE",
    "ARROW_*", "JE_ARROW_MALLOC_CONF", "AZURE_LOG_LEVEL", "SSLKEYLOGFILE", "FREETYPE_PROPERTIES",
)

# Set by the zygote for its own re-exec: the quarantine so far, and "restarted after a change".
QUARANTINE_ENV = "_PRELOAD_LAUNCHER_QUARANTINE"
RESTARTED_ENV = "_PRELOAD_LAUNCHER_RESTARTED"

PREWARM_CUDA_LEVELS = ("context", "kernels", "0")
PROBES = ("libcuda", "fake")
DEFERRED_MODES = ("lazy", "eager")

SUITE_WIDE = "suite"  # PRELOAD_LAUNCHER's value that also serves what tests start themselves
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


class SettingsError(ValueError):
    """A launcher setting with a value it does not accept (the message names both)."""


def parse_bool(value: str, where: str) -> bool:
    """The one boolean rule: 1/true/yes/on and 0/false/no/off/empty, any case; else an error."""
    lowered = value.strip().lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise SettingsError(f"Invalid boolean {value!r} from {where} "
                        "(use 1/0, true/false, yes/no, on/off)")


def parse_modules(value: str, where: str) -> tuple[str, ...]:
    modules = tuple(m.strip() for m in value.split(",") if m.strip())
    for m in modules:
        if not all(part.isidentifier() for part in m.split(".")):
            raise SettingsError(f"Invalid module name {m!r} from {where} "
                                "(comma-separated module names, like torch,megatron.core)")
    return modules


def _number(kind, value: str, where: str, minimum: float = 0):
    accepted = f"({'a whole number' if kind is int else 'a number'}, at least {minimum:g})"
    try:
        number = kind(value)
    except ValueError:
        raise SettingsError(f"Invalid {kind.__name__} {value!r} from {where} {accepted}") from None
    if number < minimum:
        raise SettingsError(f"{where} must be at least {minimum:g}, not {value!r}")
    return number


def parse_gpus(value: str, where: str) -> str:
    """GPU packing's setting: "" or 0 (off), "auto", or GPU ids ("0,1,2,3")."""
    value = value.strip()
    if value in ("", "0", "off"):
        return ""
    parts = value.split(",")
    if value != "auto" and not all(p.strip() for p in parts):
        raise SettingsError(f"Invalid GPU list {value!r} from {where} (auto, or ids like 0,1,2)")
    return value


def _choice(value: str, choices: tuple[str, ...], where: str) -> str:
    if value not in choices:
        raise SettingsError(f"Invalid value {value!r} from {where} (one of: {', '.join(choices)})")
    return value


class _Reader:
    """Reads one mapping, naming the variable in every error."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    def raw(self, key: str) -> Optional[str]:
        return self.environ.get(key)

    def flag(self, key: str, default: Optional[bool]) -> Optional[bool]:
        value = self.environ.get(key)
        return default if value is None else parse_bool(value, f"{key} environment variable")

    def number(self, key: str, kind, default, minimum: float = 0):
        value = self.environ.get(key)
        return default if value is None else _number(kind, value, f"{key} environment variable",
                                                     minimum)

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = self.environ.get(key)
        return default if value is None else _choice(value, choices, f"{key} environment variable")


@dataclass(frozen=True)
class Settings:
    """What one environment asks of the launcher (docs/user-guide.md lists each variable)."""

    toggle: Optional[bool] = None  # PRELOAD_LAUNCHER: the per-lane toggle (None: not set)
    # PRELOAD_LAUNCHER=suite: on, and every interpreter a test process starts is served too
    # (suite_wide); None: not said here (the plugin's option or ini key may say it).
    suite_wide: Optional[bool] = None
    modules: Optional[tuple[str, ...]] = None  # PRELOAD_LAUNCHER_MODULES (None: not set)
    prewarm: Optional[bool] = None  # PRELOAD_LAUNCHER_PREWARM (None: the caller's default)
    prewarm_ranks: Optional[int] = None  # PRELOAD_LAUNCHER_PREWARM_RANKS (None: one per GPU)
    prewarm_cuda: str = "context"  # PRELOAD_LAUNCHER_PREWARM_CUDA: context, kernels or 0
    deferred: str = "lazy"  # PRELOAD_LAUNCHER_DEFERRED: when a step replays deferred imports
    profile: str = ""  # PRELOAD_LAUNCHER_PROFILE: a portable profile to start from
    autoserve: bool = True  # PRELOAD_LAUNCHER_AUTOSERVE: `run` starts a daemon for the next run
    idle_timeout_s: float = 1800.0  # PRELOAD_LAUNCHER_IDLE_TIMEOUT_S: a daemon's (0: never stop)
    spawn: bool = True  # PRELOAD_LAUNCHER_SPAWN: serve a step's spawned interpreters
    nested: bool = True  # PRELOAD_LAUNCHER_NESTED: serve interpreters a non-python step starts
    gpus: str = ""  # PRELOAD_LAUNCHER_GPUS: pack steps onto free GPUs ("auto" or "0,1,…"; "" off)
    learn: bool = True  # PRELOAD_LAUNCHER_LEARN
    learn_budget_s: float = 60.0  # PRELOAD_LAUNCHER_LEARN_BUDGET_S
    max_ranks: int = 1024  # PRELOAD_LAUNCHER_MAX_RANKS
    probe: str = "libcuda"  # PRELOAD_LAUNCHER_PROBE: "fake" for CPU tests of the CUDA rules
    cache_dir: str = ""  # PRELOAD_LAUNCHER_CACHE_DIR, else $XDG_CACHE_HOME/preload_launcher
    runtime_base: str = "/tmp"  # XDG_RUNTIME_DIR, else /tmp
    quarantine: dict = field(default_factory=dict)  # the zygote's own re-exec state
    restarted: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        r = _Reader(environ)
        modules = r.raw("PRELOAD_LAUNCHER_MODULES")
        toggle, suite_wide = _toggle(r.raw("PRELOAD_LAUNCHER"))
        return cls(
            toggle=toggle,
            suite_wide=suite_wide,
            modules=None if modules is None else parse_modules(
                modules, "PRELOAD_LAUNCHER_MODULES environment variable"),
            prewarm=r.flag("PRELOAD_LAUNCHER_PREWARM", None),
            prewarm_ranks=r.number("PRELOAD_LAUNCHER_PREWARM_RANKS", int, None),
            prewarm_cuda=r.choice("PRELOAD_LAUNCHER_PREWARM_CUDA", PREWARM_CUDA_LEVELS, "context"),
            deferred=r.choice("PRELOAD_LAUNCHER_DEFERRED", DEFERRED_MODES, "lazy"),
            profile=r.raw("PRELOAD_LAUNCHER_PROFILE") or "",
            autoserve=r.flag("PRELOAD_LAUNCHER_AUTOSERVE", True),
            idle_timeout_s=r.number("PRELOAD_LAUNCHER_IDLE_TIMEOUT_S", float, 1800.0),
            spawn=r.flag("PRELOAD_LAUNCHER_SPAWN", True),
            nested=r.flag("PRELOAD_LAUNCHER_NESTED", True),
            gpus=parse_gpus(r.raw("PRELOAD_LAUNCHER_GPUS") or "",
                            "PRELOAD_LAUNCHER_GPUS environment variable"),
            learn=r.flag("PRELOAD_LAUNCHER_LEARN", True),
            learn_budget_s=r.number("PRELOAD_LAUNCHER_LEARN_BUDGET_S", float, 60.0),
            max_ranks=r.number("PRELOAD_LAUNCHER_MAX_RANKS", int, 1024, minimum=1),
            probe=r.choice("PRELOAD_LAUNCHER_PROBE", PROBES, "libcuda"),
            cache_dir=r.raw("PRELOAD_LAUNCHER_CACHE_DIR") or os.path.join(
                r.raw("XDG_CACHE_HOME") or os.path.join(r.raw("HOME") or os.path.expanduser("~"),
                                                        ".cache"),
                "preload_launcher"),
            runtime_base=r.raw("XDG_RUNTIME_DIR") or "/tmp",
            quarantine=_quarantine(r.raw(QUARANTINE_ENV)),
            restarted=bool(r.raw(RESTARTED_ENV)),
        )

    @property
    def enabled(self) -> bool:
        """On unless ``PRELOAD_LAUNCHER`` says off."""
        return self.toggle is not False


def _toggle(value: Optional[str]) -> tuple[Optional[bool], Optional[bool]]:
    """``PRELOAD_LAUNCHER``: the boolean rule, or ``suite`` (on, suite-wide)."""
    if value is None:
        return None, None
    if value.strip().lower() == SUITE_WIDE:
        return True, True
    try:
        on = parse_bool(value, "PRELOAD_LAUNCHER environment variable")
    except SettingsError as err:
        raise SettingsError(f"{str(err)[:-1]}, or {SUITE_WIDE})") from None
    return on, None if on else False


def _quarantine(value: Optional[str]) -> dict:
    if not value:
        return {}
    try:
        data = json.loads(value)
    except ValueError:
        raise SettingsError(f"Invalid JSON from {QUARANTINE_ENV} environment variable") from None
    return data if isinstance(data, dict) else {}


def preload_modules(explicit: Optional[str] = None, ini: Optional[str] = None,
                    environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Precedence: explicit (CLI/argument) > env > ini > default."""
    if explicit is not None:
        return parse_modules(explicit, "--preload")
    from_env = Settings.from_env(environ).modules
    if from_env is not None:
        return from_env
    if ini is not None:
        return parse_modules(ini, "preload_launcher_modules ini option")
    return DEFAULT_MODULES


def preload_source(explicit: Optional[str] = None, ini: Optional[str] = None,
                   environ: Mapping[str, str] = os.environ) -> str:
    """Where ``preload_modules`` took the list from, by the same precedence ("" for the
    default list): a module the user named is worth a warning when it cannot be imported."""
    if explicit is not None:
        return "--preload"
    if Settings.from_env(environ).modules is not None:
        return "PRELOAD_LAUNCHER_MODULES"
    return "the preload_launcher_modules ini option" if ini is not None else ""


def runtime_dir(environ: Mapping[str, str] = os.environ) -> str:
    """This user's private directory (mode 0700) for sockets and logs, verified without
    following links (``rundir``); raises ``rundir.NoPrivateDirectory`` when there is none."""
    s = Settings.from_env(environ)
    return private_runtime_dir(s.runtime_base, s.cache_dir)


@dataclass
class ZygoteConfig:
    """Everything a zygote is started with: its fds, its preload set, the caller's settings."""

    modules: list[str]
    listen_fd: int
    ready_fd: int
    socket_path: str
    cache_dir: str
    project: str
    alive_fd: int = -1  # EOF here: the starter went away (-1 for a daemon)
    daemon: bool = False
    learn: bool = True
    learn_budget_s: float = 60.0
    prewarm: bool = False
    prewarm_ranks: int = 0
    profile: str = ""  # a portable profile's path ("" = none)
    idle_timeout_s: float = 0.0  # a daemon stops after this long without a request (0: never)
    gpus: list = field(default_factory=list)  # GPU packing's pool ([] = off)
    gpus_visible: Optional[str] = None  # the starter's CUDA_VISIBLE_DEVICES
    lock_fd: int = -1  # a daemon's lock (files.lock_file), held for its life (-1: none)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ZygoteConfig":
        return cls(**json.loads(text))
