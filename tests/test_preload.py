"""CUDA-clean preload with a fake driver: culprits found, quarantined, cached, invalidated."""
import os
import signal
import subprocess
import textwrap
import time

import pytest

from preload_launcher import Launcher, ZygoteProcess
from preload_launcher.cli import main as cli_main

from conftest import PY


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A directory of fake modules, a fake distribution, a private cache, the fake probe."""
    site = tmp_path / "site"
    site.mkdir()
    imports_log = tmp_path / "imports.log"
    files = {
        # Like modelopt.torch -> ... -> torch_geometric.typing: the parent is innocent.
        "fake_parent.py": "import fake_middle\nVALUE = 1\n",
        "fake_middle.py": "import fake_culprit\n",
        "fake_culprit.py": f"""
            from preload_launcher.cuda import fake_cuinit
            open({str(imports_log)!r}, "a").write("culprit imported\\n")
            fake_cuinit()
        """,
        "thready.py": "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True, name='poller').start()\n",
        "armed.py": """
            import signal
            from preload_launcher.cuda import fake_cuinit
            signal.signal(signal.SIGUSR1, lambda *a: fake_cuinit())
        """,
        "innocent.py": "X = 42\n",
    }
    for name, text in files.items():
        (site / name).write_text(textwrap.dedent(text))
    dist = site / "fakepkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n")
    env = dict(os.environ, PYTHONPATH=str(site), PRELOAD_LAUNCHER_PROBE="fake",
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    return site, env, imports_log


def start(modules, env):
    z = ZygoteProcess(modules, env)
    z.start()
    return z


def test_culprit_found_and_its_entry_quarantined(fake_site):
    site, env, log = fake_site
    z = start(["json", "fake_parent", "innocent"], env)
    try:
        report = z.status["preload"]
        verdict = report["quarantined"]["fake_parent"]
        assert verdict["culprit"] == "fake_culprit"
        assert verdict["chain"] == ["fake_parent", "fake_middle", "fake_culprit"]
        assert "driver" in verdict["reason"]
        assert report["loaded"] == ["json", "innocent"]
        # The zygote that serves is clean and forks real steps; they can still import the culprit.
        launcher = Launcher(["json", "fake_parent", "innocent"])
        launcher.zygotes.append(z)
        launcher.modules = ("json", "fake_parent", "innocent")
        r = launcher.run([PY, "-c", "import fake_parent, sys; print(fake_parent.VALUE, 'innocent' in sys.modules)"],
                         env=env)
        assert (r.via, r.stdout) == ("zygote", "1 False\n")  # a fresh table: not imported
    finally:
        z.close()


def test_verdict_cached_then_invalidated_by_a_version_change(fake_site):
    site, env, log = fake_site
    start(["fake_parent"], env).close()
    assert log.read_text().count("culprit imported") == 1
    z = start(["fake_parent"], env)  # cache hit: the culprit is not imported again
    z.close()
    assert log.read_text().count("culprit imported") == 1
    assert "fake_parent" in z.status["preload"]["quarantined"]
    assert z.status["preload"]["entries"] == []
    os.rename(site / "fakepkg-1.0.dist-info", site / "fakepkg-2.0.dist-info")
    (site / "fakepkg-2.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakepkg\nVersion: 2.0\n")
    start(["fake_parent"], env).close()  # new versions: the bisection runs again
    assert log.read_text().count("culprit imported") == 2


def test_module_starting_a_python_thread_is_reported_and_quarantined(fake_site):
    site, env, _ = fake_site
    z = start(["thready", "innocent"], env)
    z.close()
    verdict = z.status["preload"]["quarantined"]["thready"]
    assert "poller" in verdict["reason"]
    assert z.status["preload"]["loaded"] == ["innocent"]


def test_failed_import_is_reported_not_fatal(fake_site):
    site, env, _ = fake_site
    z = start(["no_such_module_abc", "innocent"], env)
    z.close()
    entries = {e["module"]: e for e in z.status["preload"]["entries"]}
    assert not entries["no_such_module_abc"]["ok"]
    assert "ModuleNotFoundError" in entries["no_such_module_abc"]["error"]
    assert entries["innocent"]["ok"]


def test_dirty_zygote_never_forks_a_step(fake_site):
    site, env, _ = fake_site
    launcher = Launcher(["armed"])
    try:
        first = launcher.run([PY, "-c", "print('ok')"], env=env)
        assert first.via == "zygote"
        zygote = launcher.zygotes[0]
        os.kill(zygote.process.pid, signal.SIGUSR1)  # the zygote 'initialises CUDA'
        deadline = time.monotonic() + 30
        while not zygote.request("status")["driver_initialized"]:
            assert time.monotonic() < deadline, "the zygote never ran its SIGUSR1 handler"
            time.sleep(0.02)
        second = launcher.run([PY, "-c", "print('ok')"], env=env)
        assert (second.via, second.stdout) == ("subprocess", "ok\n")
        assert "CUDA driver is initialised" in second.reason
        assert zygote not in launcher.zygotes  # retired; the next step gets a fresh one
        third = launcher.run([PY, "-c", "print('ok')"], env=env)
        assert third.via == "zygote"
    finally:
        launcher.close()


def test_doctor_names_the_culprit_and_fails(fake_site, monkeypatch, capsys):
    site, env, _ = fake_site
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli_main(["doctor", "--preload", "json,fake_parent"]) == 1
    out = capsys.readouterr().out
    assert "QUARANTINED fake_parent" in out and "fake_parent -> fake_middle -> fake_culprit" in out
    assert "final preload set: json" in out
    assert cli_main(["doctor", "--preload", "json,innocent"]) == 0


def test_import_time_environment_selects_the_zygote(fake_site, tmp_path):
    """A variable read during preload that differs in a step's env gets its own zygote."""
    site, env, _ = fake_site
    (site / "reads_env.py").write_text("import os\nMODE = os.environ.get('FAKE_IMPORT_MODE', 'a')\n")
    launcher = Launcher(["reads_env"])
    try:
        code = "import reads_env; print(reads_env.MODE)"
        a = launcher.run([PY, "-c", code], env=dict(env, FAKE_IMPORT_MODE="a"))
        b = launcher.run([PY, "-c", code], env=dict(env, FAKE_IMPORT_MODE="b"))
        a2 = launcher.run([PY, "-c", code], env=dict(env, FAKE_IMPORT_MODE="a"))
        assert (a.stdout, b.stdout, a2.stdout) == ("a\n", "b\n", "a\n")
        assert {a.via, b.via, a2.via} == {"zygote"}
        assert len(launcher.zygotes) == 2
    finally:
        launcher.close()


def test_variables_set_by_preloaded_imports_are_seen_as_after_a_fresh_import(fake_site):
    site, env, _ = fake_site
    (site / "sets_env.py").write_text(
        "import os\nos.environ.setdefault('SET_AT_IMPORT', os.environ.get('SET_AT_IMPORT_SEED', 'default'))\n")
    launcher = Launcher(["sets_env"])
    code = "import os, sets_env; print(os.environ['SET_AT_IMPORT'])"
    try:
        first = launcher.run([PY, "-c", code], env=env)
        second = launcher.run([PY, "-c", code], env=env)
        # The import saw no value, so this zygote's import does not fit; another one serves.
        caller = launcher.run([PY, "-c", code], env=dict(env, SET_AT_IMPORT="caller"))
        ref = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True)
        assert (first.stdout, second.stdout) == (ref.stdout, ref.stdout) == ("default\n", "default\n")
        assert caller.stdout == "caller\n"
        assert {first.via, second.via, caller.via} == {"zygote"}
        assert len(launcher.zygotes) == 2
    finally:
        launcher.close()


def served_like_plain(env: dict, module: str, code: str, cases) -> None:
    """A launcher preloading ``module`` runs ``code`` once per ``(extra env, zygotes
    expected after it)``: forked, with the output a plain subprocess prints for that env."""
    launcher = Launcher([module])
    try:
        for extra, zygotes in cases:
            step_env = dict(env, **extra)
            got = launcher.run([PY, "-c", code], env=step_env)
            ref = subprocess.run([PY, "-c", code], env=step_env, capture_output=True, text=True)
            assert (got.via, got.stdout) == ("zygote", ref.stdout), extra
            assert len(launcher.zygotes) == zygotes, extra
    finally:
        launcher.close()


def test_a_step_passing_on_a_default_the_preload_published_is_served_by_it(fake_site):
    """A program that imported the stack passes on what its imports set (torch's inductor
    cache directory): its steps fit the zygote whose imports set the same value."""
    site, env, _ = fake_site
    (site / "publishes.py").write_text(
        "import os\nDIR = os.environ.get('PUBLISHED_DIR') or '/no/such/published'\n"
        "os.environ['PUBLISHED_DIR'] = DIR\n")
    code = "import os, publishes; print(publishes.DIR, os.environ['PUBLISHED_DIR'])"
    served_like_plain(env, "publishes", code, [({}, 1),
                                               ({"PUBLISHED_DIR": "/no/such/published"}, 1),
                                               ({"PUBLISHED_DIR": "/elsewhere"}, 2)])


def test_a_step_passing_on_a_family_member_the_preload_set_is_served_by_it(fake_site):
    """Native code reads whole families of variables at load (``TF_*``: XLA's logging): a
    preloaded module that sets one member at import, and a caller whose own import of it set the
    same, are one environment; another value of the member still gets its own zygote."""
    site, env, _ = fake_site
    env = {k: v for k, v in env.items() if not k.startswith("TF_")}
    (site / "sets_member.py").write_text(
        "import os\nos.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')\n")
    code = "import os, sets_member; print(os.environ['TF_CPP_MIN_LOG_LEVEL'])"
    served_like_plain(env, "sets_member", code, [({}, 1),
                                                 ({"TF_CPP_MIN_LOG_LEVEL": "3"}, 1),
                                                 ({"TF_CPP_MIN_LOG_LEVEL": "1"}, 2)])


def test_a_preloaded_module_that_imports_threadpoolctl_runs_that_import_itself(fake_site):
    """The zygote uses threadpoolctl while preloading; a preloaded module importing it must still
    run its import (which sets KMP_DUPLICATE_LIB_OK), as in a fresh interpreter, and a caller
    whose own imports set that variable is served by the same zygote (differential)."""
    pytest.importorskip("threadpoolctl")
    site, env, _ = fake_site
    (site / "pools_threads.py").write_text("import threadpoolctl\n")
    code = ("import os, sys, pools_threads; "
            "print(os.environ.get('KMP_DUPLICATE_LIB_OK'), 'threadpoolctl' in sys.modules)")
    served_like_plain(env, "pools_threads", code, [({}, 1), ({"KMP_DUPLICATE_LIB_OK": "True"}, 1)])


def test_a_caller_whose_imports_set_threadpoolctls_default_is_served(fake_site):
    """A preloaded module only reads KMP_DUPLICATE_LIB_OK; the caller's own imports (of a package
    the zygote deferred) set threadpoolctl's value: served by the same zygote (differential)."""
    site, env, _ = fake_site
    (site / "reads_kmp.py").write_text(
        "import os\nSEEN = os.environ.get('KMP_DUPLICATE_LIB_OK')\n")
    code = "import os; print(os.environ.get('KMP_DUPLICATE_LIB_OK'))"
    served_like_plain(env, "reads_kmp", code, [({}, 1), ({"KMP_DUPLICATE_LIB_OK": "True"}, 1)])


def test_the_terminal_size_does_not_split_zygotes(fake_site):
    """A preloaded module that reads the terminal's size at import (accelerate's menus): a
    caller whose COLUMNS/LINES differ (readline exports them) is served by the same zygote, and
    the step reads its own size (differential)."""
    site, env, _ = fake_site
    (site / "sizes_up.py").write_text("import shutil\nSIZE = shutil.get_terminal_size()\n")
    code = "import os, shutil; print(os.environ.get('COLUMNS'), shutil.get_terminal_size())"
    served_like_plain(env, "sizes_up", code, [({}, 1), ({"COLUMNS": "123", "LINES": "45"}, 1)])


def test_a_module_that_copies_the_environment_does_not_pin_every_variable(fake_site):
    site, env, _ = fake_site
    (site / "copies_env.py").write_text(
        "import os\nSNAPSHOT = dict(os.environ)\nITEMS = list(os.environ.items())\n"
        "FLAG = os.environ.get('COPIES_ENV_FLAG')\n")
    launcher = Launcher(["copies_env"])
    try:
        for i in range(3):  # as PYTEST_CURRENT_TEST differs in every test
            r = launcher.run([PY, "-c", "print(1)"], env=dict(env, UNRELATED_PER_TEST=str(i)))
            assert r.via == "zygote"
        assert len(launcher.zygotes) == 1
        zygote = launcher.zygotes[0]
        assert "COPIES_ENV_FLAG" in zygote.import_env  # the one read by name still counts
        assert "UNRELATED_PER_TEST" not in zygote.import_env
    finally:
        launcher.close()
