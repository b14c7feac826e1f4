"""A rank that reports torchrun's contract and proves the gloo rendezvous works."""
import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
world = dist.get_world_size()
assert t.item() == world * (world + 1) / 2, t
contract = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
            "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_")
env = {k: v for k, v in os.environ.items() if k.startswith(contract) or k in ("OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
# What ps, pgrep -f and psutil read from outside (the kernel's view, not Python's)
with open("/proc/self/cmdline", "rb") as f:
    cmdline = os.fsdecode(f.read()).split("\0")
with open("/proc/self/environ", "rb") as f:
    environ = dict(kv.split("=", 1) for kv in os.fsdecode(f.read()).split("\0") if "=" in kv)
with open("/proc/self/comm") as f:
    comm = f.read().strip()
print("RANKINFO " + json.dumps({"rank": dist.get_rank(), "env": env, "argv": sys.argv[1:],
                                "cmdline": cmdline, "environ": environ, "comm": comm}), flush=True)
dist.destroy_process_group()
code = int(os.environ.get("EXIT_CODE_RANK_%d" % int(os.environ["RANK"]), "0"))
if code:
    sys.exit(code)
