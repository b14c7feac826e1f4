"""What python's start-up code reads from the environment and changes in it: the import lines
of ``.pth`` files, ``sitecustomize`` and ``usercustomize``, which ``site`` runs as every
interpreter starts (setuptools' ``distutils-precedence.pth`` reads ``SETUPTOOLS_USE_DISTUTILS``
and puts its distutils first on ``sys.meta_path``).

In the zygote that code ran once, with the environment the zygote started with, before any of
the launcher's code could watch it, and a forked step inherits what it did. So the zygote runs
it again in a throwaway interpreter (``StartupCode``, while the preload runs): the zygote's own
executable, options, environment and directory, plus ``-S``, so that ``site`` runs only once the
recorder (``envreads``) is in place, then ``site.main()``, what python's start-up runs (the user
site's ``.pth`` files and ``usercustomize`` where python would run them, the same rules deciding).
The variables read there join the zygote's ``import_env`` as its preload's reads do; what the
code set or deleted is replayed in each step, as a fresh start does it (``runtime.set_up``).

A step started with ``-I``, ``-s``, ``-S`` or ``-E`` is not served by a zygote (``command``),
and ``PYTHONNOUSERSITE`` keys it, so python runs this code for a step exactly where it ran it
in the zygote. Not seen: reads through C ``getenv`` or ``os.environb`` (the user guide's known
differences). The code sees ``sys.flags.no_site`` set when it runs again.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from typing import Optional

from ..settings import COVERAGE_ENV_PREFIXES
from . import envreads

__all__ = ["StartupCode", "started_with"]

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 300.0  # only against start-up code that waits for the zygote (a lock it holds)

# ``python -S <the zygote's options> -c RUN_AGAIN PACKAGE_PARENT``. A normal start sets
# sys.path[0] ('' for -c) only after site has run; the launcher's folder is on sys.path only
# while the recorder is imported.
RUN_AGAIN = (
    "import sys\n"
    "if not getattr(sys.flags, 'safe_path', 0): del sys.path[0]\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from preload_launcher.zygote import startup_code\n"
    "del sys.path[0]\n"
    "startup_code.run_recording()\n"
)


def run_recording() -> None:
    """In the throwaway interpreter: python's start-up as ``site`` runs it, recording; writes
    ``{"read": {variable: the one default its reads took, else None}, "before": {variable it
    changed: its value before, None where unset}}`` on stdout."""
    report = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # what the code prints is not the report (the zygote's log has it)
    os.close(devnull)
    # site's own reads (HOME, PYTHONUSERBASE) come first, unrecorded: the user site they place
    # keys a zygote by itself (``interpreter.USER_SITE_KEY``), and each step takes its own
    # user base (``interpreter.take_user_base``).
    site.getusersitepackages()
    before = dict(os.environ)
    with envreads.recording_env_reads() as keys:
        site.main()
    after = dict(os.environ)
    changed = {k: before.get(k) for k in before.keys() | after.keys()
               if before.get(k) != after.get(k)}
    with report:
        json.dump({"read": {k: envreads.read_default(k) for k in keys}, "before": changed}, report)


def started_with() -> dict[str, str]:
    """The environment this process was started with, before its start-up code changed
    ``os.environ`` (the kernel's copy, which ``putenv`` leaves alone), as python reads it."""
    with open("/proc/self/environ", "rb") as f:
        entries = f.read().split(b"\0")
    env: dict[str, str] = {}
    for entry in entries:
        key, sep, value = entry.partition(b"=")
        if sep and key:
            env.setdefault(os.fsdecode(key), os.fsdecode(value))
    return env


class StartupCode:
    """Start-up code run again in a throwaway interpreter, started at once; ``answer`` waits
    for what it read and changed."""

    def __init__(self) -> None:
        options = sys.orig_argv[1:sys.orig_argv.index("-c")]  # the zygote's (zygote_handle)
        self.process = subprocess.Popen(
            [sys.executable, "-S", *options, "-c", RUN_AGAIN, PACKAGE_PARENT],
            env=started_with(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)

    def answer(self) -> tuple[dict[str, Optional[str]], dict[str, Optional[str]]]:
        """({variable read: the one default its reads took, else None}, {variable changed: its
        value before, None where unset}). Raises RuntimeError where the code could not be run
        again: a zygote that cannot tell what it read does not serve."""
        try:
            out, _ = self.process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"python's start-up code, run again to see which variables it "
                               f"reads, did not finish in {TIMEOUT_S:.0f} s") from None
        if self.process.returncode or not out:
            raise RuntimeError(f"python's start-up code, run again to see which variables it "
                               f"reads, failed (exit status {self.process.returncode})")
        report = json.loads(out)
        # Coverage's start-up hook reads these; the zygote starts without them, and each step
        # runs that hook itself from its own environment.
        read = {k: v for k, v in report["read"].items() if not k.startswith(COVERAGE_ENV_PREFIXES)}
        return read, report["before"]

    def __enter__(self) -> "StartupCode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End it where no answer was taken (the preload failed first, or it timed out)."""
        if self.process.returncode is None:
            self.process.kill()
            self.process.communicate()
