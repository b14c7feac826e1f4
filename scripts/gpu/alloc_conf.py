"""The CUDA caching allocator's configuration in a forked step is the step's own, as in a fresh
interpreter: torch reads ``PYTORCH_CUDA_ALLOC_CONF`` when it loads (the zygote loaded it
without), so a step whose environment has another value, or a script that sets it before
``import torch`` (Model-Optimizer's llm_distill, llm_qat and llm_sparsity examples do), must
not get the zygote's allocator.

    python3 scripts/gpu/alloc_conf.py

Each program runs plainly and through a launcher whose zygote preloads torch without the
variable; it prints the allocator backend torch uses after its first CUDA allocation. Exit
status 0 when every launcher answer equals the plain one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from preload_launcher import Launcher  # noqa: E402

from captured_cuda import reports  # noqa: E402  (beside this script)

REPORT = '''import json, os, torch
x = torch.ones(1, device="cuda")
os.write(1, (json.dumps({"backend": torch.cuda.memory.get_allocator_backend(),
                         "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}) + "\\n").encode())
'''
ASYNC = "backend:cudaMallocAsync"
# Each case: the program, and the step's environment beyond the zygote's.
PROGRAMS = {
    "sets it before import torch":
        (f'import os\nos.environ["PYTORCH_CUDA_ALLOC_CONF"] = "{ASYNC}"\n' + REPORT, {}),
    "given in the step's environment": (REPORT, {"PYTORCH_CUDA_ALLOC_CONF": ASYNC}),
    "neither": (REPORT, {}),
}


def main() -> int:
    base = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {os.uname().nodename}, Python "
          f"{sys.version.split()[0]}; zygote preloads torch, without PYTORCH_CUDA_ALLOC_CONF",
          flush=True)
    launcher = Launcher(["torch"])
    ok = True
    with tempfile.TemporaryDirectory() as folder:
        try:
            launcher.prestart(base)
            for name, (source, extra) in PROGRAMS.items():
                script = os.path.join(folder, "step.py")
                with open(script, "w") as f:
                    f.write(source)
                env = dict(base, **extra)
                plain = subprocess.run([sys.executable, script], env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                forked = launcher.run([sys.executable, script], env=env)
                want, got = reports(plain.stdout), reports(forked.stdout)
                same = bool(want) and want == got and plain.returncode == forked.returncode == 0
                ok &= same
                print(f"{name}: plain {want} | launcher {got} via {forked.via} "
                      f"({forked.reason or 'forked'}); same: {same}", flush=True)
        finally:
            launcher.close()
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
