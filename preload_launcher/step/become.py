"""Stage 4: a forked process becomes its step: a python program, a torchrun agent, an
``accelerate launch``, or an interpreter a step's ``multiprocessing`` spawned. Started cold (forked for the request) or
warm (forked ahead, see ``prewarm``); the same function serves both.
"""

from __future__ import annotations

import fcntl
import os
from typing import Optional

from .. import interpreter, protocol
from ..command import StepSpec, Unsupported, parse_python_argv
from ..process_attrs import Unforkable
from ..launchers import accelerate_launch, agent
from . import child, native_env, runtime

__all__ = ["become_step"]


def become_step(spec_data: dict, fds: list[int], conn_fd: int, state: runtime.ZygoteState,
                warm_ranks: Optional[dict] = None) -> int:
    """Set up, announce, run; returns the exit code for ``runtime.exit_with``."""
    spec = StepSpec.from_json_dict(spec_data)
    # Above every fd number the program gets, so installing those cannot replace it.
    floor = max([runtime.REPORT_FD_MIN, *(spec.fd_targets or [])]) + 1
    conn_fd, old_conn_fd = fcntl.fcntl(conn_fd, fcntl.F_DUPFD_CLOEXEC, floor), conn_fd
    os.close(old_conn_fd)
    try:
        startup_locale = runtime.set_up(spec, state, fds)
    except Unforkable as why:  # the caller's own child has what this process cannot take on
        protocol.send_event(conn_fd, "fallback", retire=False, reason=str(why))
        return 0
    except OSError as err:
        protocol.send_event(conn_fd, "error", type=type(err).__name__, errno=err.errno,
                            strerror=err.strerror, filename=err.filename)
        return 255
    differs = interpreter.startup_mismatch(os.environ, startup_locale)
    if differs:  # fixed at this interpreter's start-up: only a new interpreter has them
        protocol.send_event(conn_fd, "fallback", retire=False,
                            reason=f"its environment asks for start-up settings the zygote lacks: "
                                   f"{', '.join(differs)}")
        return 0
    if native_env.refusal():
        protocol.send_event(conn_fd, "fallback", retire=False, reason=native_env.refusal())
        return 0
    if spec.torchrun_args is not None:
        return agent.run_agent(spec, state, conn_fd, warm_ranks)
    if spec.accelerate_args is not None:
        return accelerate_launch.run_accelerate(spec, state, conn_fd)
    target = spec.target or parse_python_argv(spec.args)  # a spawned interpreter's command line
    if isinstance(target, Unsupported):
        protocol.send_event(conn_fd, "fallback", reason=target.reason, retire=False)
        return 0
    return child.run_python_step(target, state, conn_fd)
