"""The caller's side behaves like subprocess and like the plain command: the CLI's own stdio (a
terminal included), a zygote that dies under a running step, a client that sends slowly, a caller
with fds 0-2 closed, and bad arguments. Each runs the same thing both ways and compares."""
import fcntl
import json
import os
import pathlib
import select
import signal
import subprocess
import termios
import threading
import time

import pytest

from preload_launcher import Launcher, LauncherError

import suite_dirs
from conftest import PY, pid_alive, wait_gone

CLI = [PY, "-m", "preload_launcher.cli"]
PROBE = """import os, sys
print("out", flush=True)
print("err", file=sys.stderr, flush=True)
print("stdin", sys.stdin is None or sys.stdin.read(), file=sys.stderr)
raise SystemExit("failed")
"""


@pytest.fixture(scope="module")
def daemon_env():
    """A daemon preloading json, as `preload-launcher run` finds it."""
    path = suite_dirs.short_dir()  # a socket's path takes 107 bytes at most
    env = dict(os.environ, XDG_RUNTIME_DIR=str(path), PRELOAD_LAUNCHER_MODULES="json")
    subprocess.run([*CLI, "serve", "--detach"], env=env, check=True, capture_output=True)
    yield env
    subprocess.run([*CLI, "stop", "--all"], env=env, capture_output=True)


def served(env: dict) -> int:
    status = subprocess.run([*CLI, "status", "--json"], env=env, capture_output=True, text=True)
    return json.loads(status.stdout)["served"]


def both_ways(command: list, env: dict, shell_tail: str = "", **kwargs):
    """The plain command and the same through `preload-launcher run` (which must have run it
    through the daemon), each under ``bash -c '… <shell_tail>'``."""
    def under_bash(argv):
        return subprocess.run(["bash", "-c", '"$@" ' + shell_tail, "bash", *argv], env=env,
                              capture_output=True, text=True, timeout=120, **kwargs)
    plain = under_bash(command)
    before = served(env)
    launched = under_bash([*CLI, "run", "--", *command])
    assert served(env) == before + 1
    return plain, launched


# ------------------------------------------------------------------ 1. the CLI's own stdio

@pytest.mark.parametrize("tail", ["2>/dev/null", ">/dev/null", "</dev/null", "<&-", ">&-",
                                  "2>&-"])
def test_run_gives_the_step_the_clis_own_stdio(daemon_env, tail):
    plain, launched = both_ways([PY, "-c", PROBE], daemon_env, tail, input="typed\n")
    assert (launched.returncode, launched.stdout, launched.stderr) == \
        (plain.returncode, plain.stdout, plain.stderr)


def test_a_closed_pipe_ends_the_step_as_it_ends_the_plain_command(daemon_env):
    code = "import itertools\nfor i in itertools.count(): print(i)\n"
    plain, launched = both_ways([PY, "-c", code], daemon_env,
                                '| head -1; echo "status ${PIPESTATUS[0]}" >&2')
    assert (launched.stdout, launched.stderr) == (plain.stdout, plain.stderr)
    assert "BrokenPipeError" in plain.stderr and "status 1" in plain.stderr


TTY_PROBE = """import os, sys
print("tty", os.isatty(0), os.isatty(1), os.isatty(2), sys.stdout.line_buffering,
      sys.stderr.line_buffering)
print("before the traceback")
raise ValueError("after the print")
"""


def on_a_terminal(argv: list, env: dict) -> str:
    """What a terminal shows for ``argv`` started on it as its controlling terminal."""
    master, slave = os.openpty()

    def take_terminal():
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                            start_new_session=True, preexec_fn=take_terminal)
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: every holder of the terminal's slave side is gone
            break
        if not chunk:
            break
        shown += chunk
    proc.wait(timeout=60)
    os.close(master)
    return shown.decode().replace("\r\n", "\n")


def test_the_step_writes_to_the_clis_terminal_with_a_terminals_buffering(daemon_env):
    env = {k: v for k, v in daemon_env.items() if k != "PYTHONUNBUFFERED"}
    plain = on_a_terminal([PY, "-c", TTY_PROBE], env)
    launched = on_a_terminal([*CLI, "run", "--", PY, "-c", TTY_PROBE], env)
    assert plain.startswith("tty True True True True True\nbefore the traceback\nTraceback")
    assert launched == plain


# ------------------------------------------------------------------ 2. a zygote that dies

LEAVES_PROCESSES = """import os, subprocess, sys, time
sleeper = subprocess.Popen(["sleep", "1000"])
forked = os.fork()
if forked == 0:
    time.sleep(1000)
    os._exit(0)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {sleeper.pid} {forked}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
print("started", flush=True)
time.sleep(1000)
"""


def test_a_killed_zygote_ends_the_call_and_everything_the_step_started(tmp_path):
    launcher = Launcher(["json"])
    pids_file = tmp_path / "pids"
    outcome = {}

    def call():
        try:
            outcome["result"] = launcher.run([PY, "-c", LEAVES_PROCESSES, str(pids_file)])
        except BaseException as err:
            outcome["error"] = err

    caller = threading.Thread(target=call)
    try:
        caller.start()
        deadline = time.monotonic() + 60
        while not pids_file.exists():
            assert time.monotonic() < deadline and caller.is_alive(), outcome
            time.sleep(0.05)
        pids = [int(p) for p in pids_file.read_text().split()]
        os.kill(launcher.zygotes[0].process.pid, signal.SIGKILL)
        caller.join(60)  # without the fix: until `sleep 1000` ends
        assert not caller.is_alive(), "the caller still waits for the step's leftovers"
        assert isinstance(outcome.get("error"), LauncherError), outcome
        assert "died while running" in str(outcome["error"])
        assert all(wait_gone(pid) for pid in pids), [p for p in pids if pid_alive(p)]
        again = launcher.run([PY, "-c", "print('served again')"])
        assert (again.returncode, again.stdout, again.via) == (0, "served again\n", "zygote")
    finally:
        if pids_file.exists():
            for pid in pids_file.read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        caller.join(60)
        launcher.close()


# ------------------------------------------------------------------ 3. a slow client

def test_a_stalled_client_delays_no_other_caller(light):
    assert light.run([PY, "-c", "pass"]).via == "zygote"  # its zygote is ready
    zygote = light.zygotes[0]
    silent = zygote.connect()  # sends nothing at all
    trickling = zygote.connect()  # a header, then one byte of a frame
    trickling.sendall(b"\x00\x00\x01\x00{")
    try:
        result = light.run([PY, "-c", "print('served')"])
        assert (result.returncode, result.stdout, result.via) == (0, "served\n", "zygote")
        # Served while both are still connected and unanswered (the zygote did not give up on
        # them, which is all a blocking read would have let the other caller through on).
        for sock in (silent, trickling):
            assert select.select([sock], [], [], 0)[0] == []
    finally:
        silent.close()
        trickling.close()
    assert light.run([PY, "-c", "pass"]).returncode == 0


# ------------------------------------------------------------------ 4. fds 0-2 closed

CLOSED_CALLER = """import json, os, subprocess, sys
closed, report, probe = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
for fd in closed:
    os.close(fd)
import preload_launcher
plain = subprocess.run([sys.executable, "-c", probe], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
launcher = preload_launcher.Launcher(["json"])
first = launcher.run([sys.executable, "-c", probe])
second = launcher.run([sys.executable, "-c", probe])
launcher.close()
with open(report, "w") as f:
    json.dump({"plain": [plain.returncode, plain.stdout],
               "launched": [[r.returncode, r.stdout, r.via, r.reason] for r in (first, second)]},
              f)
"""
CLOSED_PROBE = """import os, sys
print("streams", [s is None for s in (sys.stdin, sys.stdout, sys.stderr)])
print("stdin", sys.stdin.read() if sys.stdin else None)
print("open", [fd for fd in (0, 1, 2) if os.path.exists(f"/proc/self/fd/{fd}")])
"""


@pytest.mark.parametrize("closed", [[0], [1], [2], [0, 1, 2]])
def test_a_caller_with_closed_stdio_runs_steps_as_subprocess_does(tmp_path, runtime_base, closed):
    runtime = runtime_base
    report = tmp_path / "report.json"
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
    subprocess.run([PY, "-c", CLOSED_CALLER, json.dumps(closed), str(report), CLOSED_PROBE],
                   env=env, stdin=subprocess.DEVNULL, check=True, timeout=120)
    got = json.loads(report.read_text())
    for returncode, output, via, reason in got["launched"]:
        assert [returncode, output] == got["plain"]
        assert (via, reason) == ("zygote", "")
    leftovers = [p.name for p in runtime.rglob("*") if p.is_file()]
    assert leftovers == []


# ------------------------------------------------------------------ 5. bad arguments

def outcome_of(call, *args, **kwargs):
    try:
        result = call(*args, **kwargs)
    except Exception as err:
        return type(err), str(err)
    return result.returncode, result.stdout


def plain_run(args, **kwargs):
    return subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          **kwargs)


PRINT_CWD = [PY, "-c", "import os; print(os.getcwd())"]


@pytest.mark.parametrize("args,kwargs", [
    (PRINT_CWD, {"cwd": b"/tmp"}),
    (PRINT_CWD, {"cwd": pathlib.Path("/tmp")}),
    (PRINT_CWD, {"cwd": "/tmp\0"}),
    (PRINT_CWD, {"cwd": 3}),
    ([PY, "-c", "pass\0"], {}),
    ([PY.encode(), b"-c", pathlib.Path("pass")], {}),
    ([PY, "-c", 3], {}),
    ([PY, "-c", "pass"], {"env": {**os.environ, "A=B": "1"}}),
    ([PY, "-c", "pass"], {"env": {**os.environ, "A": "1\0"}}),
    ([PY, "-c", "pass"], {"env": {**os.environ, "A\0": "1"}}),
    ([PY, "-c", "pass"], {"env": {**os.environ, "A": 1}}),
    ([PY, "-c", "import os; print(os.environ['A'])"], {"env": {**os.environb, b"A": b"1"}}),
], ids=["cwd-bytes", "cwd-pathlike", "cwd-null", "cwd-int", "arg-null", "args-bytes-pathlike",
        "arg-int", "env-name-equals", "env-value-null", "env-name-null", "env-value-int",
        "env-bytes"])
def test_arguments_are_taken_and_refused_as_subprocess_takes_them(light, args, kwargs):
    """(The environments are the caller's plus the odd variable: the zygote's own, so that the
    step is forked, not refused for a differing import environment.)"""
    expected = outcome_of(plain_run, args, **kwargs)
    assert outcome_of(light.run, args, **kwargs) == expected


def test_a_shells_python_with_stdin_closed_is_still_forked(light):
    """A stand-in passes the fds its program has: a closed stdin is not refused (that fell back
    to the real interpreter), and stays closed in the forked program."""
    env = dict(os.environ, PATH=os.path.dirname(PY) + os.pathsep + os.environ["PATH"])
    args = ["bash", "-c", 'exec 0<&-; python3 -c "$1"', "bash", CLOSED_PROBE]
    expected = plain_run(args, env=env)
    # A zygote ready for this environment first: a stand-in that finds one still starting
    # becomes the real interpreter (correct, but not what this test is about).
    light.run([PY, "-c", "pass"], env=env)
    before = light.standin_steps()
    got = light.run(args, env=env)
    assert (got.returncode, got.stdout) == (expected.returncode, expected.stdout)
    assert "streams [True, False, False]" in got.stdout
    assert light.standin_steps() == before + 1
