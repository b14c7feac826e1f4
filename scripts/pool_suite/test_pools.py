"""Each module of a GPU suite starting a fresh pool (three here, one per test)."""
import os
import socket

import pytest

from pool_worker import Pool


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("module", ["a", "b", "c"])
def test_fresh_pool(module):
    world = int(os.environ.get("POOL_SUITE_RANKS", "2"))
    pool = Pool(world, free_port())
    assert pool.all_reduce(1) == [float(world)] * world
    assert pool.close() == [0] * world
    with open(os.environ["POOL_SUITE_OUT"], "a") as f:
        f.write(f"{module} {pool.start_s:.3f}\n")
