"""What a zygote learned while idle never changes a later step: an edited learned module is
seen as edited, a learned module's environment reads are checked as the preload's are, and the
test runner's own modules are never learned. Differential: the two steps of each case in
``programs/learned_cases.py`` plainly, then through ``run()``, the CLI's warm daemon and the
suite switch (which forks a nested pytest too)."""
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from preload_launcher import Launcher

from conftest import PROGRAMS, PY

sys.path.insert(0, PROGRAMS)
import learned_cases  # noqa: E402
from learned_cases import CASES, scenario, wait_settled  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# hf_offline imports huggingface_hub, which the core suite's other Pythons lack.
HAVE_HUB = importlib.util.find_spec("huggingface_hub") is not None
CASE_PARAMS = [pytest.param(case, marks=pytest.mark.skipif(
    case == "hf_offline" and not HAVE_HUB, reason="needs huggingface_hub")) for case in CASES]


@pytest.fixture
def case_env(tmp_path, runtime_base):
    """(root of the case's files, the steps' environment): learning on, this checkout's
    launcher, a runtime directory short enough for a daemon's socket."""
    (tmp_path / "proj").mkdir()
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime_base), PRELOAD_LAUNCHER_MODULES="json",
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), REPO]))
    for key in ("PRELOAD_LAUNCHER_LEARN", "PRELOAD_LAUNCHER", "HF_HUB_OFFLINE", "HF_HOME"):
        env.pop(key, None)
    yield str(tmp_path), env
    subprocess.run([PY, "-m", "preload_launcher.cli", "stop", "--all"], env=env,
                   capture_output=True)


def plain_steps(root: str, env: dict, case: str) -> list:
    def step(args, step_env):
        done = subprocess.run(args, env=step_env, cwd=os.path.join(root, "proj"),
                              capture_output=True, text=True, timeout=300)
        return done.returncode, done.stdout + done.stderr
    return scenario(case, root, env, step, settle=lambda: None)


def launcher_steps(root: str, env: dict, case: str) -> tuple[list, dict]:
    """Through ``run()``: (what the steps printed, the first zygote's status after learning)."""
    launcher = Launcher(["json"], project=os.path.join(root, "proj"))
    learned = {}

    def step(args, step_env):
        result = launcher.run(args, env=step_env, cwd=os.path.join(root, "proj"), timeout=300)
        assert result.via == "zygote" or learned, result.reason  # the first one is forked
        return result.returncode, result.stdout

    def settle():
        wait_settled(lambda: launcher.zygotes[0].request("status"))
        learned.update(launcher.zygotes[0].request("status"))
    try:
        return scenario(case, root, env, step, settle), learned
    finally:
        launcher.close()


def cli_steps(root: str, env: dict, case: str) -> tuple[list, dict]:
    """Through ``preload-launcher run`` and the daemon the first one starts."""
    learned = {}

    def cli(args, step_env):
        return subprocess.run([PY, "-m", "preload_launcher.cli", *args], env=step_env,
                              cwd=os.path.join(root, "proj"), capture_output=True, text=True,
                              timeout=300)

    def step(args, step_env):
        if not learned:
            assert cli(["serve", "--detach"], step_env).returncode == 0
            learned["env"] = step_env
        done = cli(["run", "--", *args], step_env)
        own = [line for line in done.stderr.splitlines(keepends=True)
               if not line.startswith(("preload_launcher:", "preload-launcher:"))]
        return done.returncode, done.stdout + "".join(own)

    def settle():
        wait_settled(lambda: json.loads(cli(["status", "--json"], learned["env"]).stdout))
        learned.update(json.loads(cli(["status", "--json"], learned["env"]).stdout))
    return scenario(case, root, env, step, settle), learned


SWITCHED_TEST = """
import json, os, subprocess, sys
sys.path.insert(0, {programs!r})
import learned_cases


def test_case(preload_launcher):
    switched = os.environ["PRELOAD_LAUNCHER"] == "suite"
    if switched:  # a stand-in asks only a zygote that serves: the first step must be forked
        zygote = preload_launcher.zygote_for_standins(dict(os.environ))
        zygote.wait_ready()

    def step(args, env):
        done = subprocess.run(args, env=env, cwd={proj!r}, capture_output=True, text=True)
        return done.returncode, done.stdout + done.stderr

    def settle():
        if switched:
            learned_cases.wait_settled(lambda: zygote.request("status"))
            with open({learned!r}, "w") as f:
                json.dump(zygote.request("status"), f)
    seen = learned_cases.scenario({case!r}, {root!r}, dict(os.environ), step, settle)
    with open({result!r}, "w") as f:
        json.dump(seen, f)
"""


def switched_steps(root: str, env: dict, case: str, mode: str) -> tuple[list, dict]:
    """The steps started by a suite's test with ``subprocess.run``, under PRELOAD_LAUNCHER=mode
    (the steps' environment is the suite's, as a test's launches inherit it)."""
    suite = pathlib.Path(root) / f"switched-{mode}"
    suite.mkdir()
    result, learned = suite / "seen.json", suite / "learned.json"
    (suite / "test_switched.py").write_text(SWITCHED_TEST.format(
        programs=PROGRAMS, proj=os.path.join(root, "proj"), case=case, root=root,
        result=str(result), learned=str(learned)))
    (suite / "pytest.ini").write_text("[pytest]\n")
    learned_cases.prepare(case, root)  # the site folder exists before the zygote starts
    done = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                          env=dict(env, PRELOAD_LAUNCHER=mode), cwd=str(suite),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return ([tuple(s) for s in json.loads(result.read_text())],
            json.loads(learned.read_text()) if learned.exists() else {})


def assert_steps_as_plain(case_env: tuple, case: str, steps) -> None:
    """The case's steps through ``steps`` (``launcher_steps``, ``cli_steps``) print what they
    print plainly, and the zygote learned from the first."""
    root, env = case_env
    forked, status = steps(root, env, case)
    shutil.rmtree(os.path.join(root, "site"), ignore_errors=True)
    assert forked == plain_steps(root, env, case)
    assert_learned(case, status)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_a_step_after_learning_is_a_fresh_interpreters_through_run(case_env, case):
    assert_steps_as_plain(case_env, case, launcher_steps)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_a_step_after_learning_is_a_fresh_interpreters_through_the_daemon(case_env, case):
    assert_steps_as_plain(case_env, case, cli_steps)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_a_step_after_learning_is_a_fresh_interpreters_under_the_suite_switch(case_env, case):
    root, env = case_env
    forked, status = switched_steps(root, env, case, "suite")
    shutil.rmtree(os.path.join(root, "site"), ignore_errors=True)
    plain, _ = switched_steps(root, env, case, "0")
    assert forked == plain
    assert_learned(case, status)
    assert status["standin_steps"] >= 1


def assert_learned(case: str, status: dict) -> None:
    """The zygote did learn from the first step (else the case tested nothing), and never the
    test runner's modules."""
    learned = status["preload"]["learned"]
    assert learned.get("in_session", 0) >= 1, learned
    profile = json.loads(pathlib.Path(learned["profile"]).read_text())
    wanted = {"edited": "learned_mod", "edited_dependency": "learned_dep", "env": "env_mod",
              "hf_offline": "huggingface_hub"}.get(case)
    learned_now = {m for m, info in profile["modules"].items() if info["seconds"] is not None}
    assert wanted in learned_now if wanted else learned_now, profile["modules"]
    runner = {"pytest", "_pytest", "pluggy", "xdist", "pytest_timeout", "anyio"}
    assert not {m for m in profile["modules"] if m.partition(".")[0] in runner}


def test_every_module_pytest_would_rewrite_is_never_learned():
    """The rule is pytest's own: whatever it marks for rewriting at start-up (every ``pytest11``
    distribution's top-level modules and packages) is among the modules never learned."""
    from importlib.metadata import distributions

    from _pytest.config import _iter_rewritable_modules

    from preload_launcher.zygote.learn import test_runner_modules
    marked = set()
    for dist in distributions():
        if any(ep.group == "pytest11" for ep in dist.entry_points):
            marked |= set(_iter_rewritable_modules(str(f) for f in dist.files or ()))
    assert {"xdist", "pytest_timeout"} <= marked  # installed with the suite: the test can fail
    assert marked <= test_runner_modules()
    assert {"pytest", "_pytest", "pluggy"} <= test_runner_modules()


def test_status_says_a_zygote_whose_learned_module_changed_is_stale(case_env):
    root, env = case_env
    launcher = Launcher(["json"], project=os.path.join(root, "proj"))
    try:
        launcher_run = lambda args, step_env: launcher.run(  # noqa: E731
            args, env=step_env, cwd=os.path.join(root, "proj")).stdout
        args, _, _ = learned_cases.prepare("edited", root)
        assert launcher_run(args, env) == "old\n"
        zygote = launcher.zygotes[0]
        wait_settled(lambda: zygote.request("status"))
        assert zygote.request("status")["stale"] == []
        learned_cases.change("edited", root)
        assert zygote.request("status")["stale"] == [os.path.join(root, "site", "learned_mod.py")]
    finally:
        launcher.close()
