"""Pre-warmed children: forked ahead, each serves at most one step, only a matching one."""
import json
import os

import pytest

from preload_launcher import Launcher

from conftest import PY, plain, program

PID = [PY, "-c", "import os; print(os.getpid())"]


@pytest.fixture
def warm_launcher(monkeypatch):
    monkeypatch.setenv("PRELOAD_LAUNCHER_PREWARM", "1")
    launcher = Launcher(["json"])
    yield launcher
    launcher.close()


def status(launcher):
    return launcher.zygotes[0].request("status")


def test_every_warm_child_serves_exactly_one_step(warm_launcher):
    pids = []
    for _ in range(5):
        warm = None if not warm_launcher.zygotes else status(warm_launcher)["warm_pid"]
        result = warm_launcher.run(PID)
        pids.append(int(result.stdout))
        if warm is not None:
            assert pids[-1] == warm  # the step ran in the child that was waiting
    assert len(set(pids)) == 5
    after = status(warm_launcher)
    assert after["warm_served"] == 5 and after["warm_pid"] not in pids  # one warm from the start


def test_a_mismatching_cuda_environment_never_uses_the_warm_child(warm_launcher):
    warm_launcher.run(PID)
    warm = status(warm_launcher)["warm_pid"]
    for key, value in (("CUDA_VISIBLE_DEVICES", "1"), ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
                       ("NCCL_DEBUG", "INFO")):
        result = warm_launcher.run(PID, env=dict(os.environ, **{key: value}))
        assert result.via == "zygote" and int(result.stdout) != warm, key
        assert status(warm_launcher)["warm_pid"] == warm  # still waiting, unused
    assert int(warm_launcher.run(PID).stdout) == warm  # a matching step takes it


def test_warm_children_look_like_fresh_interpreters(warm_launcher):
    args = [PY, program("observe.py")]
    env = dict(os.environ)
    warm_launcher.run(PID)  # now a warm child waits
    got = json.loads(warm_launcher.run(args, env=env).stdout)
    ref = json.loads(plain(args, env=env).stdout)
    for key in ("argv", "path0", "main_keys", "signals", "mp_name", "env_keys", "cwd"):
        assert got[key] == ref[key], key
