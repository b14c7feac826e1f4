"""The edges of a switched session, each as without the launcher: a launch made before the
preload is done runs at once, one made once the zygote is ready is served, a session shorter than the preload neither waits for it nor
leaves files, what a test leaked is cleaned up when the test process ends, and Popen's
identity arguments reach the program."""

import json
import os
import subprocess
import time

import pytest

from conftest import PY, program
from preload_launcher.caller.zygote_handle import ZygoteProcess
from preload_launcher.files import zygote_files


def test_a_launch_before_the_preload_is_done_does_not_wait_for_it(tmp_path):
    """Under the switch, an interpreter a test starts while the zygote still preloads runs as
    the real program at once; once the zygote serves, it is forked. The preload here never ends
    until the first launch returned: a launch that waited for it would time out."""
    (tmp_path / "held_preload.py").write_text(
        "import os, time\nwhile not os.path.exists(os.environ['HELD_FLAG']):\n"
        "    time.sleep(0.05)\n")
    env = dict(os.environ, HELD_FLAG=str(tmp_path / "flag"),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([PY, program("early_launch.py")], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"early": [0, "False\n"], "late": [0, "True\n"]}, seen


RANKS_FORKED = [0, ["0 other", "1 other"]]  # torchrun's exit status, each rank's parent
RANKS_REAL = [0, ["0 torchrun", "1 torchrun"]]


@pytest.mark.needs_torch
@pytest.mark.parametrize("then, ranks", [
    # served once the preload is done: it and its ranks import the stack, which the preload,
    # started first, usually hands over sooner (it ran the real torchrun, a whole plain start)
    ("release", RANKS_FORKED),
    # a signal sent meanwhile ends it as it ends the program at its start (it was relayed to a
    # request queued in the zygote's backlog, and the real torchrun ran to its end)
    ("signal", [-15, []]),
    # a zygote gone meanwhile: the real program, at once
    ("zygote_dies", RANKS_REAL),
])
def test_a_launcher_of_ranks_started_during_the_preload_waits_for_it(tmp_path, then, ranks):
    """``torchrun`` (as ``accelerate launch``) started while the zygote preloads waits for it
    (a plain ``python`` started then runs as itself at once, counted in the summary)."""
    (tmp_path / "held_preload.py").write_text(
        "import os, time\nwhile not os.path.exists(os.environ['HELD_FLAG']):\n"
        "    time.sleep(0.05)\n")
    env = dict(os.environ, HELD_FLAG=str(tmp_path / "flag"),
               PATH=os.pathsep.join([os.path.dirname(PY), os.environ.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([PY, program("early_rank_launch.py"), then], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    ran_real = {"the zygote was still preloading": 1}  # the python launch
    if then == "zygote_dies":
        ran_real["the zygote ended before it served"] = 1
    assert seen == {"early": [0, "False\n"], "ranks": ranks, "ran_real": ran_real}, seen


# Holds the zygote where it creates its `.ready` mark (the only `.ready` it opens), until
# $MARK_RELEASE exists; $MARK_HELD says it is held. An audit hook sees every os.open.
HOLD_AT_MARK = """
import os, sys, time
HELD, RELEASE = os.environ["MARK_HELD"], os.environ["MARK_RELEASE"]


def hold(event, args):
    if event == "open" and str(args[0]).endswith(".ready") and not os.path.exists(HELD):
        os.close(os.open(HELD, os.O_WRONLY | os.O_CREAT))
        while not os.path.exists(RELEASE):
            time.sleep(0.05)


sys.addaudithook(hold)
"""


def test_a_launch_made_once_the_zygote_is_ready_is_served(tmp_path):
    """The zygote creates its `.ready` mark, which a stand-in checks before asking it, before
    it tells its starter that it is ready: a launch made as soon as ``wait_ready`` returns is
    forked (it ran the real program when the mark came later, now and then, under load). The
    zygote is held where it creates the mark: its starter must not have heard from it then."""
    (tmp_path / "hold_at_mark.py").write_text(HOLD_AT_MARK)
    held, release = tmp_path / "held", tmp_path / "release"
    env = dict(os.environ, MARK_HELD=str(held), MARK_RELEASE=str(release),
               PATH=os.pathsep.join([os.path.dirname(PY), os.environ.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    zygote = ZygoteProcess(["hold_at_mark"], env).launch()
    try:
        deadline = time.monotonic() + 120  # a start-up, not a measurement
        while not held.exists() and zygote.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held.exists(), zygote.log_path
        told_before_the_mark = zygote.poll_ready()
        release.touch()
        zygote.wait_ready()
        marked = os.path.exists(zygote_files(zygote.socket_path)["ready"])
        path = zygote.path_for(env, str(tmp_path))  # stand-ins first, as a switched test has
        assert path, "no stand-in for python3"
        probe = f"import os; print(os.getppid() != {os.getpid()})"  # forked: not our child
        launched = subprocess.run(["python3", "-c", probe], env=dict(env, PATH=path),
                                  cwd=tmp_path, capture_output=True, text=True, timeout=60)
    finally:
        release.touch()
        zygote.close()
    assert (told_before_the_mark, marked) == (False, True)
    assert (launched.returncode, launched.stdout) == (0, "True\n"), launched.stderr


def test_a_session_shorter_than_the_preload_ends_at_once_and_leaves_nothing(tmp_path,
                                                                            runtime_base):
    """With the plugin on (the default), a pytest session that ends while the zygote still
    preloads ends the zygote then and there (it waited up to 5 s for it, and kept its log in the
    runtime directory, one per session). The preload here never ends by itself."""
    (tmp_path / "held_preload.py").write_text(
        "import os, time\nwhile not os.path.exists(os.environ['HELD_FLAG']):\n"
        "    time.sleep(0.05)\n")
    (tmp_path / "test_short.py").write_text("def test_nothing():\n    pass\n")
    runtime = runtime_base  # a socket's path takes 107 bytes at most
    env = dict(os.environ, HELD_FLAG=str(tmp_path / "never"), XDG_RUNTIME_DIR=str(runtime),
               PRELOAD_LAUNCHER="1", PRELOAD_LAUNCHER_MODULES="held_preload",
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_short.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    left = [str(p.relative_to(runtime)) for p in runtime.rglob("*") if not p.is_dir()]
    assert left == [], left
    flag = f"HELD_FLAG={tmp_path / 'never'}".encode()

    def holding_the_flag():
        return [pid for pid in os.listdir("/proc") if pid.isdigit() and flag in environ(pid)]
    # Its scouts are killed as it dies (their parent-death signal): each is gone once the
    # kernel has run its exit, on a loaded machine a moment after the session's end.
    deadline = time.monotonic() + 60
    while holding_the_flag() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not holding_the_flag(), "the zygote or its scouts outlived the session"


def environ(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


LEAKY_TEST = """
import os
from multiprocessing import shared_memory


def test_leaks(request):
    if os.environ["PRELOAD_LAUNCHER"] == "suite":  # its zygote serves the tracker's start
        request.getfixturevalue("preload_launcher").zygote_for_standins(os.environ).wait_ready()
    shm = shared_memory.SharedMemory(create=True, size=16)
    print("segment", shm.name)
    shm.close()  # never unlinked
"""


def test_what_a_test_leaked_is_cleaned_up_when_the_test_process_ends(tmp_path):
    """A shared memory segment a test leaked is unlinked by the test process's resource tracker
    once the process ends, with its warning, also when the session was switched (the session's
    zygote took the tracker with it: the segment stayed in /dev/shm)."""
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST)
    ends = {}
    for way in ("0", "suite"):
        env = dict(os.environ, PRELOAD_LAUNCHER=way, PRELOAD_LAUNCHER_MODULES="json")
        done = subprocess.run([PY, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                               "test_leaky.py"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        name = done.stdout.split("segment ", 1)[1].split()[0]
        ends[way] = (os.path.exists(f"/dev/shm/{name.lstrip('/')}"),
                     "leaked shared_memory objects" in done.stderr)
    assert ends["0"] == (False, True), ends
    assert ends["suite"] == ends["0"], ends


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a launch's user or group needs root")
def test_popens_identity_arguments_reach_the_program():
    """``group=``, ``extra_groups=`` and ``user=`` give the program the ids they give it
    plainly (forked, it kept the zygote's: gid 0 where it asked for 65534)."""
    ref, got = (json.loads(subprocess.run([PY, program("identity_launch.py"), way],
                                          capture_output=True, text=True, timeout=120,
                                          check=True).stdout) for way in ("plain", "switch"))
    assert ref["group"][:2] == [0, "0 65534 [65534]\n"], ref
    assert got.pop("forked") == 1  # the launch that kept its identity was served
    assert got == ref


def test_a_folder_named_in_another_encoding_is_served_and_left_clean(tmp_path, runtime_base):
    """A caller in a folder whose name is not valid UTF-8 gets its step forked, seeing the same
    folder as plainly (its zygote died at start: UnicodeEncodeError), and leaves no file in the
    runtime directory."""
    folder = os.path.join(os.fsencode(tmp_path), b"caf\xe9")
    os.mkdir(folder)
    runtime = runtime_base  # a socket's path takes 107 bytes at most
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), PRELOAD_LAUNCHER_MODULES="json")
    probe = "import os; print(os.fsencode(os.getcwd()))"
    ref = subprocess.run([PY, "-c", probe], cwd=folder, env=env, capture_output=True, timeout=60)
    done = subprocess.run([PY, "-c", "import sys; from preload_launcher.caller import client\n"
                           f"r = client.run([sys.executable, '-c', {probe!r}])\n"
                           "client.default_launcher().close()  # its zygote ended\n"
                           "print(r.via, r.reason); print(r.stdout, end='')"],
                          cwd=folder, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    via, output = done.stdout.split(b"\n", 1)
    assert (via.strip(), output) == (b"zygote", ref.stdout), done.stdout
    assert [p for p in runtime.rglob("*") if not p.is_dir()] == []


def test_os_systems_shell_names_itself_as_plainly():
    """Under the switch, ``os.system``'s shell is /bin/sh called ``sh`` (its messages, ``$0``
    and line numbers as plainly; it named itself ``/bin/sh``). Its PATH starts with this
    interpreter's folder: the shell gets stand-ins only where its ``python3`` is this
    interpreter (under a venv's python, pyenv's shim found first is another one)."""
    code = ("import os, sys\n"
            "if sys.argv[1] == 'switch':\n"
            "    from preload_launcher import Launcher; "
            "from preload_launcher.front import suite_wide\n"
            "    launcher = Launcher(['json'])\n"
            "    suite_wide.install(launcher)\n"
            "status = os.system('true\\nno_such_command_here; echo $0')\n"
            "print(status, suite_wide.counts()['with_standins'] if sys.argv[1] == 'switch' else 1)\n"
            "if sys.argv[1] == 'switch':\n"
            "    suite_wide.uninstall()\n"
            "    launcher.close()\n")
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(PY),
                                                 os.environ.get("PATH", os.defpath)]))
    ref, got = (subprocess.run([PY, "-c", code, way], env=env, capture_output=True, text=True,
                               timeout=120) for way in ("plain", "switch"))
    # "not found", or "Permission denied" where PATH names a folder this user cannot search
    assert "sh: 2: no_such_command_here: " in ref.stderr, ref
    assert (got.stdout, got.stderr) == (ref.stdout, ref.stderr)


ONE_LAUNCH = """
import os, subprocess, sys


def test_one_launch(preload_launcher):
    preload_launcher.zygote_for_standins(os.environ).wait_ready()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def test_a_shared_daemon_counts_only_this_sessions_steps(tmp_path, runtime_base):
    """A switched session served by a running daemon says how many steps it served for this
    session, not in the daemon's whole life."""
    (tmp_path / "test_one.py").write_text(ONE_LAUNCH)
    runtime = runtime_base  # a socket's path takes 107 bytes at most
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), PRELOAD_LAUNCHER_MODULES="json",
               PRELOAD_LAUNCHER="suite")
    cli = [PY, "-m", "preload_launcher.cli"]
    subprocess.run([*cli, "serve", "--detach"], env=env, check=True, capture_output=True,
                   timeout=120)
    try:
        lines = []
        for _ in range(2):
            done = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   "test_one.py"], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=180)
            assert done.returncode == 0, done.stdout + done.stderr
            lines += [line for line in done.stdout.splitlines() if "shared zygote" in line]
    finally:
        subprocess.run([*cli, "stop"], env=env, capture_output=True, timeout=120)
    assert len(lines) == 2 and all("served 1 steps for" in line for line in lines), lines
