"""Learned preload: steps teach the next zygote what to import."""
import json
import os
import subprocess
import time

import pytest

from preload_launcher import Launcher

from conftest import PY


@pytest.fixture
def learn_site(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    log = tmp_path / "imports.log"
    for name in ("slow_a", "slow_b"):
        (site / f"{name}.py").write_text(
            f"import time\nwith open({str(log)!r}, 'a') as f: f.write('{name}\\n')\n"
            "time.sleep(0.5)\n")  # (closed: an unclosed file warns, and is never learned)
    (site / "dirty_learned.py").write_text(
        f"import os\nwith open({str(log)!r}, 'a') as f:\n"
        "    f.write(f'dirty_learned {os.getpid()}\\n')\n"
        "from preload_launcher.cuda import fake_cuinit\nfake_cuinit()\n")
    package = site / "dirtypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "clean.py").write_text(
        f"with open({str(log)!r}, 'a') as f: f.write('dirtypkg.clean\\n')\n")
    (package / "dirty.py").write_text(
        "from preload_launcher.cuda import fake_cuinit\nfake_cuinit()\n")
    dist = site / "learnpkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: learnpkg\nVersion: 1.0\n")
    project = tmp_path / "project"
    project.mkdir()
    (project / "local_helper.py").write_text("X = 1\n")
    env = dict(os.environ, PYTHONPATH=f"{site}:{project}", PRELOAD_LAUNCHER_PROBE="fake",
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PRELOAD_LAUNCHER_LEARN", None)
    return site, project, env, log


def session(project, env, code, modules=("json",)):
    """One launcher 'session': start a zygote, run one step, close; returns (result, seconds, status)."""
    launcher = Launcher(list(modules), project=str(project))
    try:
        start = time.perf_counter()
        result = launcher.run([PY, "-c", code], env=env, cwd=str(project))
        elapsed = time.perf_counter() - start
        zygote_start = launcher.zygotes[0].status
        return result, elapsed, zygote_start
    finally:
        launcher.close()


def profile_once_learned(cache, project, module: str) -> dict:
    """The project's learned profile once a zygote has learned ``module`` (its cost recorded)."""
    from preload_launcher.zygote import learn
    deadline = time.monotonic() + 60
    while True:
        data = learn.Profile(str(cache), learn.profile_key(str(project)), str(project)).data
        if data["modules"].get(module, {}).get("seconds") is not None:
            return data
        assert time.monotonic() < deadline, f"the zygote never learned {module}"
        time.sleep(0.1)


def test_a_step_teaches_the_next_zygote(learn_site):
    site, project, env, log = learn_site
    code = "import slow_a, local_helper; print('ok')"
    first, _, status1 = session(project, env, code)
    assert first.stdout == "ok\n" and status1["preload"]["learned"]["listed"] == 0
    launcher = Launcher(["json"], project=str(project))
    try:
        zygote = launcher.zygote_for(env)
        learned = zygote.status["preload"]["learned"]
        assert learned["loaded"] >= 1
        imports = log.read_text().count("slow_a")
        again = launcher.run([PY, "-c", code], env=env, cwd=str(project))
        assert again.stdout == "ok\n"
        assert log.read_text().count("slow_a") == imports  # preloaded: the step imports nothing
    finally:
        launcher.close()
    # The first step, the second zygote and perhaps the first zygote while idle (timing).
    assert log.read_text().count("slow_a") >= 2
    profile = json.load(open(learned["profile"]))
    assert "slow_a" in profile["modules"] and profile["modules"]["slow_a"]["seconds"] >= 0.5
    assert "local_helper" not in profile["modules"]  # the project's own tree is never learned


def test_a_learned_module_that_dirties_cuda_is_quarantined_and_not_retried(learn_site):
    site, project, env, log = learn_site
    session(project, env, "import dirty_learned, slow_a")
    _, _, status = session(project, env, "pass")  # learns: a child's try finds the culprit
    learned = status["preload"]["learned"]
    assert learned["quarantined"] == ["dirty_learned"]
    assert "learned:dirty_learned" in status["preload"]["quarantined"]
    assert not status["driver_initialized"]
    # Found in the child: the zygote never ran the import itself (and so never had to restart).
    importers = [line.split()[1] for line in log.read_text().splitlines()
                 if line.startswith("dirty_learned")]
    assert str(status["pid"]) not in importers
    imports_before = log.read_text().count("dirty_learned")
    session(project, env, "pass")
    assert log.read_text().count("dirty_learned") == imports_before  # never imported again


def test_a_dirty_learned_module_rules_out_its_package_only(learn_site):
    site, project, env, log = learn_site
    session(project, env, "import dirtypkg.dirty, dirtypkg.clean, slow_a")
    imports_before = log.read_text().count("dirtypkg.clean")
    # The step imported slow_a; its zygote may also have learned it while idle before it was
    # closed (that depends on timing), so count from here: each later zygote preloads it once.
    slow_a_before = log.read_text().count("slow_a")
    _, _, status = session(project, env, "pass")
    learned = status["preload"]["learned"]
    assert learned["quarantined"] == ["dirtypkg"]
    assert learned["loaded"] >= 1  # slow_a, from another package, is still learned
    assert not status["driver_initialized"]
    session(project, env, "pass")
    # The package's clean module goes with it: importing it would run the same __init__ chain.
    assert log.read_text().count("dirtypkg.clean") == imports_before
    # Each later zygote once, and a child's try of it first (``tryout``) where the first zygote
    # had not learned it while idle.
    assert log.read_text().count("slow_a") in (slow_a_before + 2, slow_a_before + 3)


def test_a_version_change_drops_the_profile(learn_site):
    site, project, env, log = learn_site
    session(project, env, "import slow_a")
    _, _, status = session(project, env, "pass")
    assert status["preload"]["learned"]["loaded"] >= 1
    os.rename(site / "learnpkg-1.0.dist-info", site / "learnpkg-2.0.dist-info")
    (site / "learnpkg-2.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: learnpkg\nVersion: 2.0\n")
    _, _, status = session(project, env, "pass")
    assert status["preload"]["learned"]["listed"] == 0


def test_the_budget_holds(learn_site):
    site, project, env, log = learn_site
    session(project, env, "import slow_a, slow_b")
    _, _, status = session(project, dict(env, PRELOAD_LAUNCHER_LEARN_BUDGET_S="0.3"), "pass")
    learned = status["preload"]["learned"]
    assert (learned["loaded"], learned["over_budget"]) == (1, 1)


def test_learning_can_be_turned_off(learn_site):
    site, project, env, log = learn_site
    off = dict(env, PRELOAD_LAUNCHER_LEARN="0")
    session(project, off, "import slow_a")
    _, _, status = session(project, env, "pass")
    assert status["preload"]["learned"]["listed"] == 0


def test_pin_and_forget_from_the_cli(learn_site, monkeypatch, capsys):
    from preload_launcher.cli import main as cli_main
    site, project, env, log = learn_site
    session(project, env, "import slow_a, slow_b")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli_main(["learned", "--project", str(project), "--forget", "slow_b", "--pin", "json.tool"]) == 0
    out = capsys.readouterr().out
    assert "slow_a" in out and "forgotten: slow_b" in out and "pinned: json.tool" in out
    slow_a, slow_b = log.read_text().count("slow_a"), log.read_text().count("slow_b")
    _, _, status = session(project, env, "pass")
    assert log.read_text().count("slow_b") == slow_b  # forgotten: never preloaded again
    # still learned: preloaded (after a child's try of it, where the first zygote had not
    # learned it while idle)
    assert log.read_text().count("slow_a") in (slow_a + 1, slow_a + 2)


def test_idle_learning_serves_a_later_step_of_the_same_session(learn_site):
    site, project, env, log = learn_site
    launcher = Launcher(["json"], project=str(project))
    try:
        code = "import slow_a, slow_b; print('ok')"
        first = launcher.run([PY, "-c", code], env=env, cwd=str(project))
        assert first.stdout == "ok\n"
        zygote = launcher.zygotes[0]
        deadline = time.monotonic() + 60  # about a second's imports: slower under load
        while zygote.request("status")["preload"]["learned"].get("in_session", 0) < 2:
            assert time.monotonic() < deadline, "the zygote did not learn while idle"
            time.sleep(0.1)
        second = launcher.run([PY, "-c", code], env=env, cwd=str(project))
        assert second.stdout == "ok\n"
        # the first step, a child of the zygote trying it, then the zygote: not the second
        # step, which found both preloaded
        assert log.read_text().count("slow_a") == log.read_text().count("slow_b") == 3
    finally:
        launcher.close()


def test_a_module_whose_import_warns_or_prints_is_never_learned(tmp_path):
    """Differential: `-W error::DeprecationWarning` fails on the import as in a fresh
    interpreter, and the import's output is printed by the step, after the zygote learned."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "warns_mod.py").write_text("import warnings\nwarnings.warn('old', DeprecationWarning)\n")
    (site / "chatty.py").write_text("print('hello from chatty')\n")
    (site / "quiet_mod.py").write_text("X = 1\n")
    project = tmp_path / "project"
    project.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PRELOAD_LAUNCHER_LEARN", None)
    strict = [PY, "-W", "error::DeprecationWarning", "-c", "import warns_mod"]
    from conftest import plain
    launcher = Launcher(["json"], project=str(project))
    try:
        launcher.run([PY, "-c", "import warns_mod, chatty, quiet_mod"], env=env, cwd=str(project))
        # the zygote learns while idle: quiet_mod comes last, in the same pass
        data = profile_once_learned(tmp_path / "cache", project, "quiet_mod")
        for args in (strict, [PY, "-c", "import chatty"]):
            fresh = plain(args, env=env, cwd=str(project))
            forked = launcher.run(args, env=env, cwd=str(project))
            assert forked.via == "zygote"
            assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
        assert fresh.stdout == "hello from chatty\n"
        assert set(data["unlearnable"]) == {"warns_mod", "chatty"}
    finally:
        launcher.close()
    # The next zygote does not preload them either.
    again = Launcher(["json"], project=str(project))
    try:
        fresh, forked = plain(strict, env=env, cwd=str(project)), again.run(strict, env=env,
                                                                             cwd=str(project))
        assert fresh.returncode == forked.returncode == 1 and forked.via == "zygote"
    finally:
        again.close()


def test_a_module_that_is_not_learned_left_nothing_of_its_import_in_the_zygote(tmp_path):
    """Differential: a learned module is imported in a child of the zygote first, so one the
    zygote may not keep (its import warns) never ran there: what its import did to a preloaded
    module (an entry in its registry, as modelopt's export modules register their modes in
    modelopt.torch.opt's) is in no step, as in a fresh interpreter that did not import it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "registry.py").write_text("ENTRIES = []\n")
    (site / "noisy.py").write_text("import registry, warnings\nregistry.ENTRIES.append('noisy')\n"
                                   "warnings.warn('old', DeprecationWarning)\n")
    (site / "quiet_mod.py").write_text("X = 1\n")
    project = tmp_path / "project"
    project.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PRELOAD_LAUNCHER_LEARN", None)
    from conftest import plain
    launcher = Launcher(["json", "registry"], project=str(project))
    try:
        launcher.run([PY, "-c", "import noisy, quiet_mod"], env=env, cwd=str(project))
        # the zygote learns while idle: quiet_mod comes after noisy, in one pass
        data = profile_once_learned(tmp_path / "cache", project, "quiet_mod")
        assert set(data["unlearnable"]) == {"noisy"}
        args = [PY, "-c", "import registry; print(registry.ENTRIES)"]
        fresh, forked = plain(args, env=env, cwd=str(project)), launcher.run(
            args, env=env, cwd=str(project))
        assert forked.via == "zygote"
        assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout) == (0, "[]\n")
    finally:
        launcher.close()


# Runs in the virtualenv's interpreter: one session whose step imports a package installed in
# the virtualenv and a module of the project, then prints what the project's profile holds.
IN_THE_VIRTUALENV = """
import json, os, sys
from preload_launcher import Launcher
from preload_launcher.zygote import learn
project, cache = sys.argv[1], os.environ["PRELOAD_LAUNCHER_CACHE_DIR"]
launcher = Launcher(["json"], project=project)
try:
    done = launcher.run([sys.executable, "-c", "import venv_installed, local_helper"],
                        env=dict(os.environ), cwd=project)
    assert done.returncode == 0 and done.via == "zygote", (done.via, done.stderr)
finally:
    launcher.close()
# What the step reported, folded in here (a zygote ended at once may not have read it yet)
profile = learn.Profile(cache, learn.profile_key(project), project)
profile.merge_reports()
print(json.dumps(sorted(profile.data["modules"])))
"""


def test_packages_installed_in_a_virtualenv_inside_the_project_are_learned(tmp_path):
    """A project's own ``.venv`` (uv's and poetry's default place) holds installed packages, not
    the project's code: they are learned like any installed package (none was: everything
    under the project folder counted as its own). The project's own modules still are not."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "local_helper.py").write_text("X = 1\n")
    venv = project / ".venv"
    subprocess.run([PY, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(purelib, "venv_installed.py"), "w") as f:
        f.write("X = 1\n")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's package
    env = dict(os.environ, PYTHONPATH=here, PRELOAD_LAUNCHER_PROBE="fake",
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PRELOAD_LAUNCHER_LEARN", None)
    done = subprocess.run([python, "-c", IN_THE_VIRTUALENV, str(project)], env=env, cwd=project,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    learned = json.loads(done.stdout)
    assert "venv_installed" in learned and "local_helper" not in learned, learned
