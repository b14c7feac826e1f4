"""The caches hold up: profile edits from several processes are all kept, and a read-only or
full cache directory costs the cache, never a zygote or a step."""
import os
import subprocess
import sys
import time

import pytest

from preload_launcher import Launcher
from preload_launcher.zygote import learn

from conftest import PY


@pytest.fixture
def project_env(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    for name in ("mod_a", "mod_b", "mod_c"):
        (site / f"{name}.py").write_text(f"NAME = {name!r}\n")
    project = tmp_path / "project"
    project.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PRELOAD_LAUNCHER_LEARN", None)
    return project, env


def profile_of(project, env) -> learn.Profile:
    return learn.Profile(env["PRELOAD_LAUNCHER_CACHE_DIR"], learn.profile_key(str(project)),
                         str(project))


def wait_learned(project, env, module, timeout=60.0) -> dict:
    """The profile on disk once ``module`` is in it (a zygote learns while idle)."""
    deadline = time.monotonic() + timeout
    while True:
        data = profile_of(project, env).data
        if module in data["modules"]:
            return data
        assert time.monotonic() < deadline, f"{module} was never learned"
        time.sleep(0.1)


def cli(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "preload_launcher.cli", *args], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_cli_edit_survives_the_next_save_of_a_running_zygote(project_env):
    project, env = project_env
    launcher = Launcher(["json"], project=str(project))
    try:
        launcher.run([PY, "-c", "import mod_a"], env=env, cwd=str(project))
        wait_learned(project, env, "mod_a")
        edit = cli(env, "learned", "--project", str(project), "--forget", "mod_a",
                   "--pin", "mod_c")
        assert edit.returncode == 0, edit.stdout
        # The zygote learned mod_a before the edit; its next save must not undo the edit.
        launcher.run([PY, "-c", "import mod_b"], env=env, cwd=str(project))
        data = wait_learned(project, env, "mod_b")
    finally:
        launcher.close()
    assert "mod_a" not in data["modules"] and data["forgotten"] == ["mod_a"]
    assert data["pinned"] == ["mod_c"]


def test_two_zygotes_of_different_preload_sets_keep_each_others_learning(project_env):
    project, env = project_env
    first, second = Launcher(["json"], project=str(project)), Launcher(["csv"], project=str(project))
    try:
        first.zygote_for(env)
        second.zygote_for(env)  # both loaded the empty profile
        second.run([PY, "-c", "import mod_b"], env=env, cwd=str(project))
        wait_learned(project, env, "mod_b")
        first.run([PY, "-c", "import mod_a"], env=env, cwd=str(project))
        data = wait_learned(project, env, "mod_a")
    finally:
        first.close()
        second.close()
    assert "mod_b" in data["modules"]


def test_concurrent_savers_lose_no_edit(tmp_path):
    """Many processes, each adding its own module and saving, at once: every one is kept."""
    code = ("import sys; from preload_launcher.zygote import learn\n"
            "p = learn.Profile(sys.argv[1], 'k', '/p')\n"
            "p.pin(sys.argv[2]); p.save()\n")
    procs = [subprocess.Popen([PY, "-c", code, str(tmp_path), f"m{i}"],
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
             for i in range(8)]
    assert [p.wait() for p in procs] == [0] * 8
    assert sorted(learn.Profile(str(tmp_path), "k", "/p").data["pinned"]) == [f"m{i}" for i in range(8)]


# ---------------------------------------------------------------- unwritable caches


def _mount_tmpfs(path, options) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stdout!r}")


@pytest.fixture
def read_only_cache(tmp_path):
    cache = tmp_path / "cache"
    if os.geteuid() != 0:
        cache.mkdir()
        cache.chmod(0o555)
        yield cache
        cache.chmod(0o755)
        return
    _mount_tmpfs(cache, "size=1m,ro")
    yield cache
    subprocess.run(["umount", "-l", str(cache)], check=True)  # lazily: a failed test may hold files


@pytest.fixture
def full_cache(tmp_path):
    cache = tmp_path / "cache"
    _mount_tmpfs(cache, "size=64k")
    fd = os.open(cache / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"x" * 4096):  # take every block the tmpfs has
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    yield cache
    subprocess.run(["umount", "-l", str(cache)], check=True)  # lazily: a failed test may hold files


def leftovers(cache) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(cache) for n in names
            if n.endswith(".tmp")]


@pytest.mark.parametrize("cache_fixture", ["read_only_cache", "full_cache"])
def test_an_unwritable_cache_costs_the_cache_not_the_zygote(cache_fixture, project_env, request,
                                                            tmp_path):
    cache = request.getfixturevalue(cache_fixture)
    project, env = project_env
    env = dict(env, PRELOAD_LAUNCHER_CACHE_DIR=str(cache), PRELOAD_LAUNCHER_PROBE="fake")
    for _ in range(2):  # a later session too: nothing remembered breaks it
        launcher = Launcher(["json"], project=str(project))
        try:
            for code in ("import mod_a; print('a')", "import mod_b; print('b')"):
                result = launcher.run([PY, "-c", code], env=env, cwd=str(project))
                assert (result.via, result.returncode) == ("zygote", 0), result.reason
            zygote = launcher.zygotes[0]
            zygote.request("status")
            log = open(zygote.log_path).read()
        finally:
            launcher.close()
        assert log.count("going on without that cache") == 1, log
        assert leftovers(cache) == []


def test_the_cli_edits_of_an_unwritable_profile_fail_in_one_line(read_only_cache, project_env):
    project, env = project_env
    env = dict(env, PRELOAD_LAUNCHER_CACHE_DIR=str(read_only_cache))
    edit = cli(env, "learned", "--project", str(project), "--pin", "mod_a")
    assert edit.returncode == 1 and "Traceback" not in edit.stdout
    assert "cannot write" in edit.stdout and len(edit.stdout.splitlines()) == 1
