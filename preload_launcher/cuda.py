"""What this process's CUDA state is, asked without initialising it, and whether it may fork.

- ``DriverProbe``: ``cuDeviceGetCount`` from ``libcuda.so.1`` returns CUDA_ERROR_NOT_INITIALIZED
  until something called ``cuInit``; the only way to see a driver initialised behind torch's
  back (torch_geometric does). ``PRELOAD_LAUNCHER_PROBE=fake`` swaps in a flag that test modules
  flip with ``fake_cuinit()``, so the rules are tested on CPU.
- NVML (``nvidia-ml-py``) counts and describes GPUs without a CUDA context; ``cuda_safe_imports``
  answers torch's device queries from it while modules are imported, through delegators that
  call torch's own functions once the block is over (a module may have kept one).
- ``fork_refusal``: the one "may this process fork a step?" check.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import sys
import threading
import traceback
from typing import Callable, Iterator, Mapping, Optional

from .settings import Settings

__all__ = ["DriverProbe", "FakeDriverProbe", "probe_for", "fake_cuinit", "torch_cuda_initialized",
           "fork_refusal", "nvml_device_count", "visible_count", "cuda_safe_imports",
           "retain_primary_context", "warm_context", "PRELOAD_ENV"]

CUDA_ERROR_NOT_INITIALIZED = 3
# Environment the preload itself sets; never part of a step's import-relevant environment.
PRELOAD_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
# torch.cuda's device queries answered from NVML while importing (``cuda_safe_imports``).
NVML_ANSWERED = ("get_device_capability", "get_device_name", "get_device_properties",
                 "current_device", "device_count", "is_available")


class DriverProbe:
    """Reports whether the CUDA driver of this process has been initialised."""

    name = "libcuda"

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            self._lib = None

    def initialized(self) -> bool:
        if self._lib is None:
            return False
        count = ctypes.c_int(0)
        return self._lib.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


_fake_driver_initialized = False


def fake_cuinit() -> None:
    """What a test's fake culprit module calls to 'initialise the driver' in this process."""
    global _fake_driver_initialized
    _fake_driver_initialized = True


class FakeDriverProbe(DriverProbe):
    """In-process stand-in for the driver, flipped by ``fake_cuinit``."""

    name = "fake"

    def __init__(self) -> None:  # no library
        self._lib = None

    def initialized(self) -> bool:
        return _fake_driver_initialized


def probe_for(settings: Settings) -> DriverProbe:
    return FakeDriverProbe() if settings.probe == "fake" else DriverProbe()


def torch_cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def fork_refusal(probe: DriverProbe) -> str:
    """Why this process may not fork a step right now ('' when it may): a child of a process
    with an initialised driver dies in its first CUDA call, and fork copies one thread only."""
    if probe.initialized():
        return "zygote CUDA driver is initialised"
    if torch_cuda_initialized():
        return "zygote torch.cuda is initialised"
    if threading.active_count() != 1:
        return f"zygote has {threading.active_count()} Python threads"
    return ""


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


# ---------------------------------------------------------------- NVML

def visible_count(count: int, environ: Mapping[str, str] = os.environ) -> int:
    """Of ``count`` physical GPUs, how many ``CUDA_VISIBLE_DEVICES`` leaves visible."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return count
    return min(count, len([v for v in visible.split(",") if v.strip()]))


@contextlib.contextmanager
def _nvml() -> Iterator:
    """``pynvml`` initialised for this block, in the process asking, and its reference count
    left as found. NVML's init is counted per process: a reference the launcher kept would let
    a preloaded module's or a step's query succeed where a fresh interpreter's raises
    Uninitialized, and a module's extra shutdown would take it away; a process forked while
    preloading cannot trust the parent's."""
    import pynvml  # provided by nvidia-ml-py
    pynvml.nvmlInit()
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _nvml_physical_count():
    """(pynvml, physical GPU count), or (None, 0) without NVML."""
    try:
        with _nvml() as pynvml:
            return pynvml, pynvml.nvmlDeviceGetCount()
    except Exception:
        return None, 0


def nvml_device_count(environ: Mapping[str, str] = os.environ) -> int:
    """Visible GPUs counted through NVML, never through CUDA (0 without NVML or GPUs)."""
    return visible_count(_nvml_physical_count()[1], environ)


class _Properties:
    """While preloading, the fields NVML can answer. Once the preload is over, an object a
    preloaded module kept from its import answers every field from torch's own object, those
    NVML gave too (CUDA's total memory is not NVML's), as if torch had made it then."""

    def __init__(self, device, nvml: dict, torchs: Callable):
        self._device, self._nvml, self._torchs = device, nvml, torchs

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(f"'_Properties' object has no attribute {name!r}")
        if _answers is None:  # the preload is over: CUDA may answer
            return getattr(self._torchs(self._device), name)
        try:
            return self._nvml[name]
        except KeyError:
            raise AttributeError(f"'_Properties' object has no attribute {name!r}") from None

    def __repr__(self):
        if _answers is None:
            return repr(self._torchs(self._device))
        return f"_Properties({', '.join(f'{k}={v!r}' for k, v in self._nvml.items())})"


def _nvml_device_answers(real: Mapping[str, Callable]):
    """Replacement ``torch.cuda`` query functions backed by NVML, or None without NVML.
    ``real``: torch's own functions, which a properties object asks for what NVML cannot say
    once the preload is over."""
    pynvml, count = _nvml_physical_count()
    if not count:
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

    def handle(device=None):  # inside a ``_nvml()`` block only
        return pynvml.nvmlDeviceGetHandleByIndex(physical(device))

    def get_device_capability(device=None):
        with _nvml():
            return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle(device)))

    def get_device_name(device=None):
        with _nvml():
            name = pynvml.nvmlDeviceGetName(handle(device))
        return name.decode() if isinstance(name, bytes) else name

    def get_device_properties(device=None):
        with _nvml():
            nvml = {"name": get_device_name(device),
                    "total_memory": pynvml.nvmlDeviceGetMemoryInfo(handle(device)).total}
            nvml["major"], nvml["minor"] = get_device_capability(device)
        return _Properties(device, nvml, real["get_device_properties"])

    def device_count():
        return visible_count(count)

    return {
        "get_device_capability": get_device_capability,
        "get_device_name": get_device_name,
        "get_device_properties": get_device_properties,
        "current_device": lambda: 0,
        "device_count": device_count,
        "is_available": lambda: device_count() > 0,
    }


# While a ``cuda_safe_imports`` block runs in this process: the NVML answers (else None).
_answers: Optional[dict[str, Callable]] = None
_depth = 0
_delegators: dict[str, Callable] = {}  # by name: the one delegator made for torch's function


def _delegator(name: str, real: Callable) -> Callable:
    """What ``torch.cuda.<name>`` is while importing: NVML's answer inside a
    ``cuda_safe_imports`` block, torch's own ``real`` outside it. A module may keep the function
    it found at import (torch's device interface binds it at class definition); what it kept
    must behave as torch's own once the preload is over, in every forked step."""
    made = _delegators.get(name)
    if made is not None and made.__wrapped__ is real:
        return made

    @functools.wraps(real)
    def delegator(*args, **kwargs):
        answers = _answers
        if answers is not None:
            return answers[name](*args, **kwargs)
        return real(*args, **kwargs)

    _delegators[name] = delegator
    return delegator


@contextlib.contextmanager
def cuda_safe_imports() -> Iterator[bool]:
    """Set the NVML-based CUDA check and answer device queries from NVML until the outermost
    block ends; then torch's own functions are back in ``torch.cuda`` and every reference to
    the NVML-answering ones taken meanwhile calls them.

    Yields whether NVML answers were installed (False on machines without NVML).
    """
    global _answers, _depth
    saved_env = {k: os.environ.get(k) for k in PRELOAD_ENV}
    os.environ.update(PRELOAD_ENV)
    installed: dict[str, tuple[Callable, Callable]] = {}  # name: (torch's, its delegator)
    _depth += 1
    try:
        # NVML first: without GPUs there is nothing to answer, and torch is not imported for it
        # (a zygote whose entries never import torch must not hold it).
        if _depth == 1 and _nvml_physical_count()[1] and (
                "torch" in sys.modules or importlib.util.find_spec("torch")):
            import torch.cuda
            real = {name: getattr(torch.cuda, name) for name in NVML_ANSWERED}
            _answers = _nvml_device_answers(real)
            if _answers:
                for name, fn in real.items():
                    installed[name] = (fn, _delegator(name, fn))
                    setattr(torch.cuda, name, installed[name][1])
        yield _answers is not None
    finally:
        _depth -= 1
        if _depth == 0:
            _answers = None
        if installed:
            import torch.cuda
            for name, (fn, delegator) in installed.items():
                if getattr(torch.cuda, name) is delegator:  # not replaced by a module meanwhile
                    setattr(torch.cuda, name, fn)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ---------------------------------------------------------------- contexts made ahead

def warm_context(device: int, level: str) -> None:
    """Make the CUDA context of ``device`` now, in a pre-warmed child, before a step needs it.

    ``level`` (``PRELOAD_LAUNCHER_PREWARM_CUDA``): ``context`` makes only the driver's primary
    context, which torch adopts at first use, so ``torch.cuda`` and its allocator read as in a
    fresh process; ``kernels`` also pays the per-process first uses through torch (see
    ``warm_first_use``; ``torch.cuda.is_initialized()`` then reads True at the step's start);
    ``0`` makes nothing (the warm child still saves the fork)."""
    torch = sys.modules.get("torch")
    if torch is None or level == "0" or nvml_device_count() <= device:
        return  # no torch, nothing asked, no NVML or no such GPU
    try:
        if level == "kernels":
            torch.cuda.set_device(device)
            warm_first_use(torch, device)
        else:
            retain_primary_context(device)
    except Exception:
        traceback.print_exc()


def warm_first_use(torch, device: int) -> None:
    """The first uses a step would otherwise pay on its critical path: cuBLAS/cuBLASLt handles
    and the lazily loaded kernels of a small transformer-like forward, backward and Adam step
    (fp32 and bf16). Nothing random is drawn; afterwards the allocator is emptied and its
    statistics reset, so memory counters read as in a fresh process."""
    import torch.nn.functional as F
    with torch.cuda.device(device):
        for dtype in (torch.float32, torch.bfloat16):
            weight = torch.ones(256, 256, device=device, dtype=dtype, requires_grad=True)
            table = torch.ones(64, 256, device=device, dtype=dtype, requires_grad=True)
            tokens = torch.arange(32, device=device) % 64
            x = F.embedding(tokens, table)
            x = F.layer_norm(x, (256,))
            x = F.gelu(x @ weight)
            x = torch.softmax(x.float(), dim=-1).to(dtype) @ weight.t()
            loss = F.cross_entropy(x.float()[:, :64], tokens)
            loss.backward()
            optimizer = torch.optim.Adam([weight, table], lr=1e-3)
            optimizer.step()
            del weight, table, tokens, x, loss, optimizer
        torch.cuda.synchronize(device)
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
