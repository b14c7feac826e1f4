"""A step reports its own exit code once its output is flushed, before its process is torn
down (a CUDA context takes ~0.2 s to destroy): the caller does not wait for the reaping.

Proof without a GPU: the zygote, which reaps steps, is stopped (SIGSTOP) while the step runs;
the result must still arrive, complete, from the step itself.
"""
import os
import signal
import threading
import time

from conftest import PY, wait_gone

TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")


def wait_for(path, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def run_with_reaper_stopped(launcher, args, tmp_path, timeout=60):
    """Start the step; once it runs, stop the zygote and let the step finish."""
    started, go = tmp_path / "started", tmp_path / "go"
    env = dict(os.environ, STARTED=str(started), GO=str(go))
    zygote = launcher.zygote_for(env)
    box = {}
    runner = threading.Thread(target=lambda: box.update(result=launcher.run(args, env=env,
                                                                            timeout=timeout)))
    runner.start()
    wait_for(started)
    os.kill(zygote.process.pid, signal.SIGSTOP)
    try:
        go.touch()
        runner.join(timeout)
        assert not runner.is_alive(), "the result waited for the zygote to reap the step"
    finally:
        os.kill(zygote.process.pid, signal.SIGCONT)
    return box["result"]


WAIT_FOR_GO = ("import os, time\nopen(os.environ['STARTED'], 'a').close()\n"
               "while not os.path.exists(os.environ['GO']):\n    time.sleep(0.01)\n")


def test_python_step_result_arrives_without_the_reaper(light, tmp_path):
    code = WAIT_FOR_GO + ("import atexit, sys\natexit.register(lambda: print('atexit ran'))\n"
                          "print('x' * 100000)\nsys.exit(3)\n")
    result = run_with_reaper_stopped(light, [PY, "-c", code], tmp_path)
    assert result.via == "zygote"
    assert result.returncode == 3
    assert result.stdout == "x" * 100000 + "\natexit ran\n"


def test_step_killed_by_a_signal_is_still_reported_by_the_reaper(light):
    result = light.run([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                       timeout=30)
    assert result.returncode == -signal.SIGKILL


def test_torchrun_result_arrives_from_the_agent_without_the_reaper(torch_launcher, tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(WAIT_FOR_GO + "os.write(1, f\"rank {os.environ['RANK']} done\\n\".encode())\n")
    result = run_with_reaper_stopped(torch_launcher, [TORCHRUN, "--nproc_per_node=2", str(script)],
                                     tmp_path)
    assert result.via == "zygote", result.reason
    assert result.returncode == 0, result.stdout
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("rank ")) == \
        ["rank 0 done", "rank 1 done"]


def test_failing_rank_is_reported_with_its_code(torch_launcher, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(7)\n"
                      "import time; time.sleep(600)\n")
    # Rank 0 would sleep far past the timeout: the step ends only if it is stopped.
    result = torch_launcher.run([TORCHRUN, "--nproc_per_node=2", str(script)], timeout=120)
    assert result.returncode == 1, result.stdout  # torchrun exits 1; the rank's code is reported
    assert "exitcode  : 7" in result.stdout


def test_no_rank_outlives_a_reported_step(torch_launcher, tmp_path):
    pids = tmp_path / "pids"
    script = tmp_path / "pid.py"
    script.write_text(f"import os\nopen({str(pids)!r} + os.environ['RANK'], 'w').write(str(os.getpid()))\n")
    result = torch_launcher.run([TORCHRUN, "--nproc_per_node=2", str(script)], timeout=60)
    assert result.returncode == 0, result.stdout
    for rank in (0, 1):
        assert wait_gone(int((tmp_path / f"pids{rank}").read_text()))


def test_a_forked_copy_of_the_step_does_not_report_for_it(light):
    # The fork runs to the end of the script first (the step waits for it, where a sleep could
    # be too short under load); the step itself exits 3 later.
    code = ("import os, sys\n"
            "fork = os.fork()\n"
            "if fork == 0:\n    print('fork done', flush=True)\n    sys.exit(0)\n"
            "os.waitpid(fork, 0)\nprint('step done', flush=True)\nsys.exit(3)\n")
    result = light.run([PY, "-c", code], timeout=30)
    assert result.returncode == 3
    assert result.stdout.splitlines() == ["fork done", "step done"]
