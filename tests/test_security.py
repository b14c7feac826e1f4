"""No other user can hijack or break a launcher; one daemon per name, whatever starts it.

The attacks are played by a real second user (created for the test, as CI runs as root) in a
sticky, world-writable directory that stands for /tmp; the victim is this test's user."""
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
import uuid

import pytest

import suite_dirs
from conftest import PY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [PY, "-m", "preload_launcher.cli"]
STRANGER_PY = "/usr/bin/python3"  # the standard library only; readable by any user

# A fake zygote, run by the other user: it answers "status" like a daemon preloading argv[3],
# records every request it gets (with the step's environment) and forges the step's output.
FAKE_SERVER = r"""
import json, os, socket, struct, sys
path, record, modules = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
server = socket.socket(socket.AF_UNIX)
server.bind(path)
os.chmod(path, 0o777)
server.listen(16)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    try:
        conn.settimeout(10)
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 8)
        while data and len(data) < 4 + struct.unpack("!I", data[:4])[0]:
            data += conn.recv(1 << 20)
        if not data:
            continue
        request = json.loads(data[4:])
        with open(record, "a") as f:
            f.write(json.dumps(request) + "\n")
        if request.get("op") == "status":
            status = {"event": "status", "pid": os.getpid(), "modules": modules, "python": "",
                      "preload": {"import_env": {}, "loaded": modules, "seconds": 0.0}}
            conn.sendall((json.dumps(status) + "\n").encode())
        else:
            if len(fds) >= 2:
                os.write(fds[1], b"forged\n")
            conn.sendall(b'{"event": "started", "pid": 1}\n{"event": "exec", "t": 0}\n'
                         b'{"event": "exit", "returncode": 0}\n')
    except Exception:
        pass
    finally:
        conn.close()
"""


class Stranger:
    """Another local user, who runs the attacker's part."""

    def __init__(self, name: str) -> None:
        entry = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, entry.pw_uid, entry.pw_gid
        self.servers: list[subprocess.Popen] = []

    def run(self, code: str, *args: str) -> None:
        subprocess.run([STRANGER_PY, "-I", "-c", textwrap.dedent(code), *args], check=True,
                       user=self.uid, group=self.gid, extra_groups=[], cwd="/")

    def serve_fake(self, path: str, record: str, modules: str) -> None:
        server = subprocess.Popen([STRANGER_PY, "-I", "-c", FAKE_SERVER, path, record, modules],
                                  user=self.uid, group=self.gid, extra_groups=[], cwd="/",
                                  stdout=subprocess.PIPE, text=True)
        self.servers.append(server)
        assert server.stdout.readline() == "ready\n"

    def own_dir(self) -> str:
        path = tempfile.mkdtemp(prefix="pl-stranger-", dir="/tmp")
        os.chown(path, self.uid, self.gid)
        os.chmod(path, 0o755)
        return path


@pytest.fixture
def stranger():
    if os.getuid() != 0 or not shutil.which("useradd") or not os.access(STRANGER_PY, os.X_OK):
        pytest.skip("needs root, useradd and /usr/bin/python3 to play a second local user")
    name = f"plsec{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    user = Stranger(name)
    dirs_before = set(os.listdir("/tmp"))
    yield user
    for server in user.servers:
        server.kill()
        server.wait()
    for name_in_tmp in set(os.listdir("/tmp")) - dirs_before:
        if name_in_tmp.startswith("pl-stranger-"):
            shutil.rmtree(os.path.join("/tmp", name_in_tmp), ignore_errors=True)
    subprocess.run(["userdel", user.name], check=True, capture_output=True)


@pytest.fixture
def victim_env():
    """A victim whose runtime base is a shared sticky directory, like /tmp (its own cache)."""
    public = tempfile.mkdtemp(prefix="pl-public-", dir="/tmp")
    os.chmod(public, 0o1777)
    cache = tempfile.mkdtemp(prefix="pl-cache-", dir="/tmp")
    env = dict(os.environ, XDG_RUNTIME_DIR=public, PRELOAD_LAUNCHER_CACHE_DIR=cache,
               PRELOAD_LAUNCHER_MODULES="json", PRELOAD_LAUNCHER_AUTOSERVE="0",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
               PATH=os.pathsep.join([os.path.dirname(PY), os.environ.get("PATH", os.defpath)]))
    yield env
    subprocess.run(CLI + ["stop", "--all"], env=env, capture_output=True)
    shutil.rmtree(public, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)


def predictable(env) -> str:
    return os.path.join(env["XDG_RUNTIME_DIR"], f"preload_launcher-{os.getuid()}")


# ------------------------------------------------------------------ hijack

VICTIM = r"""
import json, os, sys
from preload_launcher import Launcher
launcher = Launcher(["json"])
first = launcher.run([sys.executable, "-c", "print('first')"])
zygote = launcher.zygotes[0]
print(json.dumps({"socket": zygote.socket_path, "standins": zygote.standins}), flush=True)
sys.stdin.readline()  # the other user re-points the link meanwhile
env = dict(os.environ, SECRET="s3cret")
second = launcher.run([sys.executable, "-c", "import os; print(os.environ['SECRET'])"], env=env)
shell = launcher.run(["sh", "-c", "python3 -c 'print(7)'"], env=env)  # stand-ins on PATH
print(json.dumps({"first": first.stdout, "second": second.stdout, "shell": shell.stdout,
                  "with_standins": launcher.stats["with_standins"]}))
launcher.close()
"""

FAKE_STANDIN = "#!/bin/sh\ntouch {marker}\necho pwned\n"


def test_a_symlinked_runtime_dir_re_pointed_never_reaches_another_user(stranger, victim_env):
    link = predictable(victim_env)
    victims_own = tempfile.mkdtemp(prefix="pl-victims-own-", dir="/tmp")  # ours, mode 0700
    attacker = stranger.own_dir()
    stranger.run("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", victims_own, link)
    victim = subprocess.Popen([PY, "-c", VICTIM], env=victim_env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        used = json.loads(victim.stdout.readline())
        name = os.path.basename(used["socket"])
        record, marker = os.path.join(attacker, "record"), os.path.join(attacker, "pwned")
        stranger.serve_fake(os.path.join(attacker, name), record, "json")
        stranger.run("""
            import os, sys
            attacker, name, fake = sys.argv[1], sys.argv[2], sys.argv[3]
            bin_dir = os.path.join(attacker, name[:-len(".sock")] + ".bin")
            os.mkdir(bin_dir)
            for entry in [os.path.join(bin_dir, "%x" % mask) for mask in range(1, 32)] + [bin_dir]:
                os.makedirs(entry, exist_ok=True)
                for program in ("standin", "python", "python3", "python3.11", "torchrun"):
                    with open(os.path.join(entry, program), "w") as f:
                        f.write(fake)
                    os.chmod(os.path.join(entry, program), 0o755)
            os.symlink(attacker, sys.argv[4] + ".new")
            os.rename(sys.argv[4] + ".new", sys.argv[4])  # the link now leads to the attacker
            """, attacker, name, FAKE_STANDIN.format(marker=marker), link)
        out, err = victim.communicate("go\n", timeout=120)
    finally:
        victim.kill()
        shutil.rmtree(victims_own, ignore_errors=True)
    assert victim.returncode == 0, err
    results = json.loads(out)
    assert results == {"first": "first\n", "second": "s3cret\n", "shell": "7\n",
                       "with_standins": 1}  # stand-ins of our own served the shell step
    assert not os.path.exists(record)  # the fake server never saw a request
    assert not os.path.exists(marker)  # nor did a fake stand-in run
    assert f"{link} is a symbolic link" in err  # and the victim was told


def test_a_socket_served_by_another_user_is_never_told_a_step(stranger, victim_env):
    """A daemon's socket answered by another user (put in our directory: as root could, or
    through a directory that is not ours alone) is not used: the client checks its peer."""
    env = victim_env
    assert subprocess.run(CLI + ["serve", "--detach"], env=env, capture_output=True).returncode == 0
    runtime = predictable(env)
    sock = next(os.path.join(runtime, n) for n in os.listdir(runtime) if n.endswith(".sock"))
    meta = json.loads(open(sock[:-len(".sock")] + ".json").read())
    assert subprocess.run(CLI + ["stop", "--all"], env=env, capture_output=True).returncode == 0
    attacker = stranger.own_dir()
    record = os.path.join(attacker, "record")
    stranger.serve_fake(os.path.join(attacker, "fake.sock"), record, "json")
    os.rename(os.path.join(attacker, "fake.sock"), sock)  # listening, in our directory
    with open(sock[:-len(".sock")] + ".json", "w") as f:
        json.dump(dict(meta, pid=stranger.servers[0].pid), f)
    out = subprocess.run(CLI + ["run", "--", PY, "-c", "import os; print(os.environ['SECRET'])"],
                         env=dict(env, SECRET="s3cret"), capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (0, "s3cret\n"), out.stderr
    assert not os.path.exists(record)


STANDIN_CALLER = r"""
import os, sys
from preload_launcher import standin
program = standin.install(sys.argv[1])
os.rename(sys.argv[2], sys.argv[1])  # the socket the stand-in will find is another user's
os.execv(program, [program, "-c", "print('real', flush=True)"])
"""


def test_a_stand_in_never_talks_to_another_users_server(stranger, tmp_path):
    ours = tempfile.mkdtemp(prefix="pl-ours-", dir="/tmp")
    try:
        attacker = stranger.own_dir()
        record = os.path.join(attacker, "record")
        stranger.serve_fake(os.path.join(attacker, "fake.sock"), record, "json")
        out = subprocess.run([PY, "-c", STANDIN_CALLER, os.path.join(ours, "z-1-0.sock"),
                              os.path.join(attacker, "fake.sock")], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    finally:
        shutil.rmtree(ours, ignore_errors=True)
    assert (out.returncode, out.stdout) == (0, "real\n"), out.stderr  # ran as the real python
    assert not os.path.exists(record)


def test_a_symlinked_runtime_dir_is_never_used(runtime_base, victim_env):
    """The same check without a second user: the predictable name is a link to a private
    directory of ours; it is not followed."""
    base = runtime_base / "base"
    base.mkdir()
    target = runtime_base / "elsewhere"
    target.mkdir(mode=0o700)
    (base / f"preload_launcher-{os.getuid()}").symlink_to(target)
    code = ("import os, preload_launcher, sys; r = preload_launcher.run([sys.executable, '-c', "
            "'print(1)']); print(r.via, r.stdout, end=''); "
            "print(os.listdir(sys.argv[1]))")  # while its zygote serves
    out = subprocess.run([PY, "-c", code, str(target)], capture_output=True, text=True,
                         timeout=120, env=dict(victim_env, XDG_RUNTIME_DIR=str(base)))
    assert (out.returncode, out.stdout) == (0, "zygote 1\n[]\n"), out.stderr  # not through it
    assert "is a symbolic link" in out.stderr


# ------------------------------------------------------------------ denial of service

PLUGIN_SESSION_TEST = """
import sys
import preload_launcher

def test_step():
    assert preload_launcher.run([sys.executable, "-c", "print(5)"]).stdout == "5\\n"

def test_unrelated():
    pass
"""


def assert_all_ways_work(env, tmp_path, via: str) -> None:
    code = ("import preload_launcher, sys; r = preload_launcher.run([sys.executable, '-c', "
            "'print(1)']); print(r.via, r.stdout, end='')")
    lib = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert (lib.returncode, lib.stdout) == (0, f"{via} 1\n"), lib.stderr
    cli = subprocess.run(CLI + ["run", "--", PY, "-c", "print(2)"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert (cli.returncode, cli.stdout) == (0, "2\n") and "Traceback" not in cli.stderr, cli.stderr
    (tmp_path / "test_session.py").write_text(PLUGIN_SESSION_TEST)
    session = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "test_session.py"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
    assert session.returncode == 0 and "2 passed" in session.stdout, session.stdout + session.stderr


def test_a_taken_runtime_dir_falls_back_to_a_private_one(stranger, victim_env, tmp_path):
    """Another user makes the predictable directory first, open to all: every way in works,
    through a private directory of ours."""
    stranger.run("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)",
                 predictable(victim_env))
    assert_all_ways_work(victim_env, tmp_path, via="zygote")
    assert os.listdir(predictable(victim_env)) == []  # nothing of ours went there


def test_an_open_runtime_dir_of_ours_is_not_used_either(tmp_path, runtime_base, victim_env):
    """Without a second user: the predictable directory is open to all (as another user's
    `mkdir -m777` leaves it); every way in works, and nothing goes there."""
    base = runtime_base / "base"
    base.mkdir()
    open_dir = base / f"preload_launcher-{os.getuid()}"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    env = dict(victim_env, XDG_RUNTIME_DIR=str(base))  # its cache directory: a short path
    assert_all_ways_work(env, tmp_path, via="zygote")
    assert os.listdir(open_dir) == []


def test_with_no_private_dir_anywhere_steps_run_as_processes(stranger, victim_env, tmp_path):
    """The fallback is not ours alone either (a cache directory under another user's): steps
    run as plain processes, saying why; nothing fails."""
    stranger.run("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)",
                 predictable(victim_env))
    cache = os.path.join(stranger.own_dir(), "cache")
    os.mkdir(cache, 0o700)
    env = dict(victim_env, PRELOAD_LAUNCHER_CACHE_DIR=cache)
    assert_all_ways_work(env, tmp_path, via="subprocess")
    code = ("import preload_launcher, sys; "
            "print(preload_launcher.run([sys.executable, '-c', 'pass']).reason)")
    reason = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True).stdout
    assert "no private runtime directory" in reason and f"owned by uid {stranger.uid}" in reason
    for verb in ("serve", "status", "stop"):
        said = subprocess.run(CLI + [verb], env=env, capture_output=True, text=True)
        assert said.returncode == 1 and said.stderr.startswith(f"preload-launcher {verb}: no "
                                                               "private runtime directory")
        assert len(said.stderr.splitlines()) == 1, said.stderr


# ------------------------------------------------------------------ one daemon per name

def daemon_pids(runtime_base: str) -> list[int]:
    """Live daemon zygotes started under ``runtime_base`` (from their command lines)."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{name}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            continue
        if '"daemon": true' in cmdline and runtime_base in cmdline and not zombie:
            pids.append(int(name))
    return pids


def wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.fixture
def runtime_env():
    base = str(suite_dirs.short_dir())
    env = dict(os.environ, XDG_RUNTIME_DIR=base, PRELOAD_LAUNCHER_MODULES="json",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    yield env
    subprocess.run(CLI + ["stop", "--all"], env=env, capture_output=True)
    for pid in daemon_pids(base):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(base, ignore_errors=True)


def test_concurrent_starts_make_one_daemon_that_stop_stops(runtime_env):
    env, base = runtime_env, runtime_env["XDG_RUNTIME_DIR"]
    serves = [subprocess.Popen(CLI + ["serve", "--detach"], env=env, stdout=subprocess.PIPE,
                               text=True) for _ in range(2)]
    said = [s.communicate(timeout=120)[0] for s in serves]
    assert [s.returncode for s in serves] == [0, 0]
    assert len(daemon_pids(base)) == 1, said
    assert sum("already serving" in line for line in said) == 1, said

    os.kill(daemon_pids(base)[0], signal.SIGKILL)
    wait_for(lambda: not daemon_pids(base))
    runs = [subprocess.Popen(CLI + ["run", "--", PY, "-c", f"print({i})"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(6)]
    outs = [r.communicate(timeout=300) for r in runs]
    assert [(r.returncode, out) for r, (out, _) in zip(runs, outs)] == \
        [(0, f"{i}\n") for i in range(6)], outs
    assert len(daemon_pids(base)) == 1
    stop = subprocess.run(CLI + ["stop"], env=env, capture_output=True, text=True)
    assert stop.returncode == 0, stop.stderr
    wait_for(lambda: not daemon_pids(base))
    assert subprocess.run(CLI + ["status"], env=env, capture_output=True).returncode == 1
    assert os.listdir(os.path.join(base, f"preload_launcher-{os.getuid()}")) == []


def test_a_daemon_stopped_mid_step_ends_run_with_one_line_and_the_steps_status(runtime_env):
    env = runtime_env
    assert subprocess.run(CLI + ["serve", "--detach"], env=env, capture_output=True).returncode == 0
    step = subprocess.Popen(CLI + ["run", "--", PY, "-c",
                                   "import time; print('started', flush=True); time.sleep(120)"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert step.stdout.readline() == "started\n"
    assert subprocess.run(CLI + ["stop"], env=env, capture_output=True).returncode == 0
    out, err = step.communicate(timeout=60)
    plain = subprocess.run([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert step.returncode == plain.returncode  # the SIGKILLed step's death is the CLI's own
    assert len(err.splitlines()) == 1 and err.startswith("preload-launcher run: "), err
    assert "stopped" in err and out == ""
