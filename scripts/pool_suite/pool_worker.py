"""A worker pool shaped like a GPU suite's (N spawned ranks, one process group, kept for a
module's tests): what each rank imports is the suite's chain (conftest's list)."""
import importlib
import multiprocessing
import os
import time

for name in os.environ.get("POOL_SUITE_IMPORTS", "torch").split(","):
    if name:
        importlib.import_module(name)

import torch
import torch.distributed as dist


def worker_loop(rank, world_size, port, commands, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if torch.cuda.is_available():  # a rank's CUDA context, as on a GPU machine
        torch.ones(1, device="cuda").sum().item()
    results.put("ready")
    for command in iter(commands.get, None):
        tensor = torch.tensor([float(command)])
        dist.all_reduce(tensor)
        results.put(tensor.item())
    dist.destroy_process_group()


class Pool:
    def __init__(self, world_size, port):
        start = time.perf_counter()
        ctx = multiprocessing.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=worker_loop, args=(r, world_size, port,
                                                            self.commands[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        for _ in range(world_size):
            assert self.results.get(timeout=600) == "ready"
        self.start_s = time.perf_counter() - start

    def all_reduce(self, value):
        for q in self.commands:
            q.put(value)
        return [self.results.get(timeout=120) for _ in self.commands]

    def close(self):
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=120)
        return [p.exitcode for p in self.procs]
