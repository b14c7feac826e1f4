"""A stand-in for nvidia-ml-py on a machine without GPUs: NVML reports one H200, so the
zygote answers torch's device queries from "NVML" while preloading, as on a GPU machine.
torch itself never imports ``pynvml`` to decide anything here (its CPU build has no CUDA)."""


class _Memory:
    total = 150_754_820_096


def nvmlInit():
    pass


def nvmlDeviceGetCount():
    return 1


def nvmlDeviceGetHandleByIndex(index):
    if index != 0:
        raise RuntimeError(f"no GPU {index}")
    return index


def nvmlDeviceGetCudaComputeCapability(handle):
    return (9, 0)


def nvmlDeviceGetName(handle):
    return "NVIDIA H200"


def nvmlDeviceGetMemoryInfo(handle):
    return _Memory()
