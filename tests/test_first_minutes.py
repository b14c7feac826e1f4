"""What a new user meets in the first minutes: one rule for the preload list, daemons that are
starting, settings errors, modules that cannot be imported, the daemons `run` starts on its own,
and one identity for one interpreter, whichever name started it."""
import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from preload_launcher import ZygoteProcess, cuda
from preload_launcher.front.cli_run import worth_a_daemon
from preload_launcher.front.reporting import doctor_verdict, entry_result, preload_problems

from conftest import PY, wait_gone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUSY = "import time\nwhile time.process_time() < 1.3:\n    pass\n"  # worth a daemon


@pytest.fixture
def env(tmp_path, runtime_base):
    """A private runtime directory (short: Unix socket paths) and cache; the launcher from this
    tree, under any interpreter name."""
    runtime = runtime_base
    site = tmp_path / "site"
    site.mkdir()
    environ = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), PRELOAD_LAUNCHER_MODULES="json",
                   PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"),
                   PYTHONPATH=os.pathsep.join([str(site), REPO]))
    yield environ
    cli(environ, "stop", "--all")


def cli(environ, *args, python=PY, timeout=120, **kwargs):
    return subprocess.run([python, "-m", "preload_launcher.cli", *args], env=environ,
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def runtime_files(environ) -> list[str]:
    directory = os.path.join(environ["XDG_RUNTIME_DIR"], f"preload_launcher-{os.getuid()}")
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def wait_for(predicate, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def another_name(executable: str, tmp_path) -> str:
    """This interpreter under a name other than ``executable``'s: a sibling (python, python3,
    python3.X) that is the same file, else a link to it."""
    real = os.path.realpath(executable)
    for name in ("python", "python3", f"python3.{sys.version_info[1]}"):
        path = os.path.join(os.path.dirname(executable), name)
        if path != executable and os.path.exists(path) and os.path.realpath(path) == real:
            return path
    link = tmp_path / "python-link"
    link.symlink_to(real)
    return str(link)


# ---------------------------------------------------------------- one rule, starting daemons

def test_status_and_stop_see_a_daemon_that_is_starting(env, tmp_path):
    gate = tmp_path / "gate"
    (tmp_path / "site" / "gated.py").write_text(
        f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.05)\n")
    serve = subprocess.Popen([PY, "-m", "preload_launcher.cli", "serve", "--detach", "--preload",
                              "json,gated"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        status = wait_for(lambda: (lambda out: out if "starting" in out.stdout else None)(
            cli(env, "status", "--preload", "json,gated")), "the starting daemon")
        assert status.returncode == 1, status  # not serving yet
        assert f"pid {serve.pid}: starting (preloading json,gated)" in status.stdout
        everyone = cli(env, "status", "--all")
        assert "starting (preloading json,gated)" in everyone.stdout
        stop = subprocess.Popen([PY, "-m", "preload_launcher.cli", "stop", "--preload",
                                 "json,gated"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        said = stop.stderr.readline()  # said before it waits for the daemon to serve
        assert said.endswith("starting (preloading json,gated); not serving yet: stopping it "
                             "once it serves\n"), said
    finally:
        gate.write_text("")
    out, err = stop.communicate(timeout=120)
    serve.communicate(timeout=120)
    assert stop.returncode == 0 and "stopped pid" in out, (out, err)
    assert cli(env, "status", "--all").returncode == 1
    assert runtime_files(env) == []


# ---------------------------------------------------------------- settings errors

@pytest.mark.parametrize("variable, value, accepted", [
    ("PRELOAD_LAUNCHER", "maybe", "(use 1/0, true/false, yes/no, on/off, or suite)"),
    ("PRELOAD_LAUNCHER_IDLE_TIMEOUT_S", "abc", "(a number, at least 0)"),
    ("PRELOAD_LAUNCHER_MODULES", "torch,9lives", "(comma-separated module names"),
])
def test_a_bad_setting_is_one_line_and_exit_2_from_every_verb(env, tmp_path, variable, value,
                                                               accepted):
    marker = tmp_path / "ran"
    bad = dict(env, **{variable: value})
    for args in (["run", "--", PY, "-c", f"open({str(marker)!r}, 'w')"], ["status"], ["doctor"]):
        out = cli(bad, *args)
        assert out.returncode == 2, out
        assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
        assert variable in out.stderr and accepted in out.stderr, out.stderr
    assert not marker.exists()  # the command did not run with a setting the launcher refused
    with pytest.raises(ValueError, match=variable):  # the library's error stays a ValueError
        from preload_launcher.settings import Settings
        Settings.from_env({variable: value})


def test_a_bad_setting_is_a_usage_error_of_a_pytest_session(pytester, monkeypatch):
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    monkeypatch.setenv("PRELOAD_LAUNCHER", "maybe")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = result.stderr.str()
    assert "PRELOAD_LAUNCHER environment variable" in errors and "Traceback" not in errors
    assert "INTERNALERROR" not in result.stdout.str() + errors


# ---------------------------------------------------------------- modules that cannot be imported

def test_run_v_reports_a_named_module_that_cannot_be_imported(env):
    named = dict(env, PRELOAD_LAUNCHER_MODULES="json,not_a_module")
    out = cli(named, "run", "-v", "--no-daemon", "--", PY, "-c", "print('ran')")
    assert out.returncode == 0 and out.stdout == "ran\n"
    assert ("[preload-launcher] not importable: not_a_module (ModuleNotFoundError: No module "
            "named 'not_a_module'), named in PRELOAD_LAUNCHER_MODULES") in out.stderr, out.stderr


def test_a_default_module_that_is_not_installed_is_left_out_of_every_summary():
    missing = {"module": "megatron.bridge", "ok": False, "missing": "megatron.bridge",
               "error": "ModuleNotFoundError: No module named 'megatron.bridge'"}
    absent = dict(missing, module="not_a_module", missing="not_a_module",
                  error="ModuleNotFoundError: No module named 'not_a_module'")
    broken = {"module": "broken", "ok": False, "missing": "",
              "error": "RuntimeError: boom"}
    report = {"entries": [{"module": "torch", "ok": True}, missing, broken]}
    assert preload_problems(report) == ["failed to import: broken (RuntimeError: boom)"]
    assert preload_problems({"entries": [absent]}, "--preload") == [
        "not importable: not_a_module (ModuleNotFoundError: No module named 'not_a_module'), "
        "named in --preload"]
    assert entry_result(missing) == "not installed (skipped)"  # doctor's row says it once
    loaded = {"entries": [{"module": "torch", "ok": True}, missing], "quarantined": {},
              "loaded": ["torch"], "requested": ["torch", "megatron.bridge"]}
    assert doctor_verdict(loaded) == ("doctor: OK: 1 of 2 preloaded", 0)
    assert doctor_verdict(loaded, "--preload") == (
        "doctor: OK: 1 of 2 preloaded; not installed (skipped): megatron.bridge", 0)
    assert entry_result(broken) == "FAILED: RuntimeError: boom"


def test_doctor_row_and_summary_agree_on_a_module_that_is_not_installed(env):
    out = cli(env, "doctor", "--preload", "json,not_installed_here")
    assert out.returncode == 0, out
    row = next(line for line in out.stdout.splitlines() if line.startswith("not_installed_here"))
    assert row.endswith("not installed (skipped)"), row
    assert out.stdout.splitlines()[-1].endswith("not installed (skipped): not_installed_here")


def test_the_pytest_summary_names_a_module_the_ini_named_that_cannot_be_imported(pytester,
                                                                                 monkeypatch):
    monkeypatch.delenv("PRELOAD_LAUNCHER_MODULES", raising=False)
    pytester.makeini("[pytest]\npreload_launcher_modules = json,not_a_module\n")
    pytester.makepyfile(test_step="""
        import sys, preload_launcher
        def test_step():
            assert preload_launcher.run([sys.executable, "-c", "pass"]).via == "zygote"
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*not importable: not_a_module (ModuleNotFoundError: No module "
                                 "named 'not_a_module'), named in the preload_launcher_modules "
                                 "ini option*"])


# ---------------------------------------------------------------- the daemons `run` starts

def test_no_daemon_after_a_command_that_failed_to_start_or_was_quick(env, tmp_path):
    typo = cli(env, "run", "--", PY, str(tmp_path / "nonexistent.py"))
    fresh = subprocess.run([PY, str(tmp_path / "nonexistent.py")], capture_output=True, text=True)
    assert (typo.returncode, typo.stdout, typo.stderr) == (2, "", fresh.stderr)
    quick = cli(env, "run", "-v", "--", PY, "-c", "pass")
    assert quick.returncode == 0 and "none started (the command used" in quick.stderr
    missing = cli(env, "run", "--", "no-such-program-here")
    # as env(1) starts a command: 127, or 126 where PATH names a folder this user cannot search
    assert missing.returncode == subprocess.run(["env", "no-such-program-here"], env=env,
                                                capture_output=True).returncode
    assert runtime_files(env) == []  # no daemon, and none starting
    assert cli(env, "status", "--all").returncode == 1


def test_a_daemon_is_worth_starting_after_a_second_of_cpu_only():
    assert worth_a_daemon(0, 1.5) == (True, "")
    assert worth_a_daemon(1, 1.5) == (True, "")  # a failing test step still gains from one
    assert worth_a_daemon(0, 0.2)[0] is False
    assert worth_a_daemon(127, 5.0) == (False, "the command could not be started")
    assert worth_a_daemon(126, 5.0)[0] is False


def test_a_daemon_run_starts_on_its_own_prewarms_no_gpu(monkeypatch):
    monkeypatch.setattr(cuda, "nvml_device_count", lambda env: 2)  # a machine with two GPUs
    monkeypatch.delenv("PRELOAD_LAUNCHER_PREWARM", raising=False)

    def prewarm(environ, **kwargs):
        z = ZygoteProcess(["json"], environ, daemon=True, **kwargs)
        return z.config(-1, -1, -1).prewarm

    assert prewarm(os.environ) is True  # `serve`: warm where there are GPUs
    assert prewarm(os.environ, implicit=True) is False  # started by `run`: no GPU memory held
    assert prewarm(dict(os.environ, PRELOAD_LAUNCHER_PREWARM="1"), implicit=True) is True


@pytest.fixture
def daemon_starts(env, monkeypatch):
    """The command lines of the background daemons started meanwhile (none really starts);
    the 'starting' file a start leaves for the next caller is removed at the end."""
    from preload_launcher.front import daemon
    started = []

    class Started:
        pid, returncode = 1, None

    monkeypatch.setattr(daemon.subprocess, "Popen", lambda args, **kw: started.append(args) or Started())
    yield started
    os.unlink(daemon.starting_file(["json"]))


def test_run_starts_its_daemon_as_an_implicit_one(daemon_starts):
    """The background `serve` that `run` starts is told that the user did not ask for it."""
    from preload_launcher.front import daemon
    assert daemon.spawn_daemon(["json"])
    assert daemon_starts and daemon_starts[0][3:6] == ["serve", "--detach", "--implicit"], \
        daemon_starts


def test_the_daemon_a_pytest_run_starts_preloads_as_pytest_runs(daemon_starts):
    """After a plain `run -- pytest`, the daemon for the next one is a `serve --pytest`."""
    from preload_launcher.front import cli_run
    cli_run._after_plain(argparse.Namespace(verbose=False, command=[sys.executable, "-m",
                                                                    "pytest", "-q"]),
                         ["json"], 0, 0, 2.0)
    assert daemon_starts and "--pytest" in daemon_starts[0], daemon_starts


# ---------------------------------------------------------------- one interpreter, one identity

KEYS = ("from preload_launcher.front import daemon_files; "
        "from preload_launcher.zygote import learn, verdicts; import json, sys; "
        "print(json.dumps([daemon_files.daemon_paths(['json'])[0], learn.profile_key('/p'), "
        "verdicts.package_fingerprint(sys.path[1:])]))")


def keys_under(python: str, environ) -> list[str]:
    out = subprocess.run([python, "-c", KEYS], env=environ, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def test_every_name_of_one_interpreter_shares_its_keys_and_a_venv_does_not(env, tmp_path):
    other = another_name(PY, tmp_path)
    assert other != PY
    mine = keys_under(PY, env)
    assert keys_under(other, env) == mine
    subprocess.run([PY, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(tmp_path / "venv")], check=True)
    venv = keys_under(str(tmp_path / "venv" / "bin" / "python"), env)
    assert all(a != b for a, b in zip(venv, mine)), (venv, mine)


def test_a_profile_written_under_another_name_has_the_session_learned(env, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    session = ("import sys; from preload_launcher import Launcher\n"
               "launcher = Launcher(['json'])\n"
               "result = launcher.run([sys.executable, '-c', 'import colorsys'])\n"
               "launcher.close()\n"
               "assert result.via == 'zygote', result\n")
    subprocess.run([PY, "-c", session], env=env, cwd=project, check=True)
    out = cli(env, "profile", "--write", str(tmp_path / "p.json"), python=another_name(PY, tmp_path),
              cwd=project)
    assert out.returncode == 0, out
    profile = json.loads((tmp_path / "p.json").read_text())
    assert "colorsys" in profile["learned"], (out.stdout, profile)
    assert profile["fingerprint"] == keys_under(PY, env)[2]
    assert "found" in out.stdout and "learned profile" in out.stdout and "warning" not in out.stderr


def test_profile_warns_when_it_writes_an_empty_profile(env, tmp_path):
    out = cli(env, "profile", "--write", str(tmp_path / "p.json"), cwd=tmp_path)
    assert out.returncode == 0
    assert "warning:" in out.stderr and "is empty" in out.stderr, out.stderr


def test_a_daemon_the_console_script_started_is_seen_by_python_m(env, tmp_path):
    script = tmp_path / "preload-launcher"
    script.write_text(f"#!{another_name(PY, tmp_path)}\nimport sys\n"
                      "from preload_launcher.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    started = subprocess.run([str(script), "serve", "--detach"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert started.returncode == 0, started
    status = cli(env, "status", "--json")
    assert status.returncode == 0, status
    pid = json.loads(status.stdout)["pid"]
    run = cli(env, "run", "-v", "--", PY, "-c", "print('hi')")
    assert run.stdout == "hi\n" and f"the daemon (pid {pid})" in run.stderr
    stop = cli(env, "stop")
    assert stop.returncode == 0 and f"stopped pid {pid}" in stop.stdout
    assert wait_gone(pid)
