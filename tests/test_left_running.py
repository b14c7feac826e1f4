"""A program a test started and left running outlives the session as it does plainly, and goes
when its owner ends it. Under the switch the session's zygote forked it: at the session's end the
zygote stops serving at once (its socket and files go, the session does not wait) and stays only
as the program's parent, ending with the last such program; a program whose caller went is
killed, as it always was. Differential: one inner pytest session with the launcher off, one
with the switch; what is left running, and then what is left at all, compared."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from conftest import PY, pid_alive

SERVER = """
import os, socket, sys
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind("\\0" + sys.argv[1])
server.listen()
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {os.getppid()}")
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
while True:
    conn, _ = server.accept()
    asked = conn.recv(64)
    conn.sendall(b"stopping" if asked == b"stop" else f"pong {os.getpid()}".encode())
    conn.close()
    if asked == b"stop":
        break
"""

LEAVES_A_SERVER = """
import os, subprocess, sys, time


def until(condition):
    deadline = time.monotonic() + 120
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_starts_a_server_and_leaves_it(request):
    if os.environ["PRELOAD_LAUNCHER"] == "suite":  # its zygote serves: the server is forked
        zygote = request.getfixturevalue("preload_launcher").zygote_for_standins(os.environ)
        zygote.wait_ready()  # its preload; marked for stand-ins before it says it is ready
    ready = os.environ["SERVER_READY"]
    popen = subprocess.Popen([sys.executable, "server.py", os.environ["SERVER_NAME"], ready],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    until(lambda: os.path.exists(ready))
    with open(os.environ["SERVER_POPEN"], "w") as f:
        f.write(str(popen.pid))
    if os.environ.get("KILL_THE_SESSION"):  # as a CI job's timeout kills pytest alone
        os.kill(os.getpid(), 9)
"""


def ask(name: str, what: bytes = b"ping") -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect("\0" + name)
        sock.sendall(what)
        return sock.recv(64).decode()


def marked(mark: bytes) -> list[str]:
    """The processes whose environment carries ``mark`` (and are not zombies)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read() and pid_alive(int(pid)):
                    found.append(pid)
        except (OSError, ValueError):
            continue
    return found


def wait_until(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def leave_a_server(tmp_path, runtime_base, way: str, killed: bool = False) -> dict:
    """An inner session under ``PRELOAD_LAUNCHER=way`` whose test starts a server and leaves
    it (``killed``: then pytest is SIGKILLed); returns what is known of it once that session
    has ended."""
    folder = tmp_path / way
    folder.mkdir()
    (folder / "server.py").write_text(SERVER)
    (folder / "test_leaves.py").write_text(LEAVES_A_SERVER)
    (folder / "tmp").mkdir()
    mark = f"PL_LEFT_RUNNING={uuid.uuid4().hex}"
    env = dict(os.environ, PRELOAD_LAUNCHER=way, PRELOAD_LAUNCHER_MODULES="json",
               XDG_RUNTIME_DIR=str(runtime_base), TMPDIR=str(folder / "tmp"),
               SERVER_NAME=f"pl-left-running-{uuid.uuid4().hex}",
               SERVER_READY=str(folder / "ready"), SERVER_POPEN=str(folder / "popen"),
               PL_LEFT_RUNNING=mark.split("=", 1)[1], KILL_THE_SESSION="1" if killed else "")
    done = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_leaves.py"],
                          cwd=folder, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == (-signal.SIGKILL if killed else 0), done.stdout + done.stderr
    pid, parent = map(int, (folder / "ready").read_text().split())
    return {"name": env["SERVER_NAME"], "pid": pid, "parent": parent, "mark": mark.encode(),
            "popen": int((folder / "popen").read_text()), "runtime": runtime_base,
            "tmp": folder / "tmp", "summary": done.stdout}


def what_is_left(left: dict) -> dict:
    """Once every process of the inner session is gone: the files it left."""
    assert wait_until(lambda: not marked(left["mark"])), marked(left["mark"])
    return {"runtime": sorted(str(p.relative_to(left["runtime"]))
                              for p in left["runtime"].rglob("*") if not p.is_dir()),
            "tmp": sorted(p.name for p in left["tmp"].iterdir()
                          if not p.name.startswith("pytest-of-"))}


@pytest.mark.parametrize("killed", [False, True], ids=["session_ended", "pytest_killed"])
@pytest.mark.parametrize("way", ["0", "suite"])
def test_a_program_a_test_left_running_outlives_the_session_until_its_owner_stops_it(
        tmp_path, runtime_base, way, killed):
    """The server answers after the session ended, or after pytest was killed (it died with
    the session's zygote); stopped by its owner, it goes, and with it everything of the
    session: no process, no file in the runtime directory or the temporary one."""
    left = leave_a_server(tmp_path, runtime_base, way, killed)
    # Forked under the switch: the program is not the process the test started (a stand-in).
    assert (left["pid"] != left["popen"]) == (way == "suite"), left
    assert ask(left["name"]) == f"pong {left['pid']}"
    assert ask(left["name"], b"stop") == "stopping"
    assert what_is_left(left) == {"runtime": [], "tmp": []}


@pytest.mark.parametrize("way", ["0", "suite"])
def test_a_left_program_whose_starter_is_killed_goes_with_it(tmp_path, runtime_base, way):
    """Killing what the test started (as a CI job kills the group) ends the program: plainly it
    is the program; under the switch it is the stand-in, whose program the zygote then kills,
    and the zygote, parent of no program any more, ends too."""
    left = leave_a_server(tmp_path, runtime_base, way)
    assert ask(left["name"]) == f"pong {left['pid']}"
    os.kill(left["popen"], signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(left["pid"])), "the program outlived its starter"
    assert what_is_left(left) == {"runtime": [], "tmp": []}


def test_a_stop_of_the_zygote_that_stays_for_a_program_ends_it(tmp_path, runtime_base):
    """A zygote that stays as the parent of a program left running is stopped as any zygote
    is (SIGTERM): the program goes with it, and nothing is left."""
    left = leave_a_server(tmp_path, runtime_base, "suite")
    assert ask(left["name"]) == f"pong {left['pid']}"
    os.kill(left["parent"], signal.SIGTERM)
    assert what_is_left(left) == {"runtime": [], "tmp": []}


WAITS_IN_A_THREAD = """
import json, os, subprocess, sys, threading, time
from preload_launcher import Launcher

how, flag = sys.argv[1], sys.argv[2]
code = ("import os, sys, time\\nopen(sys.argv[1] + '.started', 'w').close()\\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\\nprint('done')")
results = {}
launcher = Launcher(["json"])
if how == "launcher":
    launcher.prestart().wait_ready()


def step():
    if how == "launcher":
        r = launcher.run([sys.executable, "-c", code, flag])
        results.update(via=r.via, returncode=r.returncode, stdout=r.stdout)
    else:
        r = subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True)
        results.update(via="zygote", returncode=r.returncode, stdout=r.stdout)


waiter = threading.Thread(target=step)
waiter.start()
while not os.path.exists(flag + ".started"):
    time.sleep(0.02)
launcher.close()  # the session's end, while the step runs: it must not wait for it
open(flag + ".closed", "w").close()
waiter.join()
print(json.dumps(results))
"""


@pytest.mark.parametrize("how", ["plain", "launcher"])
def test_a_step_whose_caller_still_waits_when_its_launcher_closes_runs_to_its_end(
        tmp_path, runtime_base, how):
    """``run()`` in a thread still waiting when its launcher closes (pytest's end, with a step
    some thread still waits for): the close returns at once, and the step ends as the program
    does, its output and exit status with it, as ``subprocess.run`` in that thread gets them;
    then the zygote is gone and its files with it."""
    flag = str(tmp_path / "flag")
    mark = f"PL_LEFT_RUNNING={uuid.uuid4().hex}".encode()
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime_base),
               PL_LEFT_RUNNING=mark.split(b"=", 1)[1].decode())
    proc = subprocess.Popen([PY, "-c", WAITS_IN_A_THREAD, how, flag], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: os.path.exists(flag + ".closed")), "close waited for the step"
        open(flag, "w").close()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out) == {"via": "zygote", "returncode": 0, "stdout": "done\n"}
    assert wait_until(lambda: not marked(mark)), marked(mark)
    assert [p for p in runtime_base.rglob("*") if not p.is_dir()] == []
