"""Surgical quarantine with fake packages shaped like modelopt -> torch_geometric: the culprit's
package is deferred, the entry stays preloaded, and steps see what a fresh interpreter sees."""
import json
import os
import textwrap
import time

import pytest

from preload_launcher import Launcher, ZygoteProcess

from conftest import PY, plain

FILES = {
    # modelopt's shape: a registry, and plugins imported under a guard.
    "fakeopt/__init__.py": "from . import plugins\n",
    "fakeopt/registry.py": "REGISTRY = {'Linear': 'torch'}\n",
    "fakeopt/plugins/__init__.py": """
        try:
            from .geo import *
        except ModuleNotFoundError:
            pass
    """,
    "fakeopt/plugins/geo.py": """
        import fakegeo
        from fakeopt.registry import REGISTRY
        REGISTRY['GeoLinear'] = fakegeo.Linear.__name__
        __all__ = ['GeoQuantLinear']
        class GeoQuantLinear:
            pass
    """,
    # torch_geometric's shape: its import initialises the driver.
    "fakegeo/__init__.py": "from .typing import Linear\n",
    "fakegeo/typing.py": """
        from preload_launcher.cuda import fake_cuinit
        open(LOG, 'a').write('fakegeo imported\\n')
        fake_cuinit()
        class Linear:
            pass
    """,
    # An importer without a guard: it cannot do without the culprit.
    "needsgeo/__init__.py": "import fakegeo\nVALUE = 7\n",
    # megatron.bridge's shape: it reaches fakeopt (itself a preload entry) under a guard.
    "fakebridge/__init__.py": """
        try:
            import fakeopt
            HAVE_OPT = True
        except ModuleNotFoundError:
            HAVE_OPT = False
    """,
}

OBSERVE = ("import sys, fakeopt, fakeopt.plugins as p; from fakeopt.registry import REGISTRY; "
           "print(sorted(REGISTRY), hasattr(p, 'GeoQuantLinear'), hasattr(p, 'geo'), "
           "'fakegeo' in sys.modules)")


@pytest.fixture
def site(tmp_path):
    root = tmp_path / "site"
    log = tmp_path / "imports.log"
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).replace("LOG", repr(str(log))))
    dist = root / "fakeopt-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeopt\nVersion: 1.0\n")
    env = dict(os.environ, PYTHONPATH=str(root), PRELOAD_LAUNCHER_PROBE="fake",
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    return env, log


def launcher_for(modules, env):
    launcher = Launcher(modules)
    launcher.zygote_for(env)
    return launcher


def status(launcher):
    return launcher.zygotes[0].status


def log_text(launcher):
    return open(launcher.zygotes[0].log_path).read()


def test_a_guarded_culprit_is_deferred_and_its_entry_preloaded(site):
    env, log = site
    launcher = launcher_for(["fakeopt"], env)
    try:
        report = status(launcher)["preload"]
        assert report["loaded"] == ["fakeopt"] and "fakeopt" not in report["quarantined"]
        deferred = report["deferred"]["fakegeo"]
        assert deferred["chain"][0] == "fakeopt" and "fakeopt.plugins.geo" in deferred["chain"]
        assert deferred["culprit"].startswith("fakegeo") and deferred["entry"] == "fakeopt"
        assert deferred["cut"] == [{"importer": "fakeopt.plugins", "module": "fakeopt.plugins.geo",
                                    "fromlist": ["*"], "binds": [["*", "fakeopt.plugins.geo"]],
                                    "guard": {"swallows": ["builtins.ModuleNotFoundError"]}}]
        assert not status(launcher)["driver_initialized"]
        # A scout found the culprit: the zygote never imported it, nor restarted.
        assert log_text(launcher).count("restarting without it") == 0
        assert log.read_text().count("fakegeo imported") == 1
    finally:
        launcher.close()


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_step_sees_what_a_fresh_interpreter_sees(site, mode):
    env, _ = site
    env = dict(env, PRELOAD_LAUNCHER_DEFERRED=mode)
    # Lazy replays at the step's first import of the deferred package; eager before its code.
    code = OBSERVE if mode == "eager" else "import fakegeo; " + OBSERVE
    launcher = launcher_for(["fakeopt"], env)
    try:
        ours = launcher.run([PY, "-c", code], env=env)
        fresh = plain([PY, "-c", code], env=env)
        assert ours.via == "zygote"
        assert ours.stdout == fresh.stdout == "['GeoLinear', 'Linear'] True True True\n"
    finally:
        launcher.close()


def test_lazy_replay_costs_nothing_to_a_step_that_never_imports_the_package(site):
    env, log = site
    launcher = launcher_for(["fakeopt"], env)
    try:
        before = log.read_text().count("fakegeo imported")
        result = launcher.run([PY, "-c", OBSERVE], env=env)
        # The documented difference: until the step imports it, the package and what its
        # plugin registers are absent.
        assert result.stdout == "['Linear'] False False False\n"
        assert log.read_text().count("fakegeo imported") == before
    finally:
        launcher.close()


def test_a_preload_entry_on_the_way_is_not_deferred_when_a_deeper_package_can_be(site):
    # fakebridge -> fakeopt -> fakegeo: fakeopt, itself an entry, stays; fakegeo is deferred.
    env, _ = site
    launcher = launcher_for(["fakebridge", "fakeopt"], env)
    try:
        report = status(launcher)["preload"]
        assert report["loaded"] == ["fakebridge", "fakeopt"] and not report["quarantined"]
        assert list(report["deferred"]) == ["fakegeo"]
        code = "import fakebridge, fakegeo; print(fakebridge.HAVE_OPT); " + OBSERVE
        ours, fresh = launcher.run([PY, "-c", code], env=env), plain([PY, "-c", code], env=env)
        assert ours.via == "zygote"
        assert ours.stdout == fresh.stdout == "True\n['GeoLinear', 'Linear'] True True True\n"
    finally:
        launcher.close()


def test_an_unguarded_importer_is_quarantined_without_a_restart(site):
    env, log = site
    launcher = launcher_for(["needsgeo", "fakeopt"], env)
    try:
        report = status(launcher)["preload"]
        assert "needsgeo" in report["quarantined"]
        assert "without a guard" in report["quarantined"]["needsgeo"]["reason"]
        assert report["loaded"] == ["fakeopt"] and "fakegeo" in report["deferred"]
        assert log_text(launcher).count("restarting without it") == 0
        result = launcher.run([PY, "-c", "import needsgeo; print(needsgeo.VALUE)"], env=env)
        assert (result.via, result.stdout) == ("zygote", "7\n")
    finally:
        launcher.close()


def test_the_verdict_is_cached_so_the_next_zygote_never_imports_the_culprit(site):
    env, log = site
    launcher_for(["fakeopt"], env).close()
    imports = log.read_text().count("fakegeo imported")
    z = ZygoteProcess(["fakeopt"], env).start()
    z.close()
    assert log.read_text().count("fakegeo imported") == imports
    assert "fakegeo" in z.status["preload"]["deferred"]
    assert z.status["preload"]["loaded"] == ["fakeopt"]


def test_per_test_variables_never_reach_the_preload(site, tmp_path):
    env, _ = site
    (tmp_path / "site" / "reads_test_id.py").write_text(
        "import os\nSEEN = os.environ.get('PYTEST_CURRENT_TEST')\n")
    launcher = Launcher(["reads_test_id"])
    try:
        outputs = [launcher.run([PY, "-c", "import reads_test_id; print(reads_test_id.SEEN)"],
                                env=dict(env, PYTEST_CURRENT_TEST=f"test_{i} (call)")).stdout
                   for i in range(3)]
        assert outputs == ["None\n"] * 3
        assert len(launcher.zygotes) == 1  # one zygote served every test
    finally:
        launcher.close()


def write_profile_with_cli(env, path):
    """``preload-launcher profile --write`` in the environment whose packages it describes."""
    out = plain([PY, "-m", "preload_launcher.cli", "profile", "--write", str(path)], env=env)
    assert out.returncode == 0 and "1 verdicts (defer:fakegeo)" in out.stdout, out.stdout


def test_a_profile_lets_a_fresh_machine_start_without_scouting(site, tmp_path):
    env, log = site
    launcher_for(["fakeopt"], env).close()  # machine 1 finds the culprit
    profile = tmp_path / "profile.json"
    write_profile_with_cli(env, profile)
    imports = log.read_text().count("fakegeo imported")
    fresh = dict(env, PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "empty-cache"),
                 PRELOAD_LAUNCHER_PROFILE=str(profile))
    launcher = launcher_for(["fakeopt"], fresh)
    try:
        report = status(launcher)["preload"]
        assert log.read_text().count("fakegeo imported") == imports  # no culprit import
        assert "restarting" not in log_text(launcher)
        assert report["loaded"] == ["fakeopt"] and "fakegeo" in report["deferred"]
        assert report["hints"] == {}  # same package set: trusted
    finally:
        launcher.close()


def test_a_profile_from_another_package_set_is_re_verified(site, tmp_path):
    env, log = site
    launcher_for(["fakeopt"], env).close()
    profile = tmp_path / "profile.json"
    write_profile_with_cli(env, profile)
    data = json.loads(profile.read_text())
    data["fingerprint"] = "another-package-set"
    data["verdicts"]["innocent_entry"] = {"culprit": "x", "chain": ["innocent_entry", "x"],
                                          "reason": "initialised CUDA"}
    profile.write_text(json.dumps(data))
    (tmp_path / "site" / "innocent_entry.py").write_text("X = 1\n")
    fresh = dict(env, PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "empty-cache"),
                 PRELOAD_LAUNCHER_PROFILE=str(profile))
    imports = log.read_text().count("fakegeo imported")
    modules = ["fakeopt", "innocent_entry"]
    launcher = launcher_for(modules, fresh)
    try:
        zygote = launcher.zygotes[0]
        assert "restarting" not in log_text(launcher)  # the hints were applied, not scouted
        assert zygote.status["preload"]["hints"] == {"defer:fakegeo": "re-verifying",
                                                     "innocent_entry": "re-verifying"}
        deadline = time.monotonic() + 60  # a check in a child: slower under load
        while "re-verifying" in zygote.request("status")["preload"]["hints"].values():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        hints = zygote.request("status")["preload"]["hints"]
        assert hints == {"defer:fakegeo": "confirmed", "innocent_entry": "cleared"}
        assert not zygote.request("status")["driver_initialized"]  # checked in a child
        assert log.read_text().count("fakegeo imported") == imports + 1
    finally:
        launcher.close()
    again = launcher_for(modules, fresh)  # the next zygote keeps what the check found
    try:
        report = status(again)["preload"]
        assert report["loaded"] == modules and "fakegeo" in report["deferred"]
        assert report["hints"] == {}
    finally:
        again.close()
