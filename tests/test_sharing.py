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

# A step that notes its GPUs and when it ran; it marks that it started, then holds its GPUs
# until the test opens its gate: the tests order events by these markers, never by sleeping.
HOLD = ("import json, os, sys, time; t = time.time(); "
        "open(os.path.join(sys.argv[1], 'started.%d' % os.getpid()), 'w').close(); "
        "[time.sleep(0.01) for _ in iter(lambda: os.path.exists(sys.argv[2]), True)]; "
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


class Gate:
    """Where held steps mark their start, and the file that lets them finish."""

    def __init__(self, tmp_path, name="gate"):
        self.dir = tmp_path / name
        self.dir.mkdir()
        self.release_file = self.dir / "open"

    def started(self) -> int:
        return len(list(self.dir.glob("started.*")))

    def release(self):
        self.release_file.touch()


def wait_until(condition, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def waiting_steps(launcher) -> int:
    return launcher.zygotes[0].request("status")["gpus"]["waiting"]


def hold(launcher, gate, **kwargs):
    result = launcher.run([PY, "-c", HOLD, str(gate.dir), str(gate.release_file)], timeout=60,
                          **kwargs)
    assert result.returncode == 0, result.stdout
    gpus, start, end = json.loads(result.stdout)
    return {"gpus": gpus, "start": start, "end": end, "granted": result.gpus,
            "waited": result.gpu_wait_s}


def in_threads(n, target):
    results, threads = [], [threading.Thread(target=lambda: results.append(target()))
                            for _ in range(n)]
    for t in threads:
        t.start()
    return results, threads


def joined(results, threads):
    for t in threads:
        t.join()
    return results


def test_eight_one_gpu_steps_on_four_gpus_never_share_one(packed, tmp_path):
    launcher = packed("0,1,2,3")
    gate = Gate(tmp_path)
    results, threads = in_threads(8, lambda: hold(launcher, gate))
    # Four hold the four GPUs; the other four must queue until the gate opens.
    wait_until(lambda: gate.started() == 4 and waiting_steps(launcher) == 4,
               "four steps run and four wait")
    assert gate.started() == 4
    gate.release()
    steps = joined(results, threads)
    assert len(steps) == 8
    for s in steps:
        assert [s["gpus"]] == s["granted"] and s["gpus"] in ("0", "1", "2", "3")
    for gpu in "0123":
        on_it = sorted((s["start"], s["end"]) for s in steps if s["gpus"] == gpu)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(on_it, on_it[1:])), on_it
    assert sum(s["waited"] > 0 for s in steps) >= 4
    assert launcher.stats["gpu_waits"] == 9


def test_a_step_that_hides_the_gpus_is_not_packed(packed, tmp_path):
    launcher = packed("0")
    gate = Gate(tmp_path)
    busy, threads = in_threads(1, lambda: hold(launcher, gate))
    wait_until(lambda: gate.started() == 1, "the busy step holds GPU 0")
    # GPU 0 stays held until the gate opens: a packed step could not run now.
    free = Gate(tmp_path, "free")
    free.release()
    hidden = hold(launcher, free, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert hidden["gpus"] == "" and hidden["granted"] is None
    assert not busy  # it ran while the GPU was held
    gate.release()
    joined(busy, threads)


@pytest.mark.needs_torch
def test_a_two_gpu_step_waits_for_two_free(packed, tmp_path):
    launcher = packed("0,1", modules=("torch",))
    gate = Gate(tmp_path)
    ranks = tmp_path / "ranks.py"
    # One write per record: ranks run with -u and share one pipe.
    ranks.write_text("import json, os, time\nos.write(1, ('RANK %s\\n' % json.dumps([os.environ["
                     "'RANK'], os.environ['CUDA_VISIBLE_DEVICES'], time.time()])).encode())\n")
    one, one_threads = in_threads(1, lambda: hold(launcher, gate))
    wait_until(lambda: gate.started() == 1, "the one-GPU step holds GPU 0")
    two, two_threads = in_threads(1, lambda: launcher.run(
        [os.path.join(os.path.dirname(PY), "torchrun"), "--nproc_per_node=2", str(ranks)],
        timeout=120))
    wait_until(lambda: waiting_steps(launcher) == 1, "the two-GPU step waits")
    assert not two
    gate.release()
    joined(one, one_threads)
    two = joined(two, two_threads)[0]
    assert two.returncode == 0, two.stdout
    seen = [json.loads(line.split("RANK ", 1)[1]) for line in two.stdout.splitlines()
            if line.startswith("RANK ")]
    assert sorted(r[0] for r in seen) == ["0", "1"]
    assert {r[1] for r in seen} == {"0,1"} and two.gpus == ["0", "1"]
    assert min(r[2] for r in seen) >= one[0]["end"]  # not before both were free
    assert two.gpu_wait_s > 0


def test_a_timed_out_waiting_step_leaves_the_queue(packed, tmp_path):
    launcher = packed("0")
    gate = Gate(tmp_path)
    busy, threads = in_threads(1, lambda: hold(launcher, gate))
    wait_until(lambda: gate.started() == 1, "the busy step holds GPU 0")
    with pytest.raises(subprocess.TimeoutExpired):  # GPU 0 is held until the gate opens
        launcher.run([PY, "-c", "print('never')"], timeout=0.5)
    wait_until(lambda: waiting_steps(launcher) == 0, "the zygote drops the timed-out step")
    gate.release()
    joined(busy, threads)
    after = hold(launcher, gate)  # would wait forever behind a step nobody waits for
    assert after["gpus"] == "0"
    assert waiting_steps(launcher) == 0


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
    gate = Gate(tmp_path)
    gate.release()
    waiter = threading.Thread(target=lambda: results.append(hold(launcher, gate)))
    results = []
    waiter.start()
    wait_until(lambda: waiting_steps(launcher) == 1, "the step queues behind the worker's")
    assert not results
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    waiter.join(timeout=60)  # a deadline, not a measurement
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
