"""A stand-in for nvidia-ml-py on a machine without GPUs: NVML reports one H200, so the
zygote answers torch's device queries from "NVML" while preloading, as on a GPU machine.
torch itself never imports ``pynvml`` to decide anything here (its CPU build has no CUDA).

Like NVML, initialisation is reference-counted per process: ``nvmlInit`` counts up,
``nvmlShutdown`` down, and a query or a shutdown with the count at 0 raises
``NVMLError_Uninitialized``. A forked child inherits the count, as it inherits the library's
memory; with ``FAKE_NVML_PER_PROCESS=1`` it starts at 0 instead, modelling an NVML whose
state from the parent is not valid in a forked child (which real NVML does not promise)."""

import os

NVML_ERROR_UNINITIALIZED = 1


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return {NVML_ERROR_UNINITIALIZED: "Uninitialized", 2: "Invalid Argument"}.get(
            self.value, "Unknown Error")


class NVMLError_Uninitialized(NVMLError):  # noqa: N801 (nvidia-ml-py's name)
    def __init__(self, value=NVML_ERROR_UNINITIALIZED):
        super().__init__(value)


_references = 0


def _forked():
    global _references
    _references = 0


if os.environ.get("FAKE_NVML_PER_PROCESS") == "1":
    os.register_at_fork(after_in_child=_forked)


def _initialised():
    if _references == 0:
        raise NVMLError_Uninitialized()


class _Memory:
    total = 150_754_820_096


def nvmlInit():
    global _references
    _references += 1


def nvmlShutdown():
    global _references
    _initialised()
    _references -= 1


def nvmlDeviceGetCount():
    _initialised()
    return 1


def nvmlDeviceGetHandleByIndex(index):
    _initialised()
    if index != 0:
        raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
    return index


def nvmlDeviceGetCudaComputeCapability(handle):
    _initialised()
    return (9, 0)


def nvmlDeviceGetName(handle):
    _initialised()
    return "NVIDIA H200"


def nvmlDeviceGetMemoryInfo(handle):
    _initialised()
    return _Memory()
