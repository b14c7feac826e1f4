"""Which import reads or sets an environment variable, with the importer chain: the stack of
every lookup of KEY (or of any variable named PREFIX... for a KEY of PREFIX*) while importing
MODULES (as a zygote would, PYTORCH_NVML_BASED_CUDA_CHECK=1).

    device: PYTHONPATH=/tmp/site-pool:$PWD python3 scripts/gpu/who_reads.py KEY [modules]
"""
import importlib
import os
import sys
import traceback

key = sys.argv[1]
watched = (lambda name: name.startswith(key[:-1])) if key.endswith("*") else key.__eq__
modules = (sys.argv[2] if len(sys.argv) > 2 else "torch,megatron.core,modelopt.torch").split(",")
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
seen = []


class Watching(type(os.environ)):
    def __getitem__(self, name):
        if watched(name):
            seen.append((f"read {name}", traceback.extract_stack(limit=12)[:-1]))
        return super().__getitem__(name)

    def __setitem__(self, name, value):
        if watched(name):
            seen.append((f"set {name}={value!r}", traceback.extract_stack(limit=12)[:-1]))
        return super().__setitem__(name, value)


os.environ.__class__ = Watching
for name in modules:
    importlib.import_module(name)
os.environ.__class__ = Watching.__mro__[1]
after = sorted((k, v) for k, v in os.environ.items() if watched(k))
print(f"{key} after importing {modules}: {after}; threadpoolctl loaded: "
      f"{'threadpoolctl' in sys.modules}; torch_geometric loaded: {'torch_geometric' in sys.modules}")
for what, stack in seen:
    print(f"-- {what} by:")
    print("".join(f"   {f.filename}:{f.lineno} {f.name}\n" for f in stack
                  if "importlib._bootstrap" not in f.filename))
