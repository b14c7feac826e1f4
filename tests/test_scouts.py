"""Scouts stream what they passed, so the zygote imports an entry alongside its scout; an entry
that crashes the interpreter at import is quarantined and remembered, never retried."""
import os
import subprocess
import textwrap

import pytest

from preload_launcher import Launcher

from conftest import PY


def write_site(root, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def site(tmp_path):
    root = tmp_path / "site"
    log = tmp_path / "log"
    write_site(root, {
        # Crashes whoever imports it (SIGSEGV), as a broken extension's init does.
        "crashy.py": "import ctypes\nctypes.string_at(0)\n",
        # Whether the zygote has entered an entry's first module: the zygote is a scout's
        # parent, and logs its own pid; a scout logs the zygote's as its parent's.
        "entered.py": f"""
            import os
            def zygote_entered():
                lines = [l.split() for l in open({str(log)!r}).read().splitlines()]
                return any(l[0] == 'first' and os.getppid() == int(l[1]) or
                           l[0] == 'first' and os.getpid() == int(l[2]) for l in lines)
        """,
        "first.py": f"""
            import os
            with open({str(log)!r}, 'a') as f:
                f.write(f"first {{os.getpid()}} {{os.getppid()}}\\n")
        """,
        # An entry whose last module waits until the zygote has entered the entry: a scout
        # that had to finish before the zygote starts would wait in vain.
        "slowentry/__init__.py": "from . import first\nfrom . import last\n",
        "slowentry/first.py": "import entered, first\n",
        "slowentry/last.py": f"""
            import time
            from entered import zygote_entered
            deadline = time.monotonic() + 60
            while not zygote_entered() and time.monotonic() < deadline:
                time.sleep(0.05)
            with open({str(log)!r}, 'a') as f:
                f.write('last ' + ('waited' if zygote_entered() else 'gave up') + '\\n')
        """,
        # An entry that is its own culprit, found by its scout only once the zygote is in it.
        "selfdirty/__init__.py": "from . import first\nfrom . import late\n",
        "selfdirty/first.py": "import entered, first\n",
        "selfdirty/late.py": f"""
            import os, time
            from entered import zygote_entered
            from preload_launcher.cuda import fake_cuinit
            deadline = time.monotonic() + 60
            while not zygote_entered() and time.monotonic() < deadline:
                time.sleep(0.05)
            with open({str(log)!r}, 'a') as f:
                f.write(f"late {{os.getpid()}} {{'waited' if zygote_entered() else 'gave up'}}\\n")
            fake_cuinit()
        """,
        # Three entries on one shared stack, which logs each process that imports it.
        "shared.py": f"""
            import os
            with open({str(log)!r}, 'a') as f:
                f.write(f"shared {{os.getpid()}}\\n")
        """,
        "one.py": "import shared\n", "two.py": "import shared\n", "three.py": "import shared\n",
        # Two entries, each reaching its own culprit under a guard (modelopt's shape, twice).
        "optone/__init__.py": "try:\n    import geoone\nexcept ImportError:\n    pass\n",
        "opttwo/__init__.py": "try:\n    import geotwo\nexcept ImportError:\n    pass\n",
        "geoone.py": "from preload_launcher.cuda import fake_cuinit\nfake_cuinit()\n",
        "geotwo.py": "from preload_launcher.cuda import fake_cuinit\nfake_cuinit()\n",
    })
    env = dict(os.environ, PYTHONPATH=str(root), PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"),
               PRELOAD_LAUNCHER_LEARN="0")
    return env, log


def start(modules, env):
    launcher = Launcher(modules)
    return launcher, launcher.zygote_for(env).status["preload"]


def doctor(env, modules) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "preload_launcher.cli", "doctor", "--preload", modules],
                          env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_the_zygote_imports_an_entry_alongside_its_scout(site):
    env, log = site
    launcher, report = start(["json", "slowentry"], dict(env, PRELOAD_LAUNCHER_PROBE="fake"))
    try:
        assert report["loaded"] == ["json", "slowentry"]
        assert "gave up" not in log.read_text(), log.read_text()
    finally:
        launcher.close()


def test_one_scout_imports_a_shared_stack_once_beside_the_zygote(site):
    """A scout per entry, each from the start, imported a stack the entries share once per
    entry, all at the same time as the zygote: one scout serves every entry."""
    env, log = site
    launcher, report = start(["one", "two", "three"], dict(env, PRELOAD_LAUNCHER_PROBE="fake"))
    try:
        assert report["loaded"] == ["one", "two", "three"]
        importers = {line.split()[1] for line in log.read_text().splitlines()}
        assert len(importers) == 2, importers  # the zygote and its scout
    finally:
        launcher.close()


def test_a_culprit_in_a_later_entry_is_found_by_the_next_scout_without_a_restart(site):
    """The scout stops at the first entry's culprit; the next entry gets a scout forked from
    the zygote, the first culprit blocked there, which finds the second."""
    env, _ = site
    launcher, report = start(["optone", "opttwo"], dict(env, PRELOAD_LAUNCHER_PROBE="fake"))
    try:
        zygote = launcher.zygotes[0]
        assert report["loaded"] == ["optone", "opttwo"] and not report["quarantined"]
        assert sorted(report["deferred"]) == ["geoone", "geotwo"]
        assert "restarting" not in open(zygote.log_path).read()
        assert not zygote.request("status")["driver_initialized"]
    finally:
        launcher.close()


@pytest.mark.parametrize("probe", ["fake", ""], ids=["scouted", "unscouted"])
def test_an_entry_that_crashes_the_interpreter_is_quarantined_and_remembered(site, probe):
    env, _ = site
    if probe:
        env["PRELOAD_LAUNCHER_PROBE"] = probe
    launcher = Launcher(["json", "crashy"])
    try:
        steps = [launcher.run([PY, "-c", "import json; print('ok')"], env=env) for _ in range(2)]
        assert [s.stdout for s in steps] == ["ok\n", "ok\n"]
        # A scout's crash costs nothing; without scouts the first zygote dies of it, once.
        assert steps[-1].via == "zygote"
        assert steps[0].via == "zygote" or "code -11" in steps[0].reason
        if probe:  # the scout died before the zygote ran any of the entry: skipped, no restart
            assert "restarting" not in open(launcher.zygotes[0].log_path).read()
        report = launcher.zygotes[-1].status["preload"]
        assert report["loaded"] == ["json"]
        assert "SIGSEGV" in report["quarantined"]["crashy"]["reason"]
    finally:
        launcher.close()
    again, report = start(["json", "crashy"], env)  # remembered: never imported again
    again.close()
    assert "crashy" in report["quarantined"] and report["loaded"] == ["json"]
    checked = doctor(env, "json,crashy")
    assert checked.returncode == 1 and "SIGSEGV" in checked.stdout, checked.stdout
    assert not [n for n in os.listdir(env["PRELOAD_LAUNCHER_CACHE_DIR"]) if n.startswith("importing-")]


def test_an_entry_found_dirty_while_the_zygote_is_in_it_costs_one_restart(site):
    env, log = site
    env["PRELOAD_LAUNCHER_PROBE"] = "fake"
    launcher, report = start(["json", "selfdirty"], env)
    try:
        zygote = launcher.zygotes[0]
        assert report["loaded"] == ["json"] and "selfdirty" in report["quarantined"]
        assert report["quarantined"]["selfdirty"]["culprit"].startswith("selfdirty")
        assert not zygote.request("status")["driver_initialized"]
        lines = log.read_text().splitlines()
        assert [l.split()[2] for l in lines if l.startswith("late")] == ["waited"], lines
        assert launcher.run([PY, "-c", "print('ok')"], env=env).via == "zygote"
    finally:
        launcher.close()


def test_a_signal_without_a_name_is_named_by_its_number():
    """How a crash is told (a scout's verdict, a lost zygote in the summary) never fails on a
    real-time signal, which ``signal.Signals`` has no member for."""
    from preload_launcher.result import signal_name
    import signal
    assert signal_name(signal.SIGSEGV) == "SIGSEGV"
    unnamed = signal.SIGRTMIN + 6
    with pytest.raises(ValueError):
        signal.Signals(unnamed)
    assert signal_name(unnamed) == f"signal {unnamed}"
