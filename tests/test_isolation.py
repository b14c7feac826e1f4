"""Steps are isolated from each other, from the zygote, and cleaned up completely."""
import os
import signal
import subprocess
import time

import pytest

from conftest import PY, pid_alive, program, wait_gone

LEAKY = """
import json, logging, signal, sys, torch
state = {
    "threads": torch.get_num_threads(),
    "attr": getattr(torch, "_leak_marker", None),
    "handlers": len(logging.getLogger().handlers),
    "sigusr1": signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL,
    "env": __import__("os").environ.get("LEAKED"),
}
print(json.dumps(state))
torch.set_num_threads(1)
torch._leak_marker = "dirty"
logging.getLogger().addHandler(logging.StreamHandler())
signal.signal(signal.SIGUSR1, lambda *a: None)
__import__("os").environ["LEAKED"] = "yes"
"""


def test_steps_cannot_see_each_others_changes(torch_launcher):
    import json
    first = torch_launcher.run([PY, "-c", LEAKY])
    second = torch_launcher.run([PY, "-c", LEAKY])
    assert first.via == second.via == "zygote"
    assert json.loads(first.stdout) == json.loads(second.stdout)
    state = json.loads(second.stdout)
    assert state["attr"] is None and state["handlers"] == 0 and state["sigusr1"]
    assert state["threads"] > 1 or os.cpu_count() == 1
    assert state["env"] is None


def test_hundred_megabytes_of_output_stream_without_deadlock(light):
    code = "import sys\nchunk = 'x' * 1023 + '\\n'\nfor _ in range(100 * 1024): sys.stdout.write(chunk)\n"
    result = light.run([PY, "-c", code], timeout=120)
    assert result.returncode == 0
    assert len(result.stdout) == 100 * 1024 * 1024


def test_timeout_kills_the_step_and_everything_it_started(light, tmp_path):
    pidfile = tmp_path / "pids"
    code = (f"import os, subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pidfile)!r}, 'w').write(f'{{os.getpid()}} {{p.pid}}')\n"
            f"time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as info:
        light.run([PY, "-c", code], timeout=2)
    assert info.value.timeout == 2
    for pid in map(int, pidfile.read_text().split()):
        assert wait_gone(pid), f"pid {pid} survived the timeout"


def test_grandchildren_die_with_the_step(light, tmp_path):
    pidfile = tmp_path / "pid"
    code = (f"import subprocess, sys\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n")
    assert light.run([PY, "-c", code]).returncode == 0
    assert wait_gone(int(pidfile.read_text()))


def test_missing_cwd_raises_like_subprocess(light, tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError) as ours:
        light.run([PY, "-c", "pass"], cwd=missing)
    with pytest.raises(FileNotFoundError) as theirs:
        subprocess.run([PY, "-c", "pass"], cwd=missing)
    assert (ours.value.errno, ours.value.filename) == (theirs.value.errno, theirs.value.filename)


def test_zygote_keeps_serving_after_a_child_segfaults(light):
    crashed = light.run([PY, program("exits.py"), "segv"])
    assert crashed.returncode == -signal.SIGSEGV and crashed.via == "zygote"
    after = light.run([PY, "-c", "print('still here')"])
    assert (after.returncode, after.stdout, after.via) == (0, "still here\n", "zygote")


def test_check_raises_called_process_error_with_output(light):
    with pytest.raises(subprocess.CalledProcessError) as info:
        light.run([PY, "-c", "print('partial'); raise SystemExit(4)"], check=True)
    assert info.value.returncode == 4 and info.value.output == "partial\n"


def test_explicit_empty_env_stays_empty(light):
    result = light.run([PY, "-c", "import os; print(sorted(os.environ))"], env={})
    ref = subprocess.run([PY, "-c", "import os; print(sorted(os.environ))"], env={},
                         capture_output=True, text=True)
    assert result.stdout == ref.stdout


def test_bad_input_raises_what_subprocess_raises(light):
    with pytest.raises(TypeError):
        light.run([PY, "-c", "pass"], env={"A": 1})
    with pytest.raises(TypeError):
        light.run([PY, 1])
    with pytest.raises(IndexError):
        light.run([])
    with pytest.raises(FileNotFoundError):
        light.run(["/no/such/interpreter", "x.py"])
    assert light.run([PY, "-c", "print(1)"]).stdout == "1\n"


def test_non_python_commands_run_as_subprocess(light):
    result = light.run(["sh", "-c", "echo from-shell; exit 5"])
    assert (result.via, result.returncode, result.stdout) == ("subprocess", 5, "from-shell\n")
    assert "not a python interpreter" in result.reason


def test_toggle_off_runs_plain_subprocess(light, monkeypatch):
    monkeypatch.setenv("PRELOAD_LAUNCHER", "0")
    result = light.run([PY, "-c", "print('x')"])
    assert (result.via, result.reason) == ("subprocess", "PRELOAD_LAUNCHER=0")


def test_zygote_exits_when_its_starter_goes_away(tmp_path):
    script = tmp_path / "starter.py"
    script.write_text(
        "import sys, time\n"
        "from preload_launcher import Launcher\n"
        "l = Launcher(['json'])\n"
        "r = l.run([sys.executable, '-c', 'print(1)'])\n"
        "print(l.zygotes[0].process.pid, flush=True)\n"
        "import os; os._exit(0)\n")
    out = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=60)
    zygote_pid = int(out.stdout.split()[-1])
    assert wait_gone(zygote_pid)


def test_caller_killed_mid_step_leaves_no_orphan(tmp_path):
    pidfile = tmp_path / "step.pid"
    script = tmp_path / "caller.py"
    script.write_text(
        "import sys\n"
        "from preload_launcher import Launcher\n"
        f"Launcher(['json']).run([sys.executable, '-c', "
        f"\"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)\"])\n")
    caller = subprocess.Popen([PY, str(script)])
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    step_pid = int(pidfile.read_text())
    assert pid_alive(step_pid)
    caller.kill()
    caller.wait()
    assert wait_gone(step_pid)


def test_ctrl_c_in_the_caller_interrupts_the_step(tmp_path):
    """KeyboardInterrupt while waiting: the step gets SIGINT, then SIGKILL; the caller re-raises."""
    pidfile = tmp_path / "step.pid"
    marker = tmp_path / "interrupted"
    script = tmp_path / "caller.py"
    script.write_text(
        "import signal, sys\n"
        # As a terminal's shell would have it, even when this suite runs with SIGINT ignored
        # (`cmd &` in a script, nohup): ignored dispositions are inherited.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from preload_launcher import Launcher\n"
        "l = Launcher(['json'])\n"
        "step = (\"import os, time\\n\"\n"
        f"        \"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\\n\"\n"
        "        \"try:\\n    time.sleep(60)\\n\"\n"
        f"        \"except KeyboardInterrupt:\\n    open({str(marker)!r}, 'w').write('yes')\\n    raise\\n\")\n"
        "try:\n"
        "    l.run([sys.executable, '-c', step])\n"
        "except KeyboardInterrupt:\n"
        "    print('caller interrupted', flush=True)\n"
        "    l.close()\n"
        "    sys.exit(130)\n")
    caller = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    step_pid = int(pidfile.read_text())
    caller.send_signal(signal.SIGINT)
    out, _ = caller.communicate(timeout=30)
    assert caller.returncode == 130 and out == "caller interrupted\n"
    assert wait_gone(step_pid)
    assert marker.read_text() == "yes"  # the step saw KeyboardInterrupt, as a terminal's Ctrl-C gives


def test_the_ctrl_c_test_passes_when_the_suite_starts_with_sigint_ignored():
    """CI systems start jobs as `cmd &` or under nohup: SIGINT ignored from the start."""
    out = subprocess.run(
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:preload_launcher",
         f"{__file__}::test_ctrl_c_in_the_caller_interrupts_the_step"],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-2000:]
