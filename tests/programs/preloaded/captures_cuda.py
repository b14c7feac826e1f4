"""A preloaded module that keeps torch's device queries from its import, as torch's own device
interface does (``torch._dynamo.device_interface`` binds them at class definition): while the
zygote preloads it, they are the launcher's NVML answers."""
import torch
from torch.cuda import (current_device, device_count, get_device_capability,  # noqa: F401
                        get_device_name, get_device_properties, is_available)


try:  # an object obtained while importing: the launcher's NVML answer while preloading
    PROPERTIES = torch.cuda.get_device_properties(0)
except (AssertionError, RuntimeError):  # no CUDA here: a fresh interpreter keeps nothing
    PROPERTIES = None


class Interface:
    properties = staticmethod(torch.cuda.get_device_properties)


CAPTURED = {"get_device_capability": get_device_capability, "get_device_name": get_device_name,
            "get_device_properties": get_device_properties, "current_device": current_device,
            "device_count": device_count, "is_available": is_available,
            "Interface.properties": Interface.properties}
