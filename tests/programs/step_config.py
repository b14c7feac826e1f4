"""The configuration a step runs with, as one JSON line on stdout (one write: ranks share it).

Run plainly and through the launcher with a zygote that preloads ``torch`` and
``captures_cuda``: the device queries ``captures_cuda`` kept from its import, the local time
zone, torch.distributed's debug level, torch's C++ stack traces, and the thread pools of the
native libraries loaded (OpenMP, OpenBLAS) and torch's, none of which a preloaded import may
leave as the zygote had them."""
from zygote_fork import maps

preloaded = maps("libtorch")  # forked from the zygote that preloads torch and captures_cuda

import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import threadpoolctl  # noqa: E402
import torch  # noqa: E402
import torch.distributed  # noqa: E402

import captures_cuda  # noqa: E402

NO_ARGUMENT = {"current_device", "device_count", "is_available"}
PROPERTY_FIELDS = ("name", "major", "minor", "total_memory", "multi_processor_count")


def answer(fn, *args):
    try:
        return repr(fn(*args))
    except BaseException as err:  # what torch says on this machine, exception included
        return [type(err).__name__, str(err)]


def cpp_stack_trace_shown() -> bool:
    try:
        torch.ones(2, 3) @ torch.ones(2, 3)
    except RuntimeError as err:
        return "Exception raised from" in str(err)
    return False


seen = {
    "preloaded": preloaded,
    "rank": os.environ.get("RANK"),
    "captured": {name: answer(fn, *(() if name in NO_ARGUMENT else (0,)))
                 for name, fn in captures_cuda.CAPTURED.items()},
    # A properties object kept from the import answers every field as torch's own does now.
    "kept_properties_agree": captures_cuda.PROPERTIES is None or all(
        answer(lambda k=k: getattr(captures_cuda.PROPERTIES, k))
        == answer(lambda k=k: getattr(torch.cuda.get_device_properties(0), k))
        for k in PROPERTY_FIELDS),
    "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
    "tzname": list(time.tzname),
    "timezone": [time.timezone, time.altzone, time.daylight],
    "localtime_zone": time.localtime(0).tm_zone,
    "strftime": time.strftime("%Z %z", time.localtime(86400 * 180)),
    "datetime_offset": str(datetime.datetime.fromtimestamp(0).astimezone().utcoffset()),
    "distributed_debug": str(torch.distributed.get_debug_level()),
    "cpp_stack_traces": cpp_stack_trace_shown(),
    "torch_threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
    "pools": sorted([info["internal_api"], info["num_threads"]]
                    for info in threadpoolctl.threadpool_info()),
}
os.write(1, (json.dumps(seen, sort_keys=True) + "\n").encode())
