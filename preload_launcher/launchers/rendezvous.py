"""Where a single-node torchrun launch's ranks meet, and what each rank is given: the store's
address and port as torchrun's rendezvous picks them, torchrun's per-worker environment, and
its argument macros. torch elastic's own helpers do the work where it has them.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

__all__ = ["LOCAL_HOSTS", "store_endpoint", "rank_envs", "rank_args"]

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "", socket.gethostname()}


def store_endpoint(config) -> tuple[str, int]:
    """(address the ranks are given, port the agent hosts the store on; 0 = a free one).

    ``static``: the endpoint torchrun's arguments name (``--master-addr:--master-port`` or
    ``--rdzv-endpoint``), as given. ``c10d`` on this node (``--standalone`` and the single-node
    default among them): the node's fully qualified name and a free port, as the rendezvous'
    ``RendezvousStoreInfo`` picks them (whatever port the rendezvous endpoint names).
    ``MASTER_PORT`` in the launch's environment is never read: torchrun does not read it."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    if config.rdzv_backend == "static":
        return parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    return (config.local_addr or socket.getfqdn()), 0


def rank_envs(config, master_addr: str, master_port: int, error_files: dict[int, str],
              base_env: dict[str, str]) -> list[dict[str, str]]:
    """torchrun's per-worker environment (``LocalElasticAgent._start_workers`` and the
    ``TORCHELASTIC_*`` variables its launcher and process context add), one node."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    n = config.nproc_per_node
    spec = SimpleNamespace(virtual_local_rank=getattr(config, "virtual_local_rank", False))
    envs = []
    for rank in range(n):
        env = dict(base_env)
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle  # launch_agent sets it
        worker = {
            "RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_NAME": config.role,
            "LOCAL_WORLD_SIZE": str(n),
            "WORLD_SIZE": str(n),
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(n),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
            "TORCHELASTIC_RUN_ID": config.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": error_files.get(rank, ""),
        }
        # LOCAL_RANK and CUDA_VISIBLE_DEVICES (--virtual-local-rank): torch's own rule. It
        # reads CUDA_VISIBLE_DEVICES from os.environ, the launch's environment here too.
        LocalElasticAgent._set_local_rank_env(None, worker, rank, spec)  # type: ignore[arg-type]
        env.update(worker)
        envs.append(env)
    return envs


def rank_args(args: list[str], local_rank: int) -> list[str]:
    """The program's arguments for one rank: torchrun's ``${local_rank}`` macro substituted."""
    from torch.distributed.elastic.utils import macros
    return macros.substitute(list(args), str(local_rank))
