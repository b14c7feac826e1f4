"""The real CPU stack preloaded: torch + megatron.core + modelopt.torch, steps that use them."""
import os
import subprocess

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


def test_the_preloaded_stack_joins_the_module_table_when_imported(stack_launcher):
    code = ("import sys; names = ('torch', 'megatron.core', 'modelopt.torch'); "
            "print(any(m in sys.modules for m in names)); "
            "import torch, megatron.core, modelopt.torch; "
            "print(all(m in sys.modules for m in names))")
    result = stack_launcher.run([PY, "-c", code])
    assert result.via == "zygote", result.reason
    fresh = subprocess.run([PY, "-c", code], capture_output=True, text=True)  # stdout: its
    assert result.stdout == fresh.stdout == "False\nTrue\n"  # import warnings go to stderr


def test_torchs_apis_in_a_step_are_a_fresh_interpreters(stack_launcher, tmp_path):
    """torch.compile (dynamo, AOT autograd, inductor), custom operators, export, fx, TorchScript
    and quantization in a forked step give what they give in a fresh interpreter (each way its
    own inductor cache)."""
    outputs = []
    for way in ("plain", "forked"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / way))
        args = [PY, program("torch_apis.py")]
        if way == "plain":
            outputs.append(subprocess.run(args, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True, timeout=600).stdout)
        else:
            result = stack_launcher.run(args, env=env, timeout=600)
            assert result.via == "zygote", result.reason
            outputs.append(result.stdout)
    checks = [[line for line in out.splitlines() if line.startswith("check ")] for out in outputs]
    assert "check custom_op: [2.0, 2.0]" in checks[0] and "check modelopt: QuantLinear" in checks[0]
    assert checks[1] == checks[0]
