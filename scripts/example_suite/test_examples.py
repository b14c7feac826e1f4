import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = os.path.join(os.path.dirname(HERE), "steps")
PROGRAMS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "programs")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def test_torch_step(run_example):
    assert "torch step on" in run_example(["python", os.path.join(STEPS, "torch_step.py")])


def test_stack_step(run_example):
    assert "stack step" in run_example(["python", os.path.join(STEPS, "stack_step.py")])


def test_modelopt_quantize(run_example):
    assert "quantized QuantLinear" in run_example(["python", os.path.join(PROGRAMS, "modelopt_quantize.py")])


@pytest.mark.parametrize("ranks", [1, 2])
def test_megatron_parallel_state(run_example, ranks):
    out = run_example([TORCHRUN, f"--nproc_per_node={ranks}",
                       os.path.join(PROGRAMS, "megatron_parallel_state.py")])
    assert f"tp={ranks}" in out


def test_failing_rank_is_reported(run_example):
    with pytest.raises(subprocess.CalledProcessError) as info:
        run_example([TORCHRUN, "--nproc_per_node=2", os.path.join(PROGRAMS, "megatron_style.py"),
                     "--fail-rank", "1"])
    assert "rank 1 failed on purpose" in info.value.output


def test_export_style_step_with_env(run_example):
    env = dict(os.environ, EXPORT_DIR="/tmp/export-demo")
    out = run_example(["python", "-c", "import os, torch; print('export to', os.environ['EXPORT_DIR'])"],
                      env=env)
    assert "export to /tmp/export-demo" in out
