"""A preloaded module that uses NVML itself at import, balanced (init, then shutdown), and
then asks torch for the GPU's capability, as modelopt's kernels do, and shuts NVML down once
more (plainly that raises: nothing initialised it). Each process that imports
it (the zygote, a scout forked while preloading, a fresh interpreter) appends what it was
answered to ``USES_NVML_LOG``."""
import json
import os

import pynvml
import torch

pynvml.nvmlInit()
pynvml.nvmlShutdown()
try:
    CAPABILITY = repr(torch.cuda.get_device_capability())
except BaseException as err:  # what this process was answered, exception included
    CAPABILITY = repr(err)
try:
    pynvml.nvmlShutdown()
    EXTRA_SHUTDOWN = "returned"
except BaseException as err:
    EXTRA_SHUTDOWN = repr(err)

if os.environ.get("USES_NVML_LOG"):
    with open(os.environ["USES_NVML_LOG"], "a") as log:
        log.write(json.dumps({"pid": os.getpid(), "capability": CAPABILITY,
                              "extra_shutdown": EXTRA_SHUTDOWN}) + "\n")
