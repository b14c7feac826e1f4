"""A module that poisons its worker pool (copied into Model-Optimizer's tests/gpu_megatron/torch/
as test_pool_poison.py by ``scripts/gpu/modelopt_lane.py --poison``; not a test of this project).

The first test destroys the pool's process group inside every rank, as a test that ends its own
group by mistake would; the second, in the same module and so on the same pool, must then fail
(strict xfail: it proves the poison is real). The modules after this one get pools of their own
and must pass as they do without it: a poisoned pool stays inside its module.
"""

import pytest
import torch.distributed as dist


def _destroy_group(rank, world_size):
    dist.destroy_process_group()


def _needs_group(rank, world_size):
    assert dist.is_initialized(), "the pool's process group was destroyed by an earlier test"


def test_poison_the_pool(dist_workers):
    dist_workers.run(_destroy_group)


@pytest.mark.xfail(strict=True, reason="the same module's pool was poisoned by the test before")
def test_same_module_sees_the_poison(dist_workers):
    dist_workers.run(_needs_group)
