"""What NVML answers a step that asks it without initialising it, as one JSON line (one write:
ranks share stdout): a fresh interpreter's NVML has no reference, so the query raises
Uninitialized, however the modules it imported used NVML."""
import json
import os

import pynvml

import uses_nvml  # noqa: F401 (preloaded in the zygote, imported afresh plainly)

try:
    count = repr(pynvml.nvmlDeviceGetCount())
except BaseException as err:
    count = repr(err)
try:
    pynvml.nvmlShutdown()
    extra_shutdown = "returned"
except BaseException as err:
    extra_shutdown = repr(err)
os.write(1, (json.dumps({"rank": os.environ.get("RANK"), "count": count,
                         "extra_shutdown": extra_shutdown}) + "\n").encode())
