"""preload_launcher: run each Python/torchrun step as a fresh child forked from a preloaded zygote."""

from .client import Launcher, ZygoteProcess, default_launcher, run, run_capturing
from .command import StepSpec
from .result import LauncherError, RankFailure, StepResult

__all__ = ["run", "run_capturing", "Launcher", "ZygoteProcess", "default_launcher", "StepSpec",
           "StepResult", "RankFailure", "LauncherError"]
__version__ = "0.1.0"
