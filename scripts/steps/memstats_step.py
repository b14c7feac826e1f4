"""What a step can observe of CUDA memory and state at its start and after a first matmul.

A pre-warmed child must read as a fresh process here (scripts/gpu_extra.py --only memstats).
"""
import json

import torch


def observe() -> dict:
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "max_allocated": torch.cuda.max_memory_allocated(),
            "nonzero_stats": {k: v for k, v in torch.cuda.memory_stats().items() if v}}


start = {"torch.cuda.is_initialized": torch.cuda.is_initialized(), **observe()}
x = torch.ones(1024, 1024, device="cuda")
y = x @ x
torch.cuda.synchronize()
after = observe()
del x, y
print("MEMSTATS " + json.dumps({"start": start, "after_first_matmul": after}, sort_keys=True))
