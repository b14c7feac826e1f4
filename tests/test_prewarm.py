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


TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")


@pytest.fixture
def warm_torch_launcher(monkeypatch):
    monkeypatch.setenv("PRELOAD_LAUNCHER_PREWARM", "1")
    monkeypatch.setenv("PRELOAD_LAUNCHER_PREWARM_RANKS", "2")
    launcher = Launcher(["torch"])
    yield launcher
    launcher.close()


def rank_pids(output):
    return sorted(int(l.split()[1]) for l in output.splitlines() if l.startswith("PID "))


RANK_PID = ("import os, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "os.write(1, f\"PID {os.getpid()} {os.environ['RANK']} {os.environ['WORLD_SIZE']}\\n\".encode())\n"
            # No rank leaves before every rank's mesh is connected (gloo's connectFullMesh
            # fails with 'Connection closed by peer' when a peer exits first, on a loaded machine).
            "dist.barrier()\n"
            "dist.destroy_process_group()\n")


def test_a_prewarmed_agent_serves_one_matching_torchrun_step(warm_torch_launcher, tmp_path):
    script = tmp_path / "rank_pid.py"
    script.write_text(RANK_PID)
    warm_torch_launcher.run([PY, "-c", "pass"])
    first_agent = status(warm_torch_launcher)["warm_agent_pid"]
    assert first_agent
    served = status(warm_torch_launcher)["warm_served"]
    result = warm_torch_launcher.run([TORCHRUN, "--nproc_per_node=2", str(script)], timeout=120)
    assert result.returncode == 0, result.stdout
    pids = rank_pids(result.stdout)
    after = status(warm_torch_launcher)
    assert after["warm_served"] == served + 1
    assert after["warm_agent_pid"] not in (None, first_agent)  # replaced: one step each
    # The ranks were forked before the step arrived: their pids sit right after the agent's.
    assert all(first_agent < pid < first_agent + 16 for pid in pids), (first_agent, pids)


def test_a_prewarmed_agent_with_other_rank_count_releases_its_ranks(warm_torch_launcher, tmp_path):
    script = tmp_path / "rank_pid.py"
    script.write_text(RANK_PID)
    warm_torch_launcher.run([PY, "-c", "pass"])
    result = warm_torch_launcher.run([TORCHRUN, "--nproc_per_node=3", str(script)], timeout=120)
    assert result.returncode == 0, result.stdout
    assert len(rank_pids(result.stdout)) == 3
    assert sorted(l.split()[2] for l in result.stdout.splitlines() if l.startswith("PID ")) == ["0", "1", "2"]


def test_prewarmed_ranks_get_torchruns_environment(warm_torch_launcher):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    args = [TORCHRUN, "--nproc_per_node=2", program("rank_env.py")]
    warm_torch_launcher.run([PY, "-c", "pass"], env=env)
    ours = warm_torch_launcher.run(args, env=env, timeout=120)
    theirs = plain(args, env=env, timeout=120)
    assert status(warm_torch_launcher)["warm_served"] >= 2
    from test_multirank import comparable, rank_infos
    assert ours.returncode == theirs.returncode == 0
    mine, ref = rank_infos(ours.stdout), rank_infos(theirs.stdout)
    assert sorted(mine) == sorted(ref) == [0, 1]
    for rank in (0, 1):
        assert comparable(mine[rank]) == comparable(ref[rank])


def test_prewarm_defaults_on_only_where_asked_and_can_be_turned_off(monkeypatch):
    from preload_launcher import cuda
    from preload_launcher.caller.client import ZygoteProcess

    def prewarm(env, daemon, gpus):
        monkeypatch.setattr(cuda, "nvml_device_count", lambda environ=None: gpus)
        config = ZygoteProcess(["json"], env, daemon=daemon).config(-1, -1, -1)
        return config.prewarm, config.prewarm_ranks

    assert prewarm({}, daemon=False, gpus=2) == (False, 0)  # test lanes: opt-in
    assert prewarm({}, daemon=True, gpus=0) == (False, 0)  # a daemon on a CPU machine
    assert prewarm({}, daemon=True, gpus=2) == (True, 2)  # a daemon on a GPU machine
    assert prewarm({"PRELOAD_LAUNCHER_PREWARM": "0"}, daemon=True, gpus=2)[0] is False
    assert prewarm({"PRELOAD_LAUNCHER_PREWARM": "on", "PRELOAD_LAUNCHER_PREWARM_RANKS": "3"},
                   daemon=False, gpus=0) == (True, 3)
    with pytest.raises(ValueError, match="PRELOAD_LAUNCHER_PREWARM environment variable"):
        prewarm({"PRELOAD_LAUNCHER_PREWARM": "maybe"}, daemon=False, gpus=0)
