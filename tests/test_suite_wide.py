"""Suite-wide serving (PRELOAD_LAUNCHER=suite): the interpreters a suite's tests start
themselves, in every way they start them, are forked by the session's zygote and see what
they would see started plainly. Differential: one suite run with the launcher off and
suite-wide, every program's view compared."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import program

WAYS = ["sys_executable", "name_on_path", "os_system", "shell_script", "popen_signal",
        "timeout", "asyncio", "os_popen", "multiprocessing_spawn", "switched_off", "venv", "pip",
        "another_interpreter", "unserved_option"]
SERVED = {"sys_executable", "name_on_path", "os_system", "shell_script", "asyncio", "os_popen",
          "multiprocessing_spawn"}


def other_python() -> str:
    """An interpreter other than this one (pyenv's), if the machine has one."""
    for version in ("3.12", "3.10", "3.13", "3.11"):
        found = shutil.which(f"python{version}")
        if found and os.path.realpath(found) != os.path.realpath(sys.executable):
            return found
    return ""


def run_suite(tmp_path, mode: str, *extra: str):
    """The suite in ``suite_ways.py`` under ``PRELOAD_LAUNCHER=mode``: (pytest's result,
    what each of its tests recorded)."""
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    shutil.copy(program("suite_ways.py"), suite / "test_ways.py")
    results = tmp_path / f"results-{mode}"
    results.mkdir()
    # This interpreter's folder first on PATH, as an activated virtualenv has it: `python3`
    # names this interpreter.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = dict(os.environ, PATH=path, PRELOAD_LAUNCHER=mode, PRELOAD_LAUNCHER_MODULES="colorsys",
               SUITE_PROBE=program("suite_probe.py"), SUITE_RESULTS=str(results),
               SUITE_OTHER_PYTHON=other_python())
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *extra, "test_ways.py"], cwd=suite, env=env, text=True,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
    return done, {p.stem: json.loads(p.read_text()) for p in results.glob("*.json")}


def views(recorded: dict) -> dict:
    """What each test recorded, without whether its programs were forked."""
    return {name: {**seen, "seen": [{k: v for k, v in s.items() if k != "forked"}
                                     for s in seen.get("seen", [])]}
            for name, seen in recorded.items()}


def forked(recorded: dict) -> dict:
    return {name: [s["forked"] for s in seen.get("seen", [])] for name, seen in recorded.items()}


def test_every_way_a_test_starts_python_is_served_and_reads_as_plain(tmp_path):
    plain_run, plain = run_suite(tmp_path, "0")
    suite_run, served = run_suite(tmp_path, "suite")
    assert plain_run.returncode == 0, plain_run.stdout + plain_run.stderr
    assert suite_run.returncode == 0, suite_run.stdout + suite_run.stderr
    expected = WAYS if other_python() else [w for w in WAYS if w != "another_interpreter"]
    assert sorted(plain) == sorted(served) == sorted(expected)
    assert views(served) == views(plain)
    assert all(not any(f) for f in forked(plain).values())
    for name in SERVED:
        assert forked(served)[name] and all(forked(served)[name]), name
    assert forked(served)["switched_off"] == forked(served)["unserved_option"] == [False]
    assert "suite-wide: the tests started" in suite_run.stdout
    assert "1 ran the real program because python option -E is not served" in suite_run.stdout


def test_under_xdist_the_workers_launches_are_served_by_the_controllers_zygote(tmp_path):
    plain_run, plain = run_suite(tmp_path, "0", "-n", "2")
    suite_run, served = run_suite(tmp_path, "suite", "-n", "2")
    assert plain_run.returncode == 0, plain_run.stdout + plain_run.stderr
    assert suite_run.returncode == 0, suite_run.stdout + suite_run.stderr
    assert views(served) == views(plain)
    for name in SERVED:
        assert forked(served)[name] and all(forked(served)[name]), (name, suite_run.stdout)
    # The controller adds up what each worker's tests started.
    counted = [line for line in suite_run.stdout.splitlines() if "suite-wide:" in line]
    assert counted and "started 0 interpreters" not in counted[0], suite_run.stdout


def test_switched_off_the_suite_starts_plain_programs(tmp_path):
    """PRELOAD_LAUNCHER=1 (not suite): what tests start themselves is left alone."""
    done, recorded = run_suite(tmp_path, "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(not any(f) for f in forked(recorded).values())
    assert "suite-wide" not in done.stdout


@pytest.mark.parametrize("mode, extra, served", [
    ("1", ["--preload-launcher-suite"], True),
    ("1", ["-o", "preload_launcher_suite=true"], True),
    ("0", ["--preload-launcher-suite"], False),  # the variable wins: off
])
def test_the_option_and_the_ini_key_switch_it_too(tmp_path, mode, extra, served):
    done, recorded = run_suite(tmp_path, mode, *extra)
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(all(forked(recorded)[name]) == served and forked(recorded)[name]
               for name in SERVED), forked(recorded)
