"""preload_launcher: run each Python/torchrun step as a fresh child forked from a preloaded zygote.

Using the package loads the caller's side only (``caller/`` and the shared modules at the
top), on first use of a name below: ``import preload_launcher.cli`` (the console script)
imports none of it, so a one-off ``preload-launcher run`` starts fast. The zygote's modules
(``zygote/``, ``step/``, ``launchers/``) are imported by the zygote process itself.

PYTEST_DONT_REWRITE: pytest marks a plugin's package for assertion rewriting, and a pytest
forked from a zygote, which holds this package, would warn that it is imported already (an
error under ``filterwarnings = error``); this file has no asserts to rewrite.
"""

from __future__ import annotations

import importlib

__all__ = ["run", "run_capturing", "Launcher", "ZygoteProcess", "default_launcher", "StepSpec",
           "StepResult", "LauncherError", "__version__"]
__version__ = "0.1.0"

# Each public name and the module that defines it.
_HOMES = {"run": "caller.client", "run_capturing": "caller.client", "Launcher": "caller.client",
          "ZygoteProcess": "caller.zygote_handle", "default_launcher": "caller.client",
          "StepSpec": "command", "StepResult": "result", "LauncherError": "result"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # found once; later uses are plain attribute lookups
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
