"""Nothing left behind: a program that used run() leaves no files once it and its zygote are
gone, however it ends; a daemon's files go with `stop`."""
import os
import signal
import subprocess
import time

import pytest

from conftest import PY

PROGRAM = """
import os, sys, signal, preload_launcher
print(preload_launcher.run([sys.executable, "-c", "print('step ran')"]).stdout, end="", flush=True)
how = sys.argv[1]
if how == "sys.exit":
    sys.exit(3)
if how == "SIGTERM":
    preload_launcher.run([sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(60)"], echo=True)
"""


def files_in(runtime: str) -> list[str]:
    path = os.path.join(runtime, f"preload_launcher-{os.getuid()}")
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def eventually_empty(runtime: str, timeout: float = 60.0) -> list[str]:
    # A deadline, not a measurement: a zygote removes its files as it ends, later under load.
    deadline = time.monotonic() + timeout
    while files_in(runtime) and time.monotonic() < deadline:
        time.sleep(0.05)
    return files_in(runtime)


@pytest.mark.parametrize("how", ["normal", "sys.exit", "SIGTERM"])
def test_a_program_that_used_run_leaves_no_files(runtime_base, how):
    runtime = str(runtime_base)
    env = dict(os.environ, XDG_RUNTIME_DIR=runtime, PRELOAD_LAUNCHER_MODULES="json")
    program = subprocess.Popen([PY, "-c", PROGRAM, how], env=env, stdout=subprocess.PIPE, text=True)
    assert program.stdout.readline() == "step ran\n"
    if how == "SIGTERM":
        assert program.stdout.readline() == "sleeping\n"
        assert files_in(runtime)  # a zygote is serving
        program.send_signal(signal.SIGTERM)
    program.communicate(timeout=30)
    assert program.returncode == {"normal": 0, "sys.exit": 3, "SIGTERM": -15}[how]
    assert eventually_empty(runtime) == []


def test_stop_takes_the_daemons_files_with_it(runtime_base):
    runtime = str(runtime_base)
    env = dict(os.environ, XDG_RUNTIME_DIR=runtime)
    cli = [PY, "-m", "preload_launcher.cli"]
    subprocess.run(cli + ["serve", "--detach", "--preload", "json"], env=env, check=True,
                   capture_output=True)
    assert any(name.endswith(".log") for name in files_in(runtime))
    stop = subprocess.run(cli + ["stop", "--preload", "json"], env=env, capture_output=True,
                          text=True)
    assert stop.returncode == 0, stop.stderr
    assert eventually_empty(runtime) == []
