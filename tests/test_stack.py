"""The real CPU stack preloaded: torch + megatron.core + modelopt.torch, steps that use them."""
import os

import pytest

from preload_launcher import Launcher

from conftest import PY, program

pytestmark = pytest.mark.needs_torch

STACK = ["torch", "megatron.core", "modelopt.torch"]
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")


@pytest.fixture(scope="module")
def stack_launcher():
    launcher = Launcher(STACK)
    yield launcher
    launcher.close()


def test_stack_preloads_cleanly(stack_launcher):
    zygote = stack_launcher.zygote_for(dict(os.environ))
    report = zygote.status["preload"]
    assert report["loaded"] == STACK, report
    assert report["quarantined"] == {}
    assert zygote.status["native_threads"]  # BLAS pools are fine; Python threads are not
    stack_launcher.run([PY, "-c", "pass"])


def test_megatron_parallel_state_on_two_gloo_ranks(stack_launcher):
    result = stack_launcher.run([TORCHRUN, "--nproc_per_node=2", program("megatron_parallel_state.py")],
                                timeout=240)
    assert result.via == "zygote", result.reason
    assert result.returncode == 0, result.stdout
    for rank in (0, 1):
        assert f"rank {rank} tp=2 out=(16, 16) sum=2" in result.stdout


def test_modelopt_quantize_step(stack_launcher):
    result = stack_launcher.run([PY, program("modelopt_quantize.py")], timeout=240)
    assert result.via == "zygote"
    assert result.returncode == 0, result.stdout
    assert "quantized QuantLinear" in result.stdout


def test_preloaded_stack_is_not_reimported_by_steps(stack_launcher):
    code = ("import sys; print(all(m in sys.modules for m in "
            "('torch', 'megatron.core', 'modelopt.torch')))")
    result = stack_launcher.run([PY, "-c", code])
    assert result.stdout == "True\n"  # already in sys.modules before the program's first line
