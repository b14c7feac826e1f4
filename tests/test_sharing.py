"""Many workers, many GPUs: xdist workers share one zygote, and GPU packing hands each step free
GPUs (fake ones here: ids the zygote sets as CUDA_VISIBLE_DEVICES, on a machine without GPUs)."""
import json
import os
import signal
import subprocess
import textwrap
import threading
import time

import pytest

from conftest import PY, wait_gone
from preload_launcher import Launcher
from preload_launcher.gpus import pool_ids
from preload_launcher.settings import Settings

# A step that notes its GPUs and when it ran.
HOLD = ("import json, os, sys, time; t = time.time(); time.sleep(float(sys.argv[1])); "
        "print(json.dumps([os.environ.get('CUDA_VISIBLE_DEVICES'), t, time.time()]))")


@pytest.fixture
def packed(monkeypatch, tmp_path):
    # A cache of its own: otherwise the modules other tests' steps taught the session's learned
    # profile (hundreds after test_standins) are preloaded too, what they read at import
    # (COLUMNS, LINES) becomes import-relevant, and a worker process whose environment has
    # other values there rightly gets a zygote of its own, unpacked: order-dependent failures.
    monkeypatch.setenv("PRELOAD_LAUNCHER_CACHE_DIR", str(tmp_path / "cache"))
    launchers = []

    def make(gpus, modules=("json",)):
        launchers.append(Launcher(list(modules), gpus=gpus))
        launchers[-1].run([PY, "-c", "pass"])  # preloaded: the steps contend for GPUs only
        return launchers[-1]

    yield make
    for launcher in launchers:
        launcher.close()


def hold(launcher, seconds, **kwargs):
    result = launcher.run([PY, "-c", HOLD, str(seconds)], timeout=60, **kwargs)
    assert result.returncode == 0, result.stdout
    gpus, start, end = json.loads(result.stdout)
    return {"gpus": gpus, "start": start, "end": end, "granted": result.gpus,
            "waited": result.gpu_wait_s}


def in_threads(n, target):
    results, threads = [], [threading.Thread(target=lambda: results.append(target()))
                            for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_eight_one_gpu_steps_on_four_gpus_never_share_one(packed):
    launcher = packed("0,1,2,3")
    steps = in_threads(8, lambda: hold(launcher, 0.6))
    assert len(steps) == 8
    for s in steps:
        assert [s["gpus"]] == s["granted"] and s["gpus"] in ("0", "1", "2", "3")
    for gpu in "0123":
        on_it = sorted((s["start"], s["end"]) for s in steps if s["gpus"] == gpu)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(on_it, on_it[1:])), on_it
    assert sum(s["waited"] > 0.3 for s in steps) >= 4  # half of them had to wait
    assert launcher.stats["gpu_waits"] == 9


def test_a_step_that_hides_the_gpus_is_not_packed(packed):
    launcher = packed("0")
    busy = threading.Thread(target=hold, args=(launcher, 2.0))
    busy.start()
    time.sleep(0.5)
    start = time.monotonic()
    hidden = hold(launcher, 0.0, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert time.monotonic() - start < 1.5 and hidden["gpus"] == "" and hidden["granted"] is None
    busy.join()


@pytest.mark.needs_torch
def test_a_two_gpu_step_waits_for_two_free(packed, tmp_path):
    launcher = packed("0,1", modules=("torch",))
    ranks = tmp_path / "ranks.py"
    # One write per record: ranks run with -u and share one pipe.
    ranks.write_text("import json, os, time\nos.write(1, ('RANK %s\\n' % json.dumps([os.environ["
                     "'RANK'], os.environ['CUDA_VISIBLE_DEVICES'], time.time()])).encode())\n")
    one = threading.Thread(target=lambda: results.append(hold(launcher, 2.0)))
    results = []
    one.start()
    time.sleep(0.8)  # the one-GPU step holds GPU 0
    two = launcher.run([os.path.join(os.path.dirname(PY), "torchrun"), "--nproc_per_node=2",
                        str(ranks)], timeout=120)
    one.join()
    assert two.returncode == 0, two.stdout
    seen = [json.loads(line.split("RANK ", 1)[1]) for line in two.stdout.splitlines()
            if line.startswith("RANK ")]
    assert sorted(r[0] for r in seen) == ["0", "1"]
    assert {r[1] for r in seen} == {"0,1"} and two.gpus == ["0", "1"]
    assert min(r[2] for r in seen) >= results[0]["end"]  # not before both were free
    assert two.gpu_wait_s > 0.5


def test_a_timed_out_waiting_step_leaves_the_queue(packed):
    launcher = packed("0")
    busy = threading.Thread(target=hold, args=(launcher, 2.0))
    busy.start()
    time.sleep(0.5)
    with pytest.raises(subprocess.TimeoutExpired):
        launcher.run([PY, "-c", "print('never')"], timeout=0.5)
    busy.join()
    after = hold(launcher, 0.0)
    assert after["gpus"] == "0" and after["waited"] < 0.5
    assert launcher.zygotes[0].request("status")["gpus"]["waiting"] == 0


def test_a_killed_workers_steps_release_their_gpus(packed, tmp_path):
    launcher = packed("0")
    marker = tmp_path / "running"
    worker = subprocess.Popen([PY, "-c", textwrap.dedent(f"""
        from preload_launcher import Launcher
        Launcher(["json"], shared_socket={launcher.zygotes[0].socket_path!r}).run(
            [{PY!r}, "-c", "import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); "
             "time.sleep(60)"])
        """)])
    deadline = time.monotonic() + 30
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    step_pid = int(marker.read_text())
    waiter = threading.Thread(target=lambda: results.append(hold(launcher, 0.0)))
    results = []
    waiter.start()
    time.sleep(0.5)
    assert not results  # queued behind the worker's step
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    waiter.join(timeout=20)
    assert results and results[0]["gpus"] == "0"
    assert wait_gone(step_pid)


def test_gpu_pool_settings():
    assert pool_ids("auto", "2,3", 8) == ["2", "3"]
    assert pool_ids("auto", None, 2) == ["0", "1"]
    assert pool_ids("auto", "", 2) == [] and pool_ids("", None, 8) == []
    assert pool_ids("4, 5", None, 0) == ["4", "5"]
    assert Settings.from_env({"PRELOAD_LAUNCHER_GPUS": "0"}).gpus == ""
    with pytest.raises(ValueError, match="PRELOAD_LAUNCHER_GPUS"):
        Settings.from_env({"PRELOAD_LAUNCHER_GPUS": "1,,2"})


XDIST_TEST = """
import os, sys
import pytest

@pytest.mark.parametrize("i", range(8))
def test_step(preload_launcher, i):
    r = preload_launcher.run([sys.executable, "-c", "import os; print(os.getppid())"])
    assert r.via == "zygote", r.reason
    with open(os.environ["SEEN"], "a") as f:
        f.write("%s %s %s\\n" % (os.environ["PYTEST_XDIST_WORKER"], r.stdout.strip(),
                                 preload_launcher.stats["zygotes_started"]))
"""


def test_xdist_workers_share_one_zygote(pytester, tmp_path):
    pytester.makepyfile(test_xdist=XDIST_TEST)
    pytester.makeini("[pytest]\npreload_launcher_modules = json\n")
    pytester._monkeypatch.setenv("SEEN", str(tmp_path / "seen"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "4")
    result.assert_outcomes(passed=8)
    seen = [line.split() for line in (tmp_path / "seen").read_text().splitlines()]
    assert len({worker for worker, _, _ in seen}) >= 2  # several workers ran steps
    assert len({zygote for _, zygote, _ in seen}) == 1  # all forked by one zygote
    assert {started for _, _, started in seen} == {"0"}  # no worker started its own
    result.stdout.fnmatch_lines(["*shared zygote * served 8 steps for the workers*"])
