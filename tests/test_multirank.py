"""torchrun --nproc_per_node=N as N forked siblings, against the real torchrun."""
import json
import os
import subprocess
import time

import pytest

from conftest import PY, plain, program

pytestmark = pytest.mark.needs_torch

TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
VARYING = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}


def rank_infos(output):
    # Ranks share one stream and python -u writes a print's text and newline separately (as
    # under torchrun), so records may share a line: decode each one where it starts.
    decoder = json.JSONDecoder()
    infos = [decoder.raw_decode(part)[0] for part in output.split("RANKINFO ")[1:]]
    return {info["rank"]: info for info in infos}


def comparable(info):
    return {k: v for k, v in info["env"].items() if k not in VARYING}


@pytest.mark.parametrize("launch", [
    [TORCHRUN, "--nproc_per_node=2"],
    [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2"],
    [TORCHRUN, "--standalone", "--nnodes=1", "--nproc_per_node=2"],
    [TORCHRUN, "--nnodes=1:1", "--node_rank=0", "--max_restarts=0", "--role", "trainer",
     "--nproc-per-node=2"],
    [TORCHRUN, "--nproc_per_node=2", "--run-path"],
    [TORCHRUN, "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nproc_per_node=2"],
])
def test_rank_environment_matches_torchrun(torch_launcher, launch):
    args = launch + [program("rank_env.py"), "--x", "1"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    ref = plain(args, env=env, timeout=120)
    got = torch_launcher.run(args, env=env, timeout=120)
    assert got.via == "zygote", got.reason
    assert ref.returncode == got.returncode == 0, got.stdout
    ours, theirs = rank_infos(got.stdout), rank_infos(ref.stdout)
    assert sorted(ours) == sorted(theirs) == [0, 1]
    for rank in (0, 1):
        assert comparable(ours[rank]) == comparable(theirs[rank])
        assert set(ours[rank]["env"]) == set(theirs[rank]["env"])
        assert ours[rank]["argv"] == theirs[rank]["argv"] == ["--x", "1"]
        assert ours[rank]["comm"] == theirs[rank]["comm"]
        if "--run-path" in launch:  # torchrun starts those ranks through multiprocessing's
            continue  # spawn; the launcher runs the script (a known difference, user guide)
        assert ours[rank]["cmdline"] == theirs[rank]["cmdline"]
        assert ({k: v for k, v in ours[rank]["environ"].items() if k not in VARYING}
                == {k: v for k, v in theirs[rank]["environ"].items() if k not in VARYING})
    assert ours[0]["env"]["MASTER_PORT"] == ours[1]["env"]["MASTER_PORT"]
    assert ours[0]["env"]["TORCHELASTIC_ERROR_FILE"] != ours[1]["env"]["TORCHELASTIC_ERROR_FILE"]


def test_explicit_master_port_is_honoured(torch_launcher):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = torch_launcher.run([TORCHRUN, "--nproc_per_node=2", f"--master_port={port}",
                              program("rank_env.py")], timeout=120)
    assert got.returncode == 0, got.stdout
    assert {i["env"]["MASTER_PORT"] for i in rank_infos(got.stdout).values()} == {str(port)}


def test_failing_rank_fails_the_step_like_torchrun(torch_launcher):
    args = [TORCHRUN, "--nproc_per_node=2", program("megatron_style.py"), "--fail-rank", "1"]
    ref = plain(args, timeout=120)
    got = torch_launcher.run(args, timeout=120)
    assert got.via == "zygote"
    assert ref.returncode == got.returncode == 1
    for out in (got.stdout, ref.stdout):
        assert "RuntimeError: rank 1 failed on purpose" in out
        assert "ChildFailedError" in out and "rank      : 1 (local_rank: 1)" in out
    assert "rank 0 done" in got.stdout


def test_megatron_style_script_passes(torch_launcher):
    args = [TORCHRUN, "--nproc_per_node=2", program("megatron_style.py")]
    got = torch_launcher.run(args, timeout=120)
    assert got.returncode == 0, got.stdout
    assert "rank 0 done" in got.stdout and "rank 1 done" in got.stdout


def test_hanging_rank_is_ended_by_timeout_with_the_whole_group(torch_launcher, tmp_path):
    args = [TORCHRUN, "--nproc_per_node=2", program("megatron_style.py"), "--hang-rank", "1"]
    before = set(_children_of_zygotes(torch_launcher))
    with pytest.raises(subprocess.TimeoutExpired):
        torch_launcher.run(args, timeout=5)
    deadline = time.monotonic() + 30
    while set(_children_of_zygotes(torch_launcher)) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(_children_of_zygotes(torch_launcher)) - before


def test_sigkilled_rank_stops_its_sibling(torch_launcher, tmp_path):
    code = ("import os, signal, time, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "if dist.get_rank() == 0: os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(600)\n")
    script = tmp_path / "killed.py"
    script.write_text(code)
    # Rank 1 would sleep far past the timeout: the step ends only if it is stopped.
    got = torch_launcher.run([TORCHRUN, "--nproc_per_node=2", str(script)], timeout=120)
    assert got.returncode == 1  # torchrun's exit status; the rank's code is in its report
    assert "Signal 9 (SIGKILL) received by PID" in got.stdout


def test_unsupported_launches_run_real_torchrun(torch_launcher):
    got = torch_launcher.run([TORCHRUN, "--no-python", "--nproc_per_node=2", PY,
                              program("rank_env.py")], timeout=120)
    assert (got.via, got.reason, got.returncode) == ("subprocess", "--no-python", 0)
    assert len(rank_infos(got.stdout)) == 2


def test_argument_errors_read_as_torchrun_own(torch_launcher):
    for launch in ([TORCHRUN], [PY, "-m", "torch.distributed.run"]):
        args = launch + ["--nproc_per_node=2", "--no-such-flag", program("rank_env.py")]
        ref, got = plain(args), torch_launcher.run(args)
        assert (got.returncode, got.via) == (ref.returncode, "zygote")
        assert got.stdout.splitlines()[-1] == ref.stdout.splitlines()[-1]


def _children_of_zygotes(launcher):
    pids = []
    for z in launcher.zygotes:
        try:
            with open(f"/proc/{z.process.pid}/task/{z.process.pid}/children") as f:
                pids += f.read().split()
        except OSError:
            pass
    return pids


# Each line in one write: under torchrun's `python -u` print() writes its pieces one by one, and
# --tee's reader, which prefixes what it reads of a rank's log, may read half a line.
PRINTER = ("import os\nr = os.environ['RANK']\nos.write(1, f'out from {r}\\n'.encode())\n"
           "os.write(2, f'err from {r}\\n'.encode())\n")


def rank_lines(output):
    """Prefixed (tee'd) lines as they are; unprefixed ranks write straight to the shared stream
    (as under torchrun), so those are compared as a multiset of characters."""
    lines = [l for l in output.splitlines() if not l.startswith(("W1", "*", "Setting OMP"))]
    prefixed = sorted(l for l in lines if l.startswith("[default"))
    loose = sorted("".join(l for l in lines if not l.startswith("[default")).replace(" ", ""))
    return prefixed, loose


@pytest.mark.parametrize("flags", [["--tee", "3"], ["--tee", "3", "--local-ranks-filter", "1"],
                                   ["--redirects", "3"], ["--redirects", "1"], []])
def test_output_options_match_torchrun(torch_launcher, tmp_path, flags):
    script = tmp_path / "printer.py"
    script.write_text(PRINTER)
    results = {}
    for how in ("ours", "theirs"):
        log_dir = tmp_path / f"logs-{how}"
        args = [TORCHRUN, "--nproc_per_node=2", "--log-dir", str(log_dir), *flags, str(script)]
        results[how] = (torch_launcher.run(args, timeout=120) if how == "ours"
                        else plain(args, timeout=120))
        results[how + "_logs"] = sorted(
            (p.relative_to(log_dir).parts[-2:], p.read_text())
            for p in log_dir.rglob("*.log"))
    assert results["ours"].returncode == results["theirs"].returncode == 0
    assert results["ours"].via == "zygote"
    assert rank_lines(results["ours"].stdout) == rank_lines(results["theirs"].stdout)
    assert results["ours_logs"] == results["theirs_logs"]
