"""preload_launcher: run each Python/torchrun step as a fresh child forked from a preloaded zygote.

Importing the package loads the caller's side only (client, command, protocol, settings);
the zygote's modules are imported by the zygote process itself.
"""

from .client import Launcher, ZygoteProcess, default_launcher, run, run_capturing
from .command import StepSpec
from .result import LauncherError, StepResult

__all__ = ["run", "run_capturing", "Launcher", "ZygoteProcess", "default_launcher", "StepSpec",
           "StepResult", "LauncherError", "__version__"]
__version__ = "0.1.0"
