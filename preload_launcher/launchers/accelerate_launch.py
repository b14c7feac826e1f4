"""Stage 4c: ``accelerate launch`` on one machine, served from the zygote.

Accelerate's own code decides everything it decides for a real launch: its parser, its
validation (config file, defaults, the warning about values it chose), the environment it gives
the program. Only the processes are forked instead of started:

* one process: accelerate's ``simple_launcher`` runs as is, and so do its waiting, its teeing
  of the program's stderr, its handling of signals and failures, whichever accelerate this is;
  only its ``Popen`` of the program forks a child of this process (``forked_popen``) instead
  of executing a new interpreter;
* several (``multi_gpu_launcher``): accelerate hands the launch to torchrun's ``run()``; here
  that call is served by the agent (forked sibling ranks, torchrun's environment contract).

Everything else (DeepSpeed, FSDP, Megatron-LM, TPU, SageMaker, MPI, several machines,
``--no_python``) runs the real ``accelerate``.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
import traceback

from .. import cuda, protocol
from ..command import PythonTarget, StepSpec, Unsupported, launcher_interpreter, parse_python_argv
from ..settings import Settings
from ..step import child, proc_view, runtime
from ..zygote import learn, threads
from . import agent, forked_popen

__all__ = ["run_accelerate", "unsupported_reason"]

NOT_MODELLED = (("use_deepspeed", "DeepSpeed"), ("use_fsdp", "FSDP"),
                ("use_megatron_lm", "Megatron-LM"), ("tpu", "TPU"), ("tpu_use_cluster", "TPU pods"),
                ("no_python", "--no_python"), ("mpirun_hostfile", "MPI"))


def unsupported_reason(args, defaults) -> str:
    """Why the real ``accelerate`` must run this launch ('' when it is served here)."""
    from accelerate.utils import ComputeEnvironment
    for attr, what in NOT_MODELLED:
        if getattr(args, attr, None):
            return f"accelerate launch with {what}"
    if (args.num_machines or 1) > 1:
        return f"accelerate launch on {args.num_machines} machines"
    if defaults is not None and defaults.compute_environment != ComputeEnvironment.LOCAL_MACHINE:
        return f"accelerate launch in {defaults.compute_environment}"
    if cuda.fork_refusal(cuda.probe_for(Settings.from_env())):
        return "accelerate's checks initialised CUDA; the program cannot be forked from it"
    return ""


def _parse(spec: StepSpec):
    """accelerate's parser and validation; returns (args, defaults) or raises SystemExit."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    parser = launch_command_parser()
    if os.path.basename(spec.args[0]) == "accelerate":  # a subcommand of accelerate's CLI
        # The real program imports every subcommand first; what those imports do to the
        # environment (transformers -> sklearn sets KMP_* variables) reaches the program.
        importlib.import_module("accelerate.commands.accelerate_cli")
        parser.prog = "accelerate <command> [<args>] launch"
    sys.argv = [spec.args[0], *spec.accelerate_args]
    args = parser.parse_args(spec.accelerate_args)
    # Validation asks torch how many GPUs there are: NVML answers, the driver stays untouched.
    with cuda.cuda_safe_imports():
        args, defaults, _ = _validate_launch_command(args)
    return args, defaults


def run_accelerate(spec: StepSpec, state: runtime.ZygoteState, conn_fd: int) -> int:
    """Serve one ``accelerate launch``; returns the exit code for ``runtime.exit_with``. What
    accelerate imported here is reported for learning, as a python step's imports are (after
    the exit report: off the caller's path)."""
    before = set(sys.modules)
    # accelerate starts its programs with its own interpreter's sys.executable.
    sys.executable = launcher_interpreter(spec.args, spec.env, spec.cwd)
    try:
        return _serve(spec, state, conn_fd)
    finally:
        learn.report_step_imports(before, state.learn_reports_dir, state.project, state.base_path)


def _serve(spec: StepSpec, state: runtime.ZygoteState, conn_fd: int) -> int:
    try:
        args, defaults = _parse(spec)
    except ImportError as exc:
        protocol.send_event(conn_fd, "fallback", reason=f"accelerate: {exc}", retire=False)
        return 0
    except SystemExit as exc:  # argparse printed accelerate's usage error
        protocol.send_event(conn_fd, "exec", t=time.time())
        return exc.code if isinstance(exc.code, int) else 1
    except Exception:  # accelerate's own validation errors, reported as accelerate reports them
        protocol.send_event(conn_fd, "exec", t=time.time())
        traceback.print_exc()
        return 1
    reason = unsupported_reason(args, defaults)
    if reason:
        protocol.send_event(conn_fd, "fallback", reason=reason, retire=False)
        return 0
    if args.multi_gpu and not args.cpu:
        return _several_processes(spec, state, conn_fd, args)
    return _one_process(spec, state, conn_fd, args)


def _one_process(spec: StepSpec, state: runtime.ZygoteState, conn_fd: int, args) -> int:
    """accelerate's own ``simple_launcher``: only the start of its program differs, forked
    from this process (``forked_popen``) where accelerate executes a new interpreter."""
    from accelerate.commands.launch import simple_launcher
    from accelerate.utils import prepare_simple_launcher_cmd_env
    try:
        cmd, _ = prepare_simple_launcher_cmd_env(args)  # what simple_launcher will start
    except Exception:
        cmd = []  # simple_launcher raises it again, and reports it as accelerate does
    target = parse_python_argv(cmd) if cmd else None
    if isinstance(target, Unsupported):
        protocol.send_event(conn_fd, "fallback", reason=target.reason, retire=False)
        return 0
    if target is not None:
        target.executable = cmd[0]
    protocol.send_event(conn_fd, "exec", t=time.time())
    runtime.keep_for_exit_report(conn_fd)
    with forked_popen.forking(cmd, lambda env: _program(target, env, spec.thread_counts, state)):
        code = _as_main(simple_launcher, args)
    return runtime.finish(code)


def _program(target: PythonTarget, env: dict, thread_counts: dict,
             state: runtime.ZygoteState) -> int:
    """The forked program: accelerate's environment, then the python step."""
    runtime.die_with_parent()
    # what ps and /proc show: the program's command line and environment, not accelerate's
    # (first, while this process is single-threaded: see proc_view)
    proc_view.show(target.command_line(), env)
    os.environ.clear()
    os.environ.update(env)
    threads.apply_fresh_counts(thread_counts)
    return child.run_python_step(target, state, None)


def _as_main(launcher, args) -> int:
    """Run an accelerate launcher as its command's ``main`` runs in python: the exit code is
    ``sys.exit``'s (accelerate's own for a signal or ``--quiet``); an exception is printed,
    from accelerate's frames on, and exits 1 (Ctrl-C: dies of SIGINT)."""
    try:
        launcher(args)
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:
        exc.__traceback__ = exc.__traceback__.tb_next if exc.__traceback__ else None
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1


def _several_processes(spec: StepSpec, state: runtime.ZygoteState, conn_fd: int, args) -> int:
    """accelerate's ``multi_gpu_launcher`` runs as is; its call to torchrun's ``run()`` is
    served by the agent, in the environment accelerate set for it, and what that call raises
    (a failed rank, a signal) is accelerate's to handle, as it handles torchrun's."""
    from accelerate.commands.launch import multi_gpu_launcher
    from torch.distributed import run as torchrun
    served: dict[str, bool] = {"launched": False}

    def serve(torchrun_args) -> None:
        served["launched"] = True
        agent.serve_launch(spec, state, conn_fd, torchrun_args, recorded=False)

    real_run, torchrun.run = torchrun.run, serve
    try:
        code = _as_main(multi_gpu_launcher, args)  # its exit for a signal (128 + N), --quiet, ...
    finally:
        torchrun.run = real_run
    if not served["launched"]:
        if code == 0:
            protocol.send_event(conn_fd, "fallback", reason="accelerate did not launch",
                                retire=False)
        else:  # accelerate failed before the launch, as it would
            protocol.send_event(conn_fd, "exec", t=time.time())
        return code
    return runtime.finish(code)
