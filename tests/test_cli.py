"""What a new user meets: help, --version, and messages that name the cause and the next step."""
import argparse
import os
import subprocess
import time

import pytest

from preload_launcher.cli import build_parser

from conftest import PY

CLI = [PY, "-m", "preload_launcher.cli"]
# A step worth a daemon: `run` starts none after a command that used under a second of CPU
# (read while it runs: its last moments may go uncounted, hence the margin).
BUSY = "import sys, time\nwhile time.process_time() < 1.3:\n    pass\n"


def cli(*args, env=None, timeout=120):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture
def runtime(runtime_base):
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime_base), PRELOAD_LAUNCHER_MODULES="json")
    yield env
    cli("stop", "--all", env=env)


def test_version_and_usage_on_a_bare_call():
    from preload_launcher import __version__
    out = cli("--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"preload-launcher {__version__}")
    bare = cli()
    assert bare.returncode == 2 and "usage: preload-launcher" in bare.stderr
    assert "run       run one command" in bare.stderr


def test_every_verb_and_option_is_described():
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    undescribed = []
    for name, sub in verbs.choices.items():
        if not sub.description:
            undescribed.append(name)
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction) and not action.help:
                undescribed.append(f"{name} {action.dest}")
    assert not undescribed, undescribed
    run_help = verbs.choices["run"].format_help()
    assert "--timeout SECONDS" in run_help and "exit status 124" in run_help


def test_stop_and_status_say_why_there_is_nothing(runtime):
    for verb in ("stop", "status"):
        out = cli(verb, env=runtime)
        assert out.returncode == 1
        assert "none is running" in out.stderr or "no daemon is running" in out.stderr, out.stderr
    assert cli("serve", "--detach", "--preload", "json,logging", env=runtime).returncode == 0
    for verb in ("stop", "status"):  # PRELOAD_LAUNCHER_MODULES names json only
        out = cli(verb, env=runtime)
        assert out.returncode == 1
        assert "no daemon preloads json; running: pid" in out.stderr and "json,logging" in out.stderr
        assert "--preload MODULES or --all" in out.stderr
    for choice in (["--all"], ["--preload", "json,logging"]):
        status = cli("status", *choice, env=runtime)
        assert status.returncode == 0 and "preloaded: json, logging" in status.stdout
    assert cli("stop", "--preload", "json,logging", env=runtime).returncode == 0


def test_a_one_off_run_is_a_plain_process_that_starts_a_daemon_for_the_next(runtime, tmp_path):
    step = tmp_path / "step.py"
    step.write_text(BUSY + "print('hello from', sys.argv[1]); sys.exit(3)\n")
    first = cli("run", "-v", "--", PY, str(step), "one", env=runtime)
    assert (first.returncode, first.stdout) == (3, "hello from one\n")
    assert "ran through a plain process: no daemon preloaded json yet" in first.stderr
    assert ("started a daemon preloading json in the background" in first.stderr
            and "It stops after 30 idle minutes; `preload-launcher stop` stops it now"
            in first.stderr), first.stderr
    deadline = time.monotonic() + 60
    while cli("status", env=runtime).returncode != 0:
        assert time.monotonic() < deadline, "no daemon started"
        time.sleep(0.2)
    second = cli("run", "-v", "--", PY, str(step), "two", env=runtime)
    assert (second.returncode, second.stdout) == (3, "hello from two\n")
    assert "ran through the daemon (pid" in second.stderr and "via zygote" in second.stderr


def test_a_runtime_dir_too_long_for_sockets_falls_back_or_says_which_variable(runtime,
                                                                              runtime_base):
    """Its sockets could not be bound under a long XDG_RUNTIME_DIR: the daemon lives in the
    cache's short fallback instead (said once per command); when that is long too, every verb
    says so in one line naming the variable to set, and `run` runs the command plainly."""
    long_base = runtime_base / ("x" * 90)
    long_base.mkdir(mode=0o700)
    env = dict(runtime, XDG_RUNTIME_DIR=str(long_base),
               PRELOAD_LAUNCHER_CACHE_DIR=str(runtime_base / "cache"))
    try:
        serve = cli("serve", "--detach", env=env)
        assert serve.returncode == 0, serve.stderr
        assert "is too long to hold Unix sockets" in serve.stderr
        assert "set XDG_RUNTIME_DIR to a shorter directory" in serve.stderr
        served = cli("run", "-v", "--", PY, "-c", "print('served')", env=env)
        assert served.stdout == "served\n" and "ran through the daemon (pid" in served.stderr
    finally:
        assert cli("stop", env=env).returncode == 0
    env["PRELOAD_LAUNCHER_CACHE_DIR"] = str(long_base / "cache")
    for verb in ("serve", "status", "stop"):
        said = cli(verb, "--detach", env=env) if verb == "serve" else cli(verb, env=env)
        assert said.returncode == 1 and said.stderr.startswith(
            f"preload-launcher {verb}: no private runtime directory"), said.stderr
        assert said.stderr.rstrip().endswith("(set XDG_RUNTIME_DIR to a shorter directory)")
        assert len(said.stderr.splitlines()) == 1, said.stderr
    plain = cli("run", "-v", "--", PY, "-c", "print('plain')", env=env)
    assert (plain.returncode, plain.stdout) == (0, "plain\n")
    assert "running the command as a plain process" in plain.stderr
    assert "started a daemon" not in plain.stderr
    assert list(long_base.iterdir()) == []  # nothing half-made (no stale lock, no socket)


def test_autoserve_off_runs_a_one_off_zygote(runtime, tmp_path):
    env = dict(runtime, PRELOAD_LAUNCHER_AUTOSERVE="0")
    out = cli("run", "-v", "--", PY, "-c", "print('x')", env=env)
    assert out.returncode == 0 and "ran through a one-off zygote, via zygote" in out.stderr
    assert cli("status", env=env).returncode == 1  # and no daemon was started


def test_an_idle_daemon_stops_and_takes_its_files(runtime):
    assert cli("serve", "--detach", "--idle-timeout", "1", env=runtime).returncode == 0
    directory = os.path.join(runtime["XDG_RUNTIME_DIR"], f"preload_launcher-{os.getuid()}")
    deadline = time.monotonic() + 60  # 1 s idle, then its end: later under load
    while os.listdir(directory):
        assert time.monotonic() < deadline, os.listdir(directory)
        time.sleep(0.2)
    assert cli("status", env=runtime).returncode == 1


def test_doctor_fails_on_a_quarantine_and_warns_on_a_missing_module(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "culprit.py").write_text("from preload_launcher.cuda import fake_cuinit\nfake_cuinit()\n")
    env = dict(os.environ, PYTHONPATH=str(site), PRELOAD_LAUNCHER_PROBE="fake",
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    ok = cli("doctor", "--preload", "json,not_installed_here", env=env)
    assert ok.returncode == 0
    assert ok.stdout.splitlines()[-1] == ("doctor: OK: 1 of 2 preloaded; not installed "
                                          "(skipped): not_installed_here")
    bad = cli("doctor", "--preload", "json,culprit", env=env)
    assert bad.returncode == 1
    assert bad.stdout.splitlines()[-1].startswith("doctor: FAIL: quarantined: culprit (")


def test_preload_progress_shows_on_a_terminal_only(tmp_path):
    import io
    from preload_launcher import ZygoteProcess
    shown = io.StringIO()
    ZygoteProcess(["json", "logging"], dict(os.environ)).start(progress=shown).close()
    assert shown.getvalue() == "  json…\n  logging…\n"
    quiet = cli("doctor", "--preload", "json")  # stderr is a pipe here: no progress lines
    assert quiet.returncode == 0 and "json…" not in quiet.stderr


def test_stop_right_after_a_one_off_run_stops_the_daemon_it_started(runtime):
    assert cli("run", "--", PY, "-c", BUSY, env=runtime).returncode == 0  # starts one
    stop = cli("stop", env=runtime)
    assert stop.returncode == 0 and "stopped pid" in stop.stdout, stop.stderr
    assert cli("status", env=runtime).returncode == 1
    directory = os.path.join(runtime["XDG_RUNTIME_DIR"], f"preload_launcher-{os.getuid()}")
    assert os.listdir(directory) == []
