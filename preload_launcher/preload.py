"""Stage 3a: import the preload set without initialising CUDA, and prove it.

Rules while importing (measured on an H200 image):
- ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` keeps ``torch.cuda.is_available()`` off ``cuInit``;
- device queries made at import time (modelopt asks ``get_device_capability``) are answered
  from NVML, and the real functions are put back before the first fork;
- after every import a driver-level probe (``cuDeviceGetCount`` == CUDA_ERROR_NOT_INITIALIZED)
  checks that nothing initialised the driver behind torch's back. The first import that did
  is the culprit: its chain of importers is reported and the preload entry that pulled it in
  is quarantined (remembered per environment in a verdict cache).

Probes are pluggable (``PRELOAD_LAUNCHER_PROBE=fake``) so the logic is tested on CPU.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Optional

__all__ = ["DriverProbe", "probe_from_env", "PreloadReport", "EntryReport", "preload",
           "VerdictCache", "native_threads", "fake_cuinit"]

log = logging.getLogger(__name__)

CUDA_ERROR_NOT_INITIALIZED = 3
# Environment the preload itself sets; never part of a step's import-relevant environment.
PRELOAD_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


# ---------------------------------------------------------------- probes

class DriverProbe:
    """Reports whether the CUDA driver of this process has been initialised."""

    name = "libcuda"

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            self._lib = None

    @property
    def available(self) -> bool:
        return self._lib is not None

    def initialized(self) -> bool:
        if self._lib is None:
            return False
        count = ctypes.c_int(0)
        return self._lib.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def retain_primary_context(ordinal: int) -> bool:
    """Create (and keep) the driver's primary context of GPU ``ordinal``, the one the CUDA
    runtime and torch adopt at first use, without touching torch: ``torch.cuda`` and its
    allocator still read as never initialised. For pre-warmed children only; never the zygote."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    device, context = ctypes.c_int(0), ctypes.c_void_p()
    return (lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(device), ordinal) == 0
            and lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0)


_fake_driver_initialized = False


def fake_cuinit() -> None:
    """What a test's fake culprit module calls to 'initialise the driver' in this process."""
    global _fake_driver_initialized
    _fake_driver_initialized = True


class FakeDriverProbe(DriverProbe):
    """In-process stand-in for the driver, flipped by ``fake_cuinit``."""

    name = "fake"

    def __init__(self) -> None:  # noqa: D401 - no library
        self._lib = None

    @property
    def available(self) -> bool:
        return True

    def initialized(self) -> bool:
        return _fake_driver_initialized


def probe_from_env() -> DriverProbe:
    return FakeDriverProbe() if os.environ.get("PRELOAD_LAUNCHER_PROBE") == "fake" else DriverProbe()


def torch_cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def native_threads() -> dict[str, int]:
    """Thread names of this process (``/proc/self/task/*/comm``) with their counts."""
    names: dict[str, int] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return names


# ---------------------------------------------------------------- NVML answers during import

def visible_count(count: int, environ=os.environ) -> int:
    """Of ``count`` physical GPUs, how many ``CUDA_VISIBLE_DEVICES`` leaves visible."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return count
    return min(count, len([v for v in visible.split(",") if v.strip()]))


def nvml_device_count(environ=os.environ) -> int:
    """Visible GPUs counted through NVML, never through CUDA (0 without NVML or GPUs)."""
    try:
        import pynvml  # provided by nvidia-ml-py
        pynvml.nvmlInit()
        return visible_count(pynvml.nvmlDeviceGetCount(), environ)
    except Exception:
        return 0


def _nvml_device_answers():
    """Replacement ``torch.cuda`` query functions backed by NVML, or None without NVML."""
    try:
        import pynvml  # provided by nvidia-ml-py
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception:
        return None
    if count == 0:
        return None
    import torch

    def physical(device=None) -> int:
        index = 0 if device is None else (device.index or 0) if isinstance(device, torch.device) \
            else int(device) if not isinstance(device, str) else int(device.rpartition(":")[2] or 0)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            ids = [v for v in visible.split(",") if v.strip().isdigit()]
            if index < len(ids):
                return int(ids[index])
        return index

    def handle(device=None):
        return pynvml.nvmlDeviceGetHandleByIndex(physical(device))

    def get_device_capability(device=None):
        return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle(device)))

    def get_device_name(device=None):
        name = pynvml.nvmlDeviceGetName(handle(device))
        return name.decode() if isinstance(name, bytes) else name

    class _Properties:  # the fields NVML can answer truthfully
        def __init__(self, device=None):
            self.name = get_device_name(device)
            self.major, self.minor = get_device_capability(device)
            self.total_memory = pynvml.nvmlDeviceGetMemoryInfo(handle(device)).total

    def device_count():
        return visible_count(count)

    return {
        "get_device_capability": get_device_capability,
        "get_device_name": get_device_name,
        "get_device_properties": lambda device=None: _Properties(device),
        "current_device": lambda: 0,
        "device_count": device_count,
        "is_available": lambda: device_count() > 0,
    }


@contextlib.contextmanager
def cuda_safe_imports() -> Iterator[bool]:
    """Set the NVML-based CUDA check and answer device queries from NVML; undo on exit.

    Yields whether NVML answers were installed (False on machines without NVML).
    """
    saved_env = {k: os.environ.get(k) for k in PRELOAD_ENV}
    os.environ.update(PRELOAD_ENV)
    answers = None
    saved: dict[str, Callable] = {}
    try:
        if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
            answers = _nvml_device_answers()
        if answers:
            import torch.cuda
            saved = {name: getattr(torch.cuda, name) for name in answers}
            for name, fn in answers.items():
                setattr(torch.cuda, name, fn)
        yield bool(answers)
    finally:
        if saved:
            import torch.cuda
            for name, fn in saved.items():
                setattr(torch.cuda, name, fn)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ---------------------------------------------------------------- environment reads during import

class _RecordingEnviron(type(os.environ)):  # type: ignore[misc]
    """``os.environ`` that remembers which keys were looked up one by one (get, [], in, getenv).

    Copies and scans (``dict(os.environ)``, ``.items()``, ``.copy()``) read every key right after
    iterating them, in order: those reads are not recorded, or every variable, down to
    ``PYTEST_CURRENT_TEST``, would look import-relevant."""

    read_keys: set = set()
    _scan: collections.deque = collections.deque()  # keys a scan is about to read, in order

    def __iter__(self):
        keys = list(super().__iter__())
        _RecordingEnviron._scan = collections.deque(keys)
        return iter(keys)

    def __getitem__(self, key):
        scan = _RecordingEnviron._scan
        if scan and scan[0] == key:
            scan.popleft()
        else:
            scan.clear()
            if isinstance(key, str):
                _RecordingEnviron.read_keys.add(key)
        return super().__getitem__(key)


@contextlib.contextmanager
def recording_env_reads() -> Iterator[set]:
    original = os.environ.__class__
    _RecordingEnviron.read_keys = set()
    os.environ.__class__ = _RecordingEnviron
    try:
        yield _RecordingEnviron.read_keys
    finally:
        os.environ.__class__ = original


# ---------------------------------------------------------------- culprit hunting

@dataclass
class EntryReport:
    module: str
    seconds: float = 0.0
    ok: bool = False
    error: str = ""
    python_threads: list[str] = field(default_factory=list)
    native_threads_added: int = 0
    torch_cuda_initialized: bool = False
    driver_initialized: bool = False
    culprit: str = ""
    chain: list[str] = field(default_factory=list)


@dataclass
class PreloadReport:
    requested: list[str]
    entries: list[EntryReport] = field(default_factory=list)
    quarantined: dict[str, dict] = field(default_factory=dict)  # entry -> verdict
    probe: str = ""
    nvml_answers: bool = False
    seconds: float = 0.0
    import_env: dict[str, Optional[str]] = field(default_factory=dict)
    dirty_entry: str = ""  # set when an entry left the process unfit to fork
    learned: dict = field(default_factory=dict)  # the learned preload's summary

    @property
    def loaded(self) -> list[str]:
        return [e.module for e in self.entries if e.ok]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["loaded"] = self.loaded
        return data


class _CulpritHook:
    """Wraps ``__import__`` to catch the first import after which the driver is initialised."""

    def __init__(self, probe: DriverProbe) -> None:
        self.probe = probe
        self.stack: list[str] = []
        self.culprit = ""
        self.chain: list[str] = []
        self._original = builtins.__import__

    def __call__(self, name, globals=None, locals=None, fromlist=(), level=0):
        label = name
        if level:
            try:
                label = importlib.util.resolve_name("." * level + name,
                                                    (globals or {}).get("__package__") or "")
            except (ImportError, ValueError):
                pass
        self.stack.append(label)
        try:
            return self._original(name, globals, locals, fromlist, level)
        finally:
            self.stack.pop()
            if not self.culprit and self.probe.initialized():
                self.culprit = label
                self.chain = _dedupe(self.stack + [label])

    def __enter__(self):
        builtins.__import__ = self
        return self

    def __exit__(self, *exc):
        builtins.__import__ = self._original


def _dedupe(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        if not out or out[-1] != name:
            out.append(name)
    return out


def import_entry(module: str, probe: DriverProbe) -> EntryReport:
    """Import one preload entry and record what it did to the process."""
    report = EntryReport(module=module)
    threads_before = sum(native_threads().values())
    start = time.perf_counter()
    with _CulpritHook(probe) as hook:
        try:
            importlib.import_module(module)
            report.ok = True
        except BaseException as exc:  # a failed preload is reported, never fatal
            report.error = f"{type(exc).__name__}: {exc}"
    report.seconds = round(time.perf_counter() - start, 3)
    report.native_threads_added = sum(native_threads().values()) - threads_before
    report.python_threads = [t.name for t in threading.enumerate()
                             if t is not threading.main_thread()]
    report.torch_cuda_initialized = torch_cuda_initialized()
    report.driver_initialized = probe.initialized()
    if report.driver_initialized or report.torch_cuda_initialized:
        report.culprit = hook.culprit or module
        # import_module() bypasses __import__, so the entry itself heads the chain here.
        report.chain = _dedupe([module] + hook.chain)
    return report


def preload(modules: list[str], probe: DriverProbe, skip: dict[str, dict],
            env_reads: Optional[set] = None) -> PreloadReport:
    """Import ``modules`` in order; stop at the first that makes the process unfit to fork."""
    report = PreloadReport(requested=list(modules), probe=probe.name)
    report.quarantined = dict(skip)
    start = time.perf_counter()
    with cuda_safe_imports() as nvml:
        report.nvml_answers = nvml
        for module in modules:
            if module in skip:
                continue
            entry = import_entry(module, probe)
            report.entries.append(entry)
            if entry.driver_initialized or entry.torch_cuda_initialized:
                report.dirty_entry = module
                break
            if entry.python_threads:
                report.dirty_entry = module
                break
    report.seconds = round(time.perf_counter() - start, 3)
    return report


def preload_learned(modules: list[str], probe: DriverProbe, budget: float) -> tuple[dict, Optional[EntryReport]]:
    """Import learned modules until the time budget is spent; stop at the first dirty one.

    Returns a summary and, when one made the process unfit to fork, its report."""
    summary = {"listed": len(modules), "loaded": 0, "failed": 0, "over_budget": 0, "seconds": 0.0,
               "costs": {}}
    start = time.perf_counter()
    with cuda_safe_imports():
        for i, module in enumerate(modules):
            if time.perf_counter() - start >= budget:
                summary["over_budget"] = len(modules) - i
                break
            if module in sys.modules:
                summary["loaded"] += 1
                continue
            t0 = time.perf_counter()
            with _CulpritHook(probe) as hook:
                try:
                    importlib.import_module(module)
                    summary["loaded"] += 1
                except BaseException:
                    summary["failed"] += 1
            summary["costs"][module] = time.perf_counter() - t0
            dirty = probe.initialized() or torch_cuda_initialized()
            threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
            if dirty or threads:
                entry = EntryReport(module=module, ok=True, python_threads=threads,
                                    driver_initialized=probe.initialized(),
                                    torch_cuda_initialized=torch_cuda_initialized(),
                                    culprit=hook.culprit or module,
                                    chain=_dedupe([module] + hook.chain))
                summary["seconds"] = round(time.perf_counter() - start, 3)
                return summary, entry
    summary["seconds"] = round(time.perf_counter() - start, 3)
    return summary, None


def verdict_for(entry: EntryReport) -> dict:
    if entry.python_threads and not (entry.driver_initialized or entry.torch_cuda_initialized):
        reason = f"started Python threads at import: {', '.join(entry.python_threads)}"
    elif entry.driver_initialized and not entry.torch_cuda_initialized:
        reason = "initialised the CUDA driver behind torch's back"
    else:
        reason = "initialised CUDA"
    return {"culprit": entry.culprit or entry.module, "chain": entry.chain, "reason": reason}


# ---------------------------------------------------------------- verdict cache

def package_fingerprint() -> str:
    """A hash of every installed distribution's name and version (and the interpreter)."""
    import importlib.metadata
    items = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    return hashlib.sha256("\n".join([sys.executable, sys.version, *items]).encode()).hexdigest()[:16]


class VerdictCache:
    """Quarantine verdicts per (interpreter, packages, import env, probe), kept on disk."""

    def __init__(self, directory: str, fingerprint: str) -> None:
        self.path = os.path.join(directory, "verdicts.json")
        self.fingerprint = fingerprint

    def _load(self) -> dict:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self) -> dict[str, dict]:
        return self._load().get(self.fingerprint, {})

    def put(self, entry: str, verdict: dict) -> None:
        data = self._load()
        # Only the current environment's verdicts are worth keeping: versions changed otherwise.
        data = {self.fingerprint: {**data.get(self.fingerprint, {}), entry: verdict}}
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as err:
            log.warning("cannot write verdict cache %s: %s", self.path, err)
