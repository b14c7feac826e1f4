import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from preload_launcher import Launcher

# Verdicts, learned profiles, sockets and logs of this session stay out of the user's
# directories, and go with the session (pytest_unconfigure).
SESSION_DIR = tempfile.mkdtemp(prefix="pl-tests-")
os.environ.setdefault("PRELOAD_LAUNCHER_CACHE_DIR", os.path.join(SESSION_DIR, "cache"))
os.environ["XDG_RUNTIME_DIR"] = os.path.join(SESSION_DIR, "run")
os.makedirs(os.environ["XDG_RUNTIME_DIR"], exist_ok=True)

PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")
PY = sys.executable

pytest_plugins = ["pytester"]

TORCH_FIXTURES = {"torch_launcher", "warm_torch_launcher"}


@pytest.hookimpl(trylast=True)  # after the plugin has ended the session's zygote (it may still
def pytest_unconfigure(config):  # be preloading, and would write its cache here afterwards)
    shutil.rmtree(SESSION_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Tests that need torch (its fixtures, or marked ``needs_torch``) are skipped where it is
    not installed: the core suite also runs on the Pythons the stack has no CPU build for."""
    have_torch = importlib.util.find_spec("torch") is not None
    for item in items:
        if TORCH_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker("needs_torch")
        if not have_torch and item.get_closest_marker("needs_torch"):
            item.add_marker(pytest.mark.skip(reason="needs torch (not installed for this Python)"))


def program(name: str) -> str:
    return os.path.join(PROGRAMS, name)


def plain(args, **kwargs) -> subprocess.CompletedProcess:
    """The reference: what subprocess.run gives for the same command."""
    return subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          **kwargs)


@pytest.fixture(scope="session")
def light():
    """A launcher whose zygote preloads only the standard library (fast to start)."""
    launcher = Launcher(["json", "logging"])
    yield launcher
    launcher.close()


@pytest.fixture(scope="session")
def torch_launcher():
    launcher = Launcher(["torch"])
    yield launcher
    launcher.close()


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False
