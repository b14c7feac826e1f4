"""What torchrun makes of a step's arguments, by torchrun's own parser and ``config_from_args``
(the agent never re-implements them): the launch config, ``nproc_per_node`` counted without a
CUDA context, and why torchrun itself must run a launch the agent does not serve.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid
from typing import Iterator, Optional

from .. import cuda
from ..command import StepSpec
from . import rendezvous, torch_agent

__all__ = ["resolve_nproc", "unsupported_reason", "parse_torchrun_args", "configure_launch"]



def resolve_nproc(value: str) -> Optional[str]:
    """``gpu``/``auto`` counted through NVML, never through a CUDA context; None if unknowable."""
    if value not in ("gpu", "auto"):
        return value
    count = cuda.nvml_device_count()
    if count > 0:
        return str(count)
    return str(os.cpu_count() or 1) if value == "auto" else None


def unsupported_reason(args, config) -> str:
    """Why torchrun itself must run this launch ('' when the agent serves it)."""
    if config.rdzv_backend not in ("static", "c10d"):
        return f"rendezvous backend {config.rdzv_backend}"
    if args.run_path and torch_agent.needs_torch_agent(args, config, rendezvous.LOCAL_HOSTS):
        return "--run-path of a multi-node launch"
    if args.no_python:
        return "--no-python"
    if getattr(args, "local_addr", None):
        return "--local-addr"
    if config.nproc_per_node < 1:
        return f"nproc_per_node={config.nproc_per_node}"
    return ""


def parse_torchrun_args(spec: StepSpec):
    """torchrun's own parsing of the step's arguments (raises SystemExit on a usage error)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.utils.logging import get_logger
    # argparse names itself after argv[0]: "torchrun", or "run.py" under python -m.
    program = spec.args[0] if os.path.basename(spec.args[0]) == "torchrun" else torchrun.__file__
    sys.argv = [program, *spec.torchrun_args]
    if program == torchrun.__file__:  # run as __main__, its logger is "__main__": no torch prefix
        torchrun.logger = get_logger("__main__")
    return torchrun.parse_args(spec.torchrun_args)


def configure_launch(args):
    """What torchrun's ``run()`` makes of its arguments: (args, config, cmd, cmd_args)."""
    from torch.distributed import run as torchrun
    # The rendezvous defaults of torchrun's ``run()``, which config_from_args does not apply.
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint
                           and args.master_port is None
                           and torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    nproc = resolve_nproc(str(args.nproc_per_node))
    if nproc is None:
        return args, None, None, None
    args.nproc_per_node = nproc
    # LaunchConfig asks torch.cuda.is_available(); through cudaGetDeviceCount that poisons every
    # later fork, so the agent asks NVML instead, as the zygote's preload does.
    with cuda.cuda_safe_imports(), _held(torchrun.logger) as notices:
        config, cmd, cmd_args = torchrun.config_from_args(args)
    # What it logged (the OMP_NUM_THREADS notice) is said once: here, or by the torchrun that
    # runs a launch the agent does not serve.
    if not unsupported_reason(args, config):
        for record in notices:
            torchrun.logger.handle(record)
    return args, config, cmd, cmd_args


class _Holder(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


@contextlib.contextmanager
def _held(logger: logging.Logger) -> Iterator[list]:
    """The records ``logger`` logs inside, held back instead of handled."""
    holder = _Holder()
    logger.addFilter(holder)
    try:
        yield holder.records
    finally:
        logger.removeFilter(holder)
