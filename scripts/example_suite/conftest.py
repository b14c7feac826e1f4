"""An example-test suite shaped like Model-Optimizer's: each test runs example commands through
``run_example_command``, whose only change from the original is the ``run_capturing`` line."""
import os
import subprocess

import pytest

from preload_launcher import run_capturing

HERE = os.path.dirname(os.path.abspath(__file__))
TRANSIENT = ("HTTPError 503", "Connection reset by peer", "Read timed out")


def run_example_command(cmd_parts, example_path=HERE, env=None, max_retries=2):
    for attempt in range(max_retries):
        returncode, output = run_capturing(cmd_parts, cwd=example_path, env=env or os.environ.copy())
        print(output)
        if returncode == 0:
            return output
        if attempt + 1 < max_retries and any(m in output for m in TRANSIENT):
            continue
        raise subprocess.CalledProcessError(returncode, cmd_parts, output)


@pytest.fixture
def run_example():
    return run_example_command
