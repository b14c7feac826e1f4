"""Python's start-up code (``.pth`` import lines, ``sitecustomize``, ``usercustomize``) runs as
every interpreter starts, with that interpreter's environment: a forked step gets what it did
with its own environment, as a fresh interpreter does (differential)."""
import os
import site
import sys
import textwrap

import pytest

from preload_launcher import Launcher
from preload_launcher.interpreter import user_site

from conftest import PY, plain


@pytest.fixture
def env(tmp_path):
    """The session's environment, with a private cache and nothing learned (a learned module
    would read variables of its own), and none of the variables these tests set."""
    env = dict(os.environ, PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"),
               PRELOAD_LAUNCHER_LEARN="0")
    for key in ("SETUPTOOLS_USE_DISTUTILS", "MY_SITE_MODE", "MY_SITE_DEFAULT", "MY_SITE_FORCED",
                "MY_SITE_GONE", "MY_USER_MODE", "MY_PTH_MODE", "PYTHONUSERBASE"):
        env.pop(key, None)
    return env


def served_like_plain(env: dict, code: str, cases) -> None:
    """Run ``code`` once per ``(extra environment, zygotes expected after it)``, in that order,
    through one launcher: forked, with the output a plain subprocess gives for that environment."""
    launcher = Launcher(["json"])
    try:
        for extra, zygotes in cases:
            step_env = dict(env, **extra)
            ours = launcher.run([PY, "-c", code], env=step_env)
            fresh = plain([PY, "-c", code], env=step_env)
            assert (ours.via, ours.stdout, ours.returncode) == (
                "zygote", fresh.stdout, fresh.returncode), extra
            assert len(launcher.zygotes) == zygotes, extra
    finally:
        launcher.close()


def distutils_precedence_pth():
    for folder in site.getsitepackages():
        path = os.path.join(folder, "distutils-precedence.pth")
        if os.path.isfile(path):
            return path
    return None


@pytest.mark.skipif(distutils_precedence_pth() is None,
                    reason="setuptools' distutils-precedence.pth is not installed")
def test_the_distutils_shim_follows_the_steps_setuptools_use_distutils(env):
    """setuptools' ``.pth`` puts its distutils first on ``sys.meta_path`` unless
    ``SETUPTOOLS_USE_DISTUTILS`` says otherwise; the variable's default agrees with unset."""
    # (the launcher's own finder is on sys.meta_path too: a known difference)
    code = ("import warnings, sys; warnings.simplefilter('always'); import distutils; "
            "finders = [type(f).__name__ for f in sys.meta_path]; "
            "print(distutils.__file__, 'DistutilsMetaFinder' in finders)")
    served_like_plain(env, code, [({}, 1),
                                  ({"SETUPTOOLS_USE_DISTUTILS": "local"}, 1),
                                  ({"SETUPTOOLS_USE_DISTUTILS": "stdlib"}, 2)])


def test_a_sitecustomize_reads_the_steps_environment(env, tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import os, sys\nsys.site_mode = os.environ.get('MY_SITE_MODE', 'default')\n")
    env = dict(env, PYTHONPATH=str(folder))
    code = "import sys; print(sys.site_mode)"
    served_like_plain(env, code, [({}, 1),
                                  ({"MY_SITE_MODE": "strict"}, 2),
                                  ({"MY_SITE_MODE": "default"}, 2),  # the first one's
                                  ({}, 2)])


def test_what_a_sitecustomize_sets_or_deletes_is_the_steps(env, tmp_path):
    """Set where unset, set whatever the step holds, and deleted: the step's environment is as
    start-up code left it in a fresh interpreter."""
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent("""\
        import os
        os.environ.setdefault('MY_SITE_DEFAULT', 'on')
        os.environ['MY_SITE_FORCED'] = 'yes'
        if 'MY_SITE_GONE' in os.environ:
            del os.environ['MY_SITE_GONE']
    """))
    env = dict(env, PYTHONPATH=str(folder))
    code = ("import os; print([os.environ.get(k) for k in "
            "('MY_SITE_DEFAULT', 'MY_SITE_FORCED', 'MY_SITE_GONE')])")
    served_like_plain(env, code, [({}, 1),
                                  ({"MY_SITE_FORCED": "no"}, 1),  # not read: set anyway
                                  ({"MY_SITE_DEFAULT": "on"}, 1),  # what it would set
                                  ({"MY_SITE_DEFAULT": "off"}, 2),
                                  ({"MY_SITE_GONE": "here"}, 3)])


def test_usercustomize_and_the_user_sites_pth_files_read_the_steps_environment(env, tmp_path):
    base = tmp_path / "userbase"
    env = dict(env, PYTHONUSERBASE=str(base))
    env.pop("PYTHONNOUSERSITE", None)
    folder = base / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    folder.mkdir(parents=True)
    if user_site(env) is None:
        pytest.skip("this interpreter has no user site (a virtual environment without the "
                    "system's site-packages)")
    (folder / "usercustomize.py").write_text(
        "import os, sys\nsys.user_mode = os.environ.get('MY_USER_MODE', 'default')\n")
    (folder / "modes.pth").write_text(
        "import os, sys; sys.pth_mode = os.environ.get('MY_PTH_MODE', 'default')\n")
    code = "import sys; print(sys.user_mode, sys.pth_mode)"
    served_like_plain(env, code, [({}, 1),
                                  ({"MY_USER_MODE": "strict"}, 2),
                                  ({"MY_PTH_MODE": "strict"}, 3)])


def test_a_zygote_that_cannot_run_the_start_up_code_again_serves_nothing(env, tmp_path):
    """Where the start-up code cannot be run again to see what it reads (here it exits there),
    steps run as plain processes, saying why: a zygote that cannot tell serves no step."""
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text("import sys\nif sys.flags.no_site:\n    sys.exit(3)\n")
    env = dict(env, PYTHONPATH=str(folder))
    launcher = Launcher(["json"])
    try:
        ours = launcher.run([PY, "-c", "print('ran')"], env=env)
    finally:
        launcher.close()
    assert (ours.via, ours.stdout, ours.returncode) == ("subprocess", "ran\n", 0)
    assert "start-up code" in ours.reason
