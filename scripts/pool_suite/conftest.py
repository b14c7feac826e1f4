# The heavy conftest chain of a GPU suite: what every process of it imports.
import importlib
import os

for name in os.environ.get("POOL_SUITE_IMPORTS", "torch").split(","):
    if name:
        importlib.import_module(name)
