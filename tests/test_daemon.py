"""The warm daemon: serve / run / status / stop, staleness, env mismatch, security, faults."""
import json
import os
import signal
import socket
import struct
import subprocess
import time

import pytest

from conftest import PY, wait_gone


@pytest.fixture
def daemon_env(tmp_path, runtime_base):
    runtime = runtime_base  # Unix socket paths take 107 bytes at most: tmp_path can be longer
    site = tmp_path / "site"
    site.mkdir()
    (site / "greeting.py").write_text("WORD = 'hello'\n")
    (site / "reads_env.py").write_text("import os\nMODE = os.environ.get('DAEMON_IMPORT_MODE', 'a')\n")
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), PYTHONPATH=str(site),
               PRELOAD_LAUNCHER_MODULES="json,greeting,reads_env",
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    yield env, site, runtime
    subprocess.run([PY, "-m", "preload_launcher.cli", "stop", "--all"], env=env, capture_output=True)


def cli(env, *args, timeout=120):
    return subprocess.run([PY, "-m", "preload_launcher.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def status(env):
    out = cli(env, "status", "--json")
    return json.loads(out.stdout) if out.returncode == 0 else None


def test_serve_run_status_stop(daemon_env):
    env, _, _ = daemon_env
    assert cli(env, "serve", "--detach").returncode == 0
    before = status(env)
    assert before["daemon"] and before["preload"]["loaded"] == ["json", "greeting", "reads_env"]
    out = cli(env, "run", "--", PY, "-c", "import greeting, sys; print(greeting.WORD); sys.exit(7)")
    assert (out.returncode, out.stdout, out.stderr) == (7, "hello\n", "")
    after = status(env)
    assert after["pid"] == before["pid"] and after["served"] == before["served"] + 1
    human = cli(env, "status").stdout
    assert f"pid {before['pid']}" in human and "zygote RSS" in human and "stale: no" in human
    assert cli(env, "stop").returncode == 0
    assert wait_gone(before["pid"])
    assert status(env) is None


def test_edited_preloaded_module_is_seen_by_the_next_run(daemon_env):
    env, site, _ = daemon_env
    cli(env, "serve", "--detach")
    pid = status(env)["pid"]
    code = "import greeting; print(greeting.WORD)"
    assert cli(env, "run", "--", PY, "-c", code).stdout == "hello\n"
    time.sleep(0.01)
    (site / "greeting.py").write_text("WORD = 'edited'\n")
    out = cli(env, "run", "--", PY, "-c", code)
    assert out.stdout == "edited\n"
    assert "restarting" in out.stderr and "greeting.py changed" in out.stderr
    assert status(env)["pid"] == pid  # restarted in place


def test_a_stand_in_arriving_while_a_stale_daemon_restarts_runs_the_real_program(daemon_env):
    """An interpreter a shell step starts, arriving while the daemon is stale, runs as the real
    program at once: waiting for the restart's preload would take longer than a fresh start."""
    env, site, _ = daemon_env
    env = dict(env, PATH=os.pathsep.join([os.path.dirname(PY), env.get("PATH", "")]))
    cli(env, "serve", "--detach")
    time.sleep(0.01)
    (site / "greeting.py").write_text("WORD = 'edited'\n")
    out = cli(env, "run", "--", "bash", "-c", "python3 -c 'import greeting; print(greeting.WORD)'")
    assert (out.returncode, out.stdout) == (0, "edited\n"), out.stderr
    after = status(env)  # the restarted daemon's counts: it forked nothing
    assert (after["standin_steps"], after["standin_fallbacks"]) == (0, {})


def test_differing_import_time_env_is_detected(daemon_env):
    env, _, _ = daemon_env
    cli(env, "serve", "--detach")
    code = "import reads_env; print(reads_env.MODE)"
    same = cli(env, "run", "--", PY, "-c", code)
    other = cli(dict(env, DAEMON_IMPORT_MODE="b"), "run", "--", PY, "-c", code)
    assert same.stdout == "a\n" and other.stdout == "b\n"
    assert "DAEMON_IMPORT_MODE" in other.stderr and "fresh zygote" in other.stderr


def test_connection_from_another_uid_is_refused(daemon_env):
    if os.getuid() != 0:
        pytest.skip("needs root to act as another uid")
    env, _, runtime = daemon_env
    cli(env, "serve", "--detach")
    sock_path = next(str(p) for p in runtime.glob("preload_launcher-*/d-*.sock"))
    served = status(env)["served"]
    # Open the way for uid 65534 (the directory is 0700 and the socket 0600 otherwise).
    for path in (runtime, os.path.dirname(sock_path)):
        os.chmod(path, 0o711)
    os.chmod(sock_path, 0o666)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock_path)
            os.write(w, s.recv(4096) or b"EOF")
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    reply = os.read(r, 4096)
    os.chmod(os.path.dirname(sock_path), 0o700)
    assert b'"refused"' in reply
    assert status(env)["served"] == served


def test_garbage_frames_do_not_kill_the_daemon(daemon_env):
    env, _, runtime = daemon_env
    cli(env, "serve", "--detach")
    sock_path = next(str(p) for p in runtime.glob("preload_launcher-*/d-*.sock"))
    for junk in (b"\x00\x00\x00\x05{bad}", b"GET / HTTP/1.0\r\n\r\n", struct.pack("!I", 2**31) + b"x",
                 struct.pack("!I", 8) + b"[1,2,3]!", b""):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(sock_path)
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            reply = s.recv(4096)
        assert b'"error"' in reply, junk
    out = cli(env, "run", "--", PY, "-c", "print('alive')")
    assert out.stdout == "alive\n"


def test_sigkilled_daemon_is_replaced_on_the_next_run(daemon_env):
    env, _, _ = daemon_env
    cli(env, "serve", "--detach")
    old = status(env)["pid"]
    os.kill(old, signal.SIGKILL)
    assert wait_gone(old)
    out = cli(env, "run", "--", PY, "-c", "print('again')")
    assert out.stdout == "again\n" and "gone" in out.stderr
    new = status(env)["pid"]
    assert new != old


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A test that runs a step and records who forked the pytest around it and the step.
SUITE_TEST = """
import json, os, sys
import preload_launcher

def test_step():
    step = preload_launcher.run([sys.executable, "-c", "import greeting, os; print(os.getppid())"])
    assert step.returncode == 0, step.stdout
    seen = {"pytest_parent": os.getppid(), "step_parent": int(step.stdout), "via": step.via}
    with open(os.environ["SEEN_FILE"], "w") as f:
        json.dump(seen, f)
"""


def with_this_checkout(env):
    """The suite's pytest loads this checkout's plugin, wherever it runs."""
    return dict(env, PYTHONPATH=f"{env['PYTHONPATH']}{os.pathsep}{REPO}")


def pytest_from_the_launcher(env, tmp_path, *run_args):
    """``preload-launcher run -v RUN_ARGS SUITE``: its output, and what the suite's test saw."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_one.py").write_text(SUITE_TEST)
    env = dict(env, SEEN_FILE=str(tmp_path / "seen.json"))
    out = cli(env, "run", "-v", *run_args, str(suite), "-q", "-p", "no:cacheprovider")
    assert out.returncode == 0, out.stdout + out.stderr
    return out, json.loads((tmp_path / "seen.json").read_text())


def test_pytest_forked_from_the_daemon_runs_its_steps_from_it_too(daemon_env, tmp_path):
    """``run -- pytest``: the console script is forked from the daemon, and the plugin inside
    forks the suite's steps from that same daemon instead of starting a zygote."""
    env, _, _ = daemon_env
    installed = os.path.join(os.path.dirname(PY), "pytest")
    if not os.path.exists(installed):
        pytest.skip("no pytest console script beside this interpreter")
    env = dict(with_this_checkout(env), PATH=f"{os.path.dirname(PY)}{os.pathsep}{env['PATH']}")
    assert cli(env, "serve", "--detach").returncode == 0
    before = status(env)
    out, seen = pytest_from_the_launcher(env, tmp_path, "--", "pytest")
    assert f"ran through the daemon (pid {before['pid']}), via zygote" in out.stderr
    assert seen == {"pytest_parent": before["pid"], "step_parent": before["pid"], "via": "zygote"}
    assert "zygotes started: 0" in out.stdout, out.stdout
    assert status(env)["served"] == before["served"] + 2


def test_pytest_forked_from_a_one_off_zygote_runs_its_steps_from_it(daemon_env, tmp_path):
    """Without a daemon (``--no-daemon``), the zygote that forked pytest serves its steps."""
    env = with_this_checkout(daemon_env[0])
    out, seen = pytest_from_the_launcher(env, tmp_path, "--no-daemon", "--", PY, "-m", "pytest")
    assert "ran through a one-off zygote, via zygote" in out.stderr
    assert seen["pytest_parent"] == seen["step_parent"] and seen["via"] == "zygote"
    assert "zygotes started: 0" in out.stdout, out.stdout
    assert status(env) is None  # no daemon was started either


NESTED_RUN = """
import os, sys
import preload_launcher
step = preload_launcher.run([sys.executable, "-c", "import greeting, os; print(greeting.WORD, os.getppid())"])
word, parent = step.stdout.split()
print(word, step.via, "parent", parent, "mine", os.getppid())
"""


def test_a_script_forked_from_the_daemon_runs_its_own_steps_from_it(daemon_env, tmp_path):
    """``run -- python x.py`` where x.py calls ``preload_launcher.run``: its step is forked by
    the daemon that forked x.py, not by a zygote x.py would start, preloading the same again."""
    env, _, runtime = daemon_env
    env = with_this_checkout(env)
    script = tmp_path / "nested.py"
    script.write_text(NESTED_RUN)
    assert cli(env, "serve", "--detach").returncode == 0
    before = status(env)
    out = cli(env, "run", "--", PY, str(script))
    assert out.returncode == 0, out.stderr
    word, via, _, step_parent, _, script_parent = out.stdout.split()
    assert (word, via) == ("hello", "zygote")
    assert int(step_parent) == int(script_parent) == before["pid"]
    assert status(env)["served"] == before["served"] + 2
    plainly = cli(dict(env, PRELOAD_LAUNCHER="0"), "run", "--", PY, str(script))
    assert plainly.stdout.split()[:2] == ["hello", "subprocess"]  # the same program, plainly
    assert not list(runtime.glob("preload_launcher-*/z-*"))  # no zygote of its own was left


UNDER_PYTEST = "import os\nFEW_CONFIGS = 'PYTEST_VERSION' in os.environ\n"
# A suite whose conftest imports a module that reads PYTEST_VERSION at import (as modelopt's
# triton kernels do on a GPU machine); its test runs a step that imports it too.
RUNNER_SUITE = {
    "conftest.py": "import under_pytest\n",
    "test_runner.py": """
import json, os, sys
import preload_launcher, under_pytest

def test_step():
    step = preload_launcher.run([sys.executable, "-c",
                                 "import os, under_pytest; print(under_pytest.FEW_CONFIGS, os.getppid())"])
    assert step.returncode == 0, step.stdout
    few, parent = step.stdout.split()
    seen = {"pytest": under_pytest.FEW_CONFIGS, "step": few == "True",
            "pytest_parent": os.getppid(), "step_parent": int(parent)}
    with open(os.environ["SEEN_FILE"], "w") as f:
        json.dump(seen, f)
""",
}


def runner_suite(env, tmp_path):
    (tmp_path / "site" / "under_pytest.py").write_text(UNDER_PYTEST)
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, text in {**RUNNER_SUITE, "pytest.ini": "[pytest]\n"}.items():
        (suite / name).write_text(text)
    env = dict(with_this_checkout(env), SEEN_FILE=str(tmp_path / "seen.json"),
               PRELOAD_LAUNCHER_MODULES="json,greeting,under_pytest")
    env.pop("PYTEST_VERSION", None)  # the daemon is started outside pytest (this one sets it)
    return env, [PY, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider"]


def test_pytest_forked_through_run_imports_as_pytest_does(daemon_env, tmp_path):
    """pytest sets PYTEST_VERSION in its own process before its conftests load: a preloaded
    module that read it at import (absent, in a daemon started outside pytest) would differ
    from a fresh pytest's. The daemon is passed over, a zygote started as pytest runs forks
    pytest and its steps, and both see what a plain pytest and its steps see."""
    env, command = runner_suite(daemon_env[0], tmp_path)
    plain_run = subprocess.run(command, env=dict(env, PRELOAD_LAUNCHER="0"), capture_output=True,
                               text=True, timeout=120)
    assert plain_run.returncode == 0, plain_run.stdout + plain_run.stderr
    plainly = json.loads((tmp_path / "seen.json").read_text())
    assert cli(env, "serve", "--detach").returncode == 0
    before = status(env)
    out = cli(env, "run", "-v", "--", *command)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert (seen["pytest"], seen["step"]) == (plainly["pytest"], plainly["step"]) == (True, True)
    assert seen["pytest_parent"] == seen["step_parent"] != before["pid"]  # one zygote, not two
    assert "other values of PYTEST_VERSION" in out.stderr and "serve --pytest" in out.stderr
    assert "zygotes started: 0" in out.stdout, out.stdout
    assert f"zygote {seen['pytest_parent']} (the zygote that forked this pytest)" in out.stdout
    assert status(env)["served"] == before["served"]  # it could not serve pytest as it runs


def test_a_daemon_served_as_pytest_runs_forks_pytest_and_its_steps(daemon_env, tmp_path):
    """``serve --pytest``: the daemon preloads as pytest runs, so it serves ``run -- pytest``
    and the suite's steps, and they see what a plain pytest and its steps see."""
    env, command = runner_suite(daemon_env[0], tmp_path)
    assert cli(env, "serve", "--detach", "--pytest").returncode == 0
    before = status(env)
    out = cli(env, "run", "-v", "--", *command)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert (seen["pytest"], seen["step"]) == (True, True)  # as plainly (the test above)
    assert seen["pytest_parent"] == seen["step_parent"] == before["pid"]
    assert f"ran through the daemon (pid {before['pid']})" in out.stderr
    assert f"zygote {before['pid']} (the daemon that forked this pytest)" in out.stdout
    assert "zygotes started: 0" in out.stdout, out.stdout
    assert status(env)["served"] == before["served"] + 2


SETS_MODE = "import os\nos.environ['DAEMON_IMPORT_MODE'] = 'b'\n"


def test_the_summary_says_why_the_daemon_that_forked_pytest_was_passed_over(daemon_env, tmp_path):
    """A plugin sets a variable the daemon's preload read (otherwise) before pytest's session
    starts: its steps need another zygote, and the summary names the one that served them and
    why the daemon did not."""
    env, site, _ = daemon_env
    env = with_this_checkout(env)
    (site / "sets_mode.py").write_text(SETS_MODE)
    assert cli(env, "serve", "--detach").returncode == 0
    daemon_pid = status(env)["pid"]
    out, seen = pytest_from_the_launcher(env, tmp_path, "--", PY, "-m", "pytest", "-p",
                                         "sets_mode")
    assert seen["pytest_parent"] == daemon_pid != seen["step_parent"]
    assert (f"the daemon that forked this pytest (pid {daemon_pid}) was not used: it was "
            "preloaded with other values of DAEMON_IMPORT_MODE") in out.stdout, out.stdout
    assert f"zygote {seen['step_parent']} (started by this session)" in out.stdout, out.stdout
