"""Why a zygote would refuse a test process's interpreters on a GPU machine: the variables a
process that imported the stack itself (a suite's conftests, CUDA calls included) has set, and
the zygote's view of that environment.

    device: PYTHONPATH=/tmp/site-pool:$PWD python3 scripts/gpu/env_after_imports.py [modules]
"""
import importlib
import json
import os
import sys

from preload_launcher import Launcher

modules = (sys.argv[1] if len(sys.argv) > 1 else "torch,megatron.core,modelopt.torch").split(",")
launcher = Launcher(modules)
try:
    zygote = launcher.zygote_for(dict(os.environ))
    before = dict(os.environ)
    for name in modules:
        importlib.import_module(name)
    import torch
    print("cuda available:", torch.cuda.is_available(), torch.cuda.get_device_capability())
    set_now = {k: v for k, v in os.environ.items() if before.get(k) != v}
    preload = zygote.status.get("preload", {})
    print("set by this process's own imports:", json.dumps(set_now, sort_keys=True))
    print("zygote loaded:", preload.get("loaded"), "quarantined:", list(preload.get("quarantined", {})))
    print("zygote import_env:", json.dumps(preload.get("import_env"), sort_keys=True))
    print("zygote set_while_importing:", preload.get("set_while_importing"))
    print("mismatch with this environment:", zygote.env_mismatch(dict(os.environ)))
    result = launcher.run([sys.executable, "-c", "print('forked step')"])
    print("a step with this environment:", result.via, result.reason, result.stdout.strip())
finally:
    launcher.close()
