"""Shaped like the Megatron/ModelOpt examples: get_args(), main(args), os._exit(1) on failure."""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=-1)
    return parser.parse_args()


@record
def main(args):
    rank = dist.get_rank()
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == args.fail_rank:
        raise RuntimeError(f"rank {rank} failed on purpose")
    if rank == args.hang_rank:
        time.sleep(600)
    print(f"rank {rank} done sum={t.tolist()}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    args = get_args()
    try:
        main(args)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
