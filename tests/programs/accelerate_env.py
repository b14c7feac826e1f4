"""A program under `accelerate launch`: reports the environment accelerate gave it."""
import json
import os
import sys

import torch

native_threads = len(os.listdir("/proc/self/task"))  # before gloo starts its own

if "WORLD_SIZE" in os.environ:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
keys = ("ACCELERATE_", "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "MASTER_", "TORCHELASTIC_", "OMP_NUM_THREADS", "KMP_", "NCCL_",
        "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_")
env = {k: v for k, v in os.environ.items() if k.startswith(keys)}
with open("/proc/self/cmdline", "rb") as f:  # what ps shows of this program
    cmdline = f.read().decode().split("\0")[:-1]
with open("/proc/self/comm") as f:
    comm = f.read().strip()
info = {"rank": int(os.environ.get("RANK", 0)), "env": env, "argv": sys.argv[1:],
        "threads": [torch.get_num_threads(), torch.get_num_interop_threads(), native_threads],
        "cmdline": cmdline, "comm": comm}
print("RANKINFO " + json.dumps(info), flush=True)
if "WORLD_SIZE" in os.environ:
    dist.destroy_process_group()
sys.exit(int(os.environ.get("EXIT_CODE_RANK_%s" % os.environ.get("RANK", "0"), "0")))
