"""Two gloo ranks call all_reduce on tensors of different sizes: under
TORCH_DISTRIBUTED_DEBUG=DETAIL torch checks each collective across ranks first and both ranks
raise "Detected mismatch between collectives". Each rank writes one line."""
import datetime
import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
try:
    tensor = torch.ones(2 + rank)
    dist.all_reduce(tensor)
    seen = f"sum {tensor.tolist()}"
except RuntimeError as err:
    seen = "mismatch detected" if "Detected mismatch between collectives" in str(err) \
        else f"{type(err).__name__}"
os.write(1, f"rank {rank}: level {dist.get_debug_level()}: {seen}\n".encode())
dist.destroy_process_group()
