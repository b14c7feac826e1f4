"""NVML as a fresh interpreter has it, whatever the launcher asked it while preloading.

While preloading, the zygote answers torch's device queries from NVML; every answer
initialises NVML for itself in the process asking and leaves its reference count as it found
it. So a preloaded module that uses NVML itself (balanced) still gets the answer at import, a
scout forked while preloading gets it too, and a step finds NVML uninitialised, as plainly.

Differential: ``tests/programs/nvml_step.py`` plainly and through ``run()`` and a torchrun
rank, with the stand-in NVML of ``tests/programs/preloaded/pynvml.py`` (reference-counted like
NVML) and ``uses_nvml`` preloaded."""

import json
import os
import subprocess

import pytest

from preload_launcher import Launcher

from conftest import PY, plain, program

pytestmark = pytest.mark.needs_torch

MODULES = ["torch", "uses_nvml"]
STEP = program("nvml_step.py")
UNINITIALIZED = "NVMLError_Uninitialized(1)"


def environment(tmp_path, **extra) -> dict:
    path = [program("preloaded"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path),
                PRELOAD_LAUNCHER_MODULES=",".join(MODULES),
                PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"),
                USES_NVML_LOG=str(tmp_path / "imports.log"), **extra)


def imports(env) -> list[dict]:
    """What each process that imported ``uses_nvml`` so far was answered, then forget them."""
    with open(env["USES_NVML_LOG"]) as f:
        lines = [json.loads(line) for line in f]
    os.unlink(env["USES_NVML_LOG"])
    return lines


def fresh_nvml_capability(env) -> str:
    """What the stand-in NVML tells a fresh interpreter that initialises it and asks."""
    ask = ("import pynvml; pynvml.nvmlInit(); "
           "print(tuple(pynvml.nvmlDeviceGetCudaComputeCapability(0)))")
    return subprocess.run([PY, "-c", ask], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_step_finds_nvml_uninitialised_as_plainly(tmp_path):
    env = environment(tmp_path)
    torchrun = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "1", STEP]
    launcher = Launcher(MODULES)
    try:
        launcher.prestart(env)
        got = {"run": launcher.run([PY, STEP], env=env),
               "torchrun": launcher.run(torchrun, env=env)}
        preloading = imports(env)
        ref = {"run": plain([PY, STEP], env=env), "torchrun": plain(torchrun, env=env)}
    finally:
        launcher.close()
    for way in got:
        assert (got[way].returncode, ref[way].returncode) == (0, 0), (got[way].stdout,
                                                                      ref[way].stdout)
        assert got[way].via == "zygote", (way, got[way].reason)
        assert got[way].stdout == ref[way].stdout, way
    assert json.loads(ref["run"].stdout)["count"] == UNINITIALIZED
    assert json.loads(ref["run"].stdout)["extra_shutdown"] == UNINITIALIZED
    # The module's own init and shutdown did not take the answer away while preloading, and
    # its extra shutdown raised there as in a fresh interpreter.
    assert preloading and {p["capability"] for p in preloading} == {fresh_nvml_capability(env)}
    assert {p["extra_shutdown"] for p in preloading} == {p["extra_shutdown"] for p in imports(env)}
    assert preloading[0]["extra_shutdown"] == UNINITIALIZED


def test_a_process_forked_while_preloading_gets_nvmls_answer(tmp_path):
    """With an NVML whose state a forked child cannot use (``FAKE_NVML_PER_PROCESS``), the
    scout that imports ``uses_nvml`` ahead of the zygote (a new package set: a fresh cache)
    is answered as the zygote is, and as NVML answers a fresh interpreter."""
    env = environment(tmp_path, FAKE_NVML_PER_PROCESS="1")
    launcher = Launcher(MODULES)
    try:
        launcher.prestart(env)
        got = launcher.run([PY, STEP], env=env)
        preloading = imports(env)
        ref = plain([PY, STEP], env=env)
    finally:
        launcher.close()
    assert (got.returncode, ref.returncode, got.via) == (0, 0, "zygote"), got.stdout + got.reason
    assert got.stdout == ref.stdout
    assert len({p["pid"] for p in preloading}) >= 2, preloading  # the zygote and its scout
    assert {p["capability"] for p in preloading} == {fresh_nvml_capability(env)}
