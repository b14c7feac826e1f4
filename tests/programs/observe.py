"""Prints, as JSON, everything about its process that a step could notice."""
import json
import multiprocessing
import os
import random
import signal
import sys
import threading

import __main__

def handler_name(h):
    if h is signal.SIG_DFL:
        return "default"
    if h is signal.SIG_IGN:
        return "ignore"
    if h is signal.default_int_handler:
        return "default_int_handler"
    return repr(h) if h is not None else None

annotated: int = 1  # evaluated, unless the code was compiled with a __future__ flag


def annotated_function(a: int) -> str:
    return str(a)


obs = {
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "code_flags": sys._getframe().f_code.co_flags,  # __future__ features the code has
    "annotations": [repr(__annotations__), repr(annotated_function.__annotations__)],
    "path0": sys.path[0],
    "main_keys": sorted(k for k in vars(__main__) if k.startswith("__")),
    "main_name": __main__.__name__,
    "main_file": getattr(__main__, "__file__", None),
    "main_spec_is_none": __main__.__spec__ is None,
    "cwd": os.getcwd(),
    "env_marker": os.environ.get("OBSERVE_MARKER"),
    "env_keys": sorted(os.environ),
    "signals": {s.name: handler_name(signal.getsignal(s)) for s in signal.Signals
                if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "is_main_thread": threading.current_thread() is threading.main_thread(),
    "main_thread_name": threading.main_thread().name,
    "main_thread_native_id_is_own": threading.main_thread().native_id == threading.get_native_id(),
    "threads": threading.active_count(),
    "mp_name": multiprocessing.current_process().name,
    "mp_parent": multiprocessing.parent_process() is None,
    "stdio_buffering": [(s.line_buffering, s.write_through) for s in (sys.stdout, sys.stderr)],
    "stdout_encoding": sys.stdout.encoding,
    "random": random.random(),
    "stdin_readable": os.path.exists("/proc/self/fd/0"),
    "warnoptions": sys.warnoptions,
    "dont_write_bytecode": sys.dont_write_bytecode,
}
if os.path.exists("/proc/self/cmdline"):  # what ps, pgrep -f and psutil read from outside
    with open("/proc/self/cmdline", "rb") as f:
        obs["proc_cmdline"] = os.fsdecode(f.read()).split("\0")
    with open("/proc/self/environ", "rb") as f:
        obs["proc_environ"] = sorted(os.fsdecode(f.read()).split("\0"))
    with open("/proc/self/comm") as f:
        obs["proc_comm"] = f.read().strip()
if "torch" in sys.argv[1:]:
    import torch
    obs["torch_rand"] = torch.rand(1).item()
    obs["torch_threads"] = torch.get_num_threads()
print(json.dumps(obs))
