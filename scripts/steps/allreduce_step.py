"""A CUDA tensor and an NCCL all-reduce on every rank (gloo on CPU)."""
import os

import torch
import torch.distributed as dist

cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if cuda else "gloo")
t = torch.ones(1 << 20, device="cuda" if cuda else "cpu")
dist.all_reduce(t)
assert int(t[0].item()) == dist.get_world_size()
print(f"rank {dist.get_rank()} all-reduce ok ({'nccl' if cuda else 'gloo'})", flush=True)
dist.destroy_process_group()
