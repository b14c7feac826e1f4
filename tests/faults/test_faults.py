"""Faults and load: every case asserts what the launcher did (docs/reliability.md lists them)."""
import os
import signal
import subprocess
import threading
import time

import pytest

from preload_launcher import Launcher, LauncherError, ZygoteProcess

from conftest import PY, plain, program, wait_gone

TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")

RANK_FAULT = """
import os, signal, sys, time, ctypes
import torch.distributed as dist
dist.init_process_group("gloo")
pid_file = os.environ["PID_DIR"] + "/" + os.environ["RANK"]
if dist.get_rank() == 1:
    # Rank 0 notes its pid first: rank 1's fault ends it, perhaps before it could have.
    while not os.path.exists(os.environ["PID_DIR"] + "/0"):
        time.sleep(0.01)
with open(pid_file + ".tmp", "w") as f:  # whole once it appears: it is read as soon as it exists
    f.write(str(os.getpid()))
os.rename(pid_file + ".tmp", pid_file)
if dist.get_rank() == 1:
    fault = sys.argv[1]
    if fault == "crash":
        raise RuntimeError("rank 1 crashed")
    if fault == "segfault":
        ctypes.string_at(0)
    if fault in ("hang", "outside-kill"):
        time.sleep(300)
time.sleep(300 if sys.argv[1] != "none" else 0)
"""


def zygote_fds(z: ZygoteProcess) -> int:
    """The zygote's open fds once it has reaped every step (a step reports its exit before its
    process is gone; until the zygote reaps it, its caller's connection is still open there)."""
    deadline = time.monotonic() + 60  # reaping is quick, but not on a loaded machine
    while z.request("status")["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(os.listdir(f"/proc/{z.process.pid}/fd"))


def zygote_rss_kb(z: ZygoteProcess) -> int:
    with open(f"/proc/{z.process.pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


# torchrun exits 1 for any failed rank; the rank's own code is in its failure report.
@pytest.mark.parametrize("fault,code", [("crash", 1), ("segfault", -11), ("outside-kill", -9),
                                        ("hang", None)])
def test_rank_faults_end_the_whole_step(torch_launcher, tmp_path, fault, code):
    script = tmp_path / "rank_fault.py"
    script.write_text(RANK_FAULT)
    env = dict(os.environ, PID_DIR=str(tmp_path))
    args = [TORCHRUN, "--nproc_per_node=2", str(script), fault]
    if fault == "outside-kill":
        def killer():
            deadline = time.monotonic() + 60
            while not (tmp_path / "1").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            os.kill(int((tmp_path / "1").read_text()), signal.SIGKILL)
        threading.Thread(target=killer, daemon=True).start()
    if code is None:
        with pytest.raises(subprocess.TimeoutExpired):
            torch_launcher.run(args, env=env, timeout=8)
    else:
        result = torch_launcher.run(args, env=env, timeout=120)
        assert result.via == "zygote" and result.returncode == 1, result.stdout
        assert "ChildFailedError" in result.stdout and f"exitcode  : {code}" in result.stdout
    for rank in ("0", "1"):
        assert wait_gone(int((tmp_path / rank).read_text())), f"rank {rank} survived {fault}"


def test_zygote_killed_while_idle_is_replaced(tmp_path):
    launcher = Launcher(["json"])
    try:
        assert launcher.run([PY, "-c", "print(1)"]).via == "zygote"
        old = launcher.zygotes[0].process.pid
        os.kill(old, signal.SIGKILL)
        assert wait_gone(old)
        again = launcher.run([PY, "-c", "print(2)"])
        assert (again.via, again.stdout) == ("zygote", "2\n")
        assert launcher.zygotes[0].process.pid != old
    finally:
        launcher.close()


def test_zygote_killed_while_steps_run(tmp_path):
    launcher = Launcher(["json"])
    pidfile = tmp_path / "step"
    code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    errors = []

    def caller():
        try:
            launcher.run([PY, "-c", code], timeout=60)
        except LauncherError as err:
            errors.append(err)

    try:
        launcher.run([PY, "-c", "pass"])
        zygote_pid = launcher.zygotes[0].process.pid
        t = threading.Thread(target=caller)
        t.start()
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        step_pid = int(pidfile.read_text())
        os.kill(zygote_pid, signal.SIGKILL)
        t.join(30)
        assert len(errors) == 1 and "died while running" in str(errors[0])
        assert wait_gone(step_pid), "the step outlived its zygote"
        after = launcher.run([PY, "-c", "print('fresh')"])
        assert (after.via, after.stdout) == ("zygote", "fresh\n")
    finally:
        launcher.close()


def test_daemonised_grandchild_is_reported_not_waited_for(light, tmp_path):
    pidfile = tmp_path / "gc"
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
            "print('parent done')\n")
    start = time.monotonic()
    result = light.run([PY, "-c", code])
    try:
        # Far below the grandchild's 60 s, whatever the load (a zygote may start first).
        assert time.monotonic() - start < 30
        assert (result.returncode, result.stdout) == (0, "parent done\n")
        assert "daemonised grandchild" in result.reason
    finally:
        os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_fifty_concurrent_steps_from_threads(light):
    light.run([PY, "-c", "pass"])
    zygote = light.zygotes[0]
    fds_before = zygote_fds(zygote)
    results = {}

    def one(i):
        code = f"import sys\nfor j in range(200): print('step {i} line', j)\nsys.exit({i % 7})"
        results[i] = light.run([PY, "-c", code], timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == list(range(50))
    for i, r in results.items():
        assert r.via == "zygote" and r.returncode == i % 7
        assert r.stdout == "".join(f"step {i} line {j}\n" for j in range(200))
    deadline = time.monotonic() + 30  # the zygote closes each connection once it has reaped
    while zygote_fds(zygote) != fds_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert zygote_fds(zygote) == fds_before


def test_concurrent_steps_from_several_processes_share_a_daemon(runtime_base):
    import json
    runtime = runtime_base
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), PRELOAD_LAUNCHER_MODULES="json")
    cli = [PY, "-m", "preload_launcher.cli"]
    try:
        subprocess.run(cli + ["serve", "--detach"], env=env, check=True, capture_output=True)
        status = lambda: json.loads(subprocess.run(cli + ["status", "--json"], env=env,  # noqa: E731
                                                   capture_output=True, text=True).stdout)
        before = status()
        procs = [subprocess.Popen(cli + ["run", "--", PY, "-c",
                                         f"for j in range(100): print('proc {p}', j)"],
                                  env=env, stdout=subprocess.PIPE, text=True) for p in range(10)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        for p, out in enumerate(outs):
            assert out == "".join(f"proc {p} {j}\n" for j in range(100))
        after = status()
        assert after["served"] - before["served"] == 10
        assert after["fds"] == before["fds"]
    finally:
        subprocess.run(cli + ["stop", "--all"], env=env, capture_output=True)


def test_thousand_sequential_steps_keep_zygote_memory_and_fds_flat():
    # Learning off: modules earlier tests' steps imported (this project's learned profile)
    # would be imported while idle here, and grow the zygote by design, not by a leak.
    env = dict(os.environ, PRELOAD_LAUNCHER_LEARN="0")
    launcher = Launcher(["json"])
    try:
        for _ in range(50):
            launcher.run([PY, "-c", "print('x')"], env=env)
        zygote = launcher.zygotes[0]
        rss, fds = zygote_rss_kb(zygote), zygote_fds(zygote)
        for i in range(1000):
            r = launcher.run([PY, "-c", "print('x')"], env=env)
            assert r.returncode == 0
        assert zygote_fds(zygote) == fds
        assert zygote_rss_kb(zygote) - rss < 2048, (rss, zygote_rss_kb(zygote))
    finally:
        launcher.close()


@pytest.mark.parametrize("args,exc", [
    ([], IndexError),
    (["/no/such/python", "x.py"], FileNotFoundError),
    ([PY, "-c", "pass", "x" * 10_000_000], OSError),
])
def test_bad_commands_raise_what_subprocess_raises(light, args, exc):
    with pytest.raises(exc) as ours:
        light.run(args)
    with pytest.raises(exc) as theirs:
        subprocess.run(args)
    assert type(ours.value) is type(theirs.value)
    assert getattr(ours.value, "errno", None) == getattr(theirs.value, "errno", None)
    assert light.run([PY, "-c", "print('serving')"]).stdout == "serving\n"


def test_bad_env_and_cwd_raise_what_subprocess_raises(light, tmp_path):
    for kwargs in ({"env": {"A": 1}}, {"env": {1: "a"}}, {"cwd": str(tmp_path / "nope")}):
        with pytest.raises(Exception) as ours:
            light.run([PY, "-c", "pass"], **kwargs)
        with pytest.raises(Exception) as theirs:
            subprocess.run([PY, "-c", "pass"], **kwargs)
        assert type(ours.value) is type(theirs.value), kwargs
    assert light.run([PY, "-c", "print('serving')"]).stdout == "serving\n"


@pytest.mark.parametrize("nproc", ["0", "abc", "100000"])
def test_bad_nproc_values_fail_like_torchrun(torch_launcher, nproc):
    args = [TORCHRUN, f"--nproc_per_node={nproc}", program("rank_env.py")]
    result = torch_launcher.run(args, timeout=120)
    assert result.returncode == 1
    if nproc == "100000":
        assert "exceeds the limit" in result.stdout and result.via == "zygote"
    else:
        ref = plain(args, timeout=120)
        assert ref.returncode == 1 and result.via == "subprocess"
        assert result.stdout.strip().splitlines()[-1] == ref.stdout.strip().splitlines()[-1]
    assert torch_launcher.run([PY, "-c", "print('serving')"]).via == "zygote"


def test_missing_script_and_module(light, tmp_path):
    for args in ([PY, str(tmp_path / "missing.py")], [PY, "-m", "missing_mod_xyz"]):
        ours, ref = light.run(args), plain(args)
        assert (ours.returncode, ours.stdout) == (ref.returncode, ref.stdout)


def test_binary_output_without_trailing_newline(light):
    code = "import sys; sys.stdout.buffer.write(bytes(range(256)) + b'tail-without-newline')"
    ours = light.run([PY, "-c", code])
    ref = subprocess.run([PY, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, errors="replace")
    assert ours.stdout == ref.stdout and ours.stdout.endswith("tail-without-newline")
