"""Signals and job control as with the plain command: a caller's signal reaches the program
however it is run — ``preload-launcher run`` (through the daemon, or the first run's plain
process), a stand-in under the suite switch — sent to the process the caller started or to its
process group as a terminal does; a handler that saves a checkpoint runs to its end; a stop is
seen by the caller and stops the program; a death by signal is the caller's to see.
Differential: each case plainly and through the launcher, the outcomes compared."""

import json
import re
import os
import signal
import subprocess

import pytest

import suite_dirs
from conftest import PY, program

CLI = [PY, "-m", "preload_launcher.cli", "run", "--"]
RTMIN = signal.SIGRTMIN


@pytest.fixture(scope="module")
def daemon():
    """An environment whose `run` goes through a warm daemon preloading json."""
    path = suite_dirs.short_dir()  # a socket's path takes 107 bytes at most
    env = dict(os.environ, XDG_RUNTIME_DIR=str(path), PRELOAD_LAUNCHER_MODULES="json")
    subprocess.run([PY, "-m", "preload_launcher.cli", "serve", "--detach"], env=env, check=True,
                   capture_output=True, timeout=120)
    yield env
    subprocess.run([PY, "-m", "preload_launcher.cli", "stop", "--all"], env=env,
                   capture_output=True, timeout=120)


@pytest.fixture
def no_daemon(runtime_base):
    """An environment with no daemon: `run` runs the command in its own place."""
    path = runtime_base
    yield dict(os.environ, XDG_RUNTIME_DIR=str(path), PRELOAD_LAUNCHER_MODULES="json")
    subprocess.run([PY, "-m", "preload_launcher.cli", "stop", "--all"],
                   env=dict(os.environ, XDG_RUNTIME_DIR=str(path)), capture_output=True)


def signalled(way, sig, target, command, env=None, tmp_path=None, name="plain"):
    """How ``command`` ended after ``sig``, and what its handler saved (``signalled.py``)."""
    saved = tmp_path / f"saved-{name}"
    sig = sig if isinstance(sig, str) else str(int(sig))  # a number ("stop" is a word)
    done = subprocess.run([PY, program("signalled.py"), way, sig, target, "--",
                           *[str(saved) if part == "SAVED" else part for part in command]],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    seen["saved"] = saved.read_text() if saved.exists() else None
    return seen


CHECKPOINT = [PY, program("checkpoint.py"), "SAVED"]


@pytest.mark.parametrize("sig, target", [
    (signal.SIGTERM, "pid"), (signal.SIGINT, "pid"), (signal.SIGHUP, "pid"),
    (signal.SIGQUIT, "pid"), (signal.SIGUSR1, "pid"), (signal.SIGALRM, "pid"),
    (signal.SIGWINCH, "pid"), (RTMIN, "pid"),
    (signal.SIGINT, "group"), (signal.SIGTERM, "group"),
])
def test_a_checkpointing_handler_runs_to_its_end_through_the_daemon(daemon, tmp_path, sig,
                                                                    target):
    ref = signalled("plain", sig, target, CHECKPOINT, daemon, tmp_path)
    got = signalled("plain", sig, target, CLI + CHECKPOINT, daemon, tmp_path, "cli")
    assert ref == {"returncode": 3, "output": "", "saved": f"saved on {int(sig)}\n"}, ref
    assert got == ref


@pytest.mark.parametrize("sig, target", [(signal.SIGTERM, "pid"), (signal.SIGINT, "group"),
                                         (RTMIN, "pid")])
def test_a_checkpointing_handler_runs_to_its_end_on_the_first_plain_run(no_daemon, tmp_path,
                                                                        sig, target):
    ref = signalled("plain", sig, target, CHECKPOINT, no_daemon, tmp_path)
    got = signalled("plain", sig, target, CLI + CHECKPOINT, no_daemon, tmp_path, "cli")
    assert got == ref and ref["saved"] == f"saved on {int(sig)}\n", (got, ref)


@pytest.mark.parametrize("way", ["daemon", "no_daemon"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, RTMIN])
def test_a_death_by_signal_is_the_callers_to_see(request, tmp_path, way, sig):
    """Killed by signal N, the program's caller sees -N, not 128+N: a Python caller's
    returncode, a shell loop that stops at Ctrl-C."""
    env = request.getfixturevalue(way)
    command = [PY, program("checkpoint.py"), "SAVED", "default"]
    ref = signalled("plain", sig, "pid", command, env, tmp_path)
    got = signalled("plain", sig, "pid", CLI + command, env, tmp_path, "cli")
    assert ref["returncode"] == -sig and got == ref, (got, ref)


@pytest.mark.parametrize("way", ["daemon", "no_daemon"])
def test_ctrl_z_stops_the_program_and_fg_resumes_it(request, tmp_path, way):
    """SIGTSTP to the job's group, as a terminal's Ctrl-Z: the caller sees the job stop, the
    program is stopped (not left running), and SIGCONT resumes it to its normal end."""
    env = dict(request.getfixturevalue(way), CHECKPOINT_RUN_S="1")
    command = [PY, program("checkpoint.py"), "SAVED", "default"]
    ref = signalled("plain", "stop", "group", command, env, tmp_path)
    got = signalled("plain", "stop", "group", CLI + command, env, tmp_path, "cli")
    assert ref == {"stopped_by": signal.SIGTSTP, "program_state": "T", "returncode": 0,
                   "output": "done\n", "saved": None}, ref
    assert got == ref


SWITCHED = [
    (signal.SIGTERM, "pid"), (signal.SIGINT, "group"), (signal.SIGALRM, "pid"),
    (signal.SIGWINCH, "pid"), (RTMIN, "pid"), (signal.SIGUSR2, "group"),
]


@pytest.mark.parametrize("sig, target", SWITCHED)
def test_a_stand_in_under_the_switch_delivers_every_signal(tmp_path, sig, target):
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(PY), os.environ["PATH"]]))
    ref = signalled("plain", sig, target, CHECKPOINT, env, tmp_path)
    got = signalled("switch", sig, target, CHECKPOINT, env, tmp_path, "switch")
    assert got.pop("forked"), "the stand-in ran the real program"
    assert got == ref and ref["saved"] == f"saved on {int(sig)}\n", (got, ref)


def test_a_stand_in_under_the_switch_stops_with_its_program(tmp_path):
    env = dict(os.environ, CHECKPOINT_RUN_S="1")
    command = [PY, program("checkpoint.py"), "SAVED", "default"]
    ref = signalled("plain", "stop", "pid", command, env, tmp_path)
    got = signalled("switch", "stop", "pid", command, env, tmp_path, "switch")
    assert got.pop("forked"), "the stand-in ran the real program"
    assert ref["stopped_by"] == signal.SIGTSTP and ref["program_state"] == "T", ref
    assert got == ref


WAITING_TEST = """\
import os, time

def test_waits():  # one line: the report names it wherever the signal lands
    os.write(1, f"ready {os.getpid()}\\n".encode()); time.sleep(60)
"""


@pytest.mark.parametrize("way", ["daemon", "no_daemon"])
def test_pytest_ctrl_c_d_through_the_cli_reports_as_plainly(request, tmp_path, way):
    """Ctrl-C to a pytest session run through the CLI: pytest's KeyboardInterrupt report and
    its exit code 2, as plainly (the CLI killed it 0.25 s later: 130, no report)."""
    env = request.getfixturevalue(way)
    (tmp_path / "test_waits.py").write_text(WAITING_TEST)
    command = [PY, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p",
               "no:preload_launcher", str(tmp_path / "test_waits.py")]
    ref = signalled("plain", signal.SIGINT, "group", command, env, tmp_path)
    got = signalled("plain", signal.SIGINT, "group", CLI + command, env, tmp_path, "cli")
    for seen in (ref, got):
        seen["output"] = re.sub(r" in [\d.]+s", " in Ns", seen["output"])
    assert ref["returncode"] == 2 and "!! KeyboardInterrupt !!" in ref["output"], ref
    assert got == ref


@pytest.mark.parametrize("way", ["daemon", "no_daemon"])
@pytest.mark.parametrize("sig, stops_itself", [("stop", ""), ("none", "1")])
def test_in_a_session_of_its_own_a_stop_is_discarded_as_plainly(request, tmp_path, way, sig,
                                                                 stops_itself):
    """Started in a session of its own (``start_new_session``), the program leads it and its
    group is orphaned: the kernel discards a stop at its default (a Ctrl-Z to its group, or
    one it sends itself) and it runs to its end. Through the daemon the step stopped in the
    zygote's session, the CLI's own stop was discarded, and its caller waited forever."""
    env = dict(request.getfixturevalue(way), CHECKPOINT_RUN_S="1", CHECKPOINT_SESSION="1",
               CHECKPOINT_STOP_ITSELF=stops_itself)
    command = [PY, program("checkpoint.py"), "SAVED", "default"]
    ref = signalled("plain", sig, "session", command, env, tmp_path)
    got = signalled("plain", sig, "session", CLI + command, env, tmp_path, "cli")
    assert ref["leads_session"] and ref["returncode"] == 0, ref
    assert ref.get("stopped_by") is None and ref["output"].endswith("done\n"), ref
    assert got == ref


@pytest.mark.parametrize("sig, stops_itself", [("stop", ""), ("none", "1")])
def test_a_stand_in_in_a_session_of_its_own_is_the_programs_place(tmp_path, sig, stops_itself):
    """Under the switch, ``Popen(start_new_session=True)``: the forked program leads a
    session, and a stop is discarded as plainly."""
    env = dict(os.environ, CHECKPOINT_RUN_S="1", CHECKPOINT_SESSION="1",
               CHECKPOINT_STOP_ITSELF=stops_itself)
    command = [PY, program("checkpoint.py"), "SAVED", "default"]
    ref = signalled("plain", sig, "session", command, env, tmp_path)
    got = signalled("switch", sig, "session", command, env, tmp_path, "switch")
    assert got.pop("forked"), "the stand-in ran the real program"
    assert ref["leads_session"] and ref["returncode"] == 0, ref
    assert got == ref
