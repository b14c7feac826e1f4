"""A step's own modules win, as in a fresh interpreter: what its sys.path (script folder or cwd,
then PYTHONPATH) finds first is what it imports, whether the zygote preloaded, learned or
deferred a module of that name. Each test runs the same program fresh and through a launcher."""
import json
import os
import textwrap

import pytest

from preload_launcher import Launcher

from conftest import PY, plain

SHOW = ("import sys\n"
        "for name in NAMES:\n"
        "    module = __import__(name)\n"
        "    print(name, getattr(module, '__file__', None), getattr(module, 'WHO', None))\n")


def write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def both(launcher, args, env, cwd):
    ours = launcher.run(args, env=env, cwd=str(cwd))
    fresh = plain(args, env=env, cwd=str(cwd))
    assert ours.via == "zygote", ours.reason
    return ours, fresh


@pytest.fixture
def site(tmp_path):
    """A library (``fakelib``, preloaded) that imports a helper by bare name (``helperlib``,
    tqdm's place), one that puts its own folder on sys.path and imports from it at run time
    (``fakeort``, onnxruntime.transformers' shape), and a package with a regular package inside."""
    root = tmp_path / "site"
    write(root, {
        "fakelib/__init__.py": "import helperlib\nHELPER = helperlib\n",
        "helperlib.py": "WHO = 'site'\n",
        "fakeort/__init__.py": """
            import os, sys
            sys.path.append(os.path.join(os.path.dirname(__file__), 'transformers'))
            import onnx_model
        """,
        "fakeort/transformers/onnx_model.py": "WHO = 'fakeort'\n",
    })
    env = dict(os.environ, PYTHONPATH=str(root), PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PRELOAD_LAUNCHER_LEARN", None)
    return root, env


def test_the_script_folder_wins_over_preloaded_and_library_path_modules(site, tmp_path):
    root, env = site
    example = tmp_path / "example"
    write(example, {
        "helperlib.py": "WHO = 'step'\n",
        "onnx_model.py": "WHO = 'step'\n",
        "json.py": "WHO = 'step'\n",  # the stdlib module the zygote itself imported
        "os.py": "WHO = 'step'\n",  # imported at start-up: python's own os wins, fresh too
        "main.py": "NAMES = ['fakelib', 'helperlib', 'onnx_model', 'json', 'os']\n" + SHOW,
    })
    launcher = Launcher(["fakelib", "fakeort", "json"], project=str(tmp_path))
    try:
        ours, fresh = both(launcher, [PY, str(example / "main.py")], env, tmp_path)
        assert ours.returncode == fresh.returncode == 0, ours.stdout
        assert ours.stdout == fresh.stdout
        assert f"helperlib {example / 'helperlib.py'} step" in ours.stdout
        assert f"onnx_model {example / 'onnx_model.py'} step" in ours.stdout
        assert f"json {example / 'json.py'} step" in ours.stdout
        assert f"os {example / 'os.py'}" not in ours.stdout
    finally:
        launcher.close()


@pytest.mark.parametrize("form", ["-c", "-m"])
def test_the_cwd_wins_for_code_and_modules(site, tmp_path, form):
    root, env = site
    cwd = tmp_path / "work"
    write(cwd, {"helperlib/__init__.py": "WHO = 'cwd package'\n",
                "shown.py": "NAMES = ['helperlib']\n" + SHOW})
    args = [PY, "-c", "import shown"] if form == "-c" else [PY, "-m", "shown"]
    launcher = Launcher(["fakelib"], project=str(tmp_path))
    try:
        ours, fresh = both(launcher, args, env, cwd)
        assert ours.stdout == fresh.stdout
        assert f"{cwd / 'helperlib' / '__init__.py'} cwd package" in ours.stdout
    finally:
        launcher.close()


def test_a_namespace_folder_does_not_shadow_and_a_pythonpath_file_does(site, tmp_path):
    root, env = site
    cwd, extra = tmp_path / "work", tmp_path / "extra"
    write(cwd, {"helperlib/readme.txt": "a folder without __init__: a namespace portion\n"})
    extra.mkdir()
    env = dict(env, PYTHONPATH=f"{extra}{os.pathsep}{root}")
    code = "NAMES = ['helperlib', 'onnx_model']\n" + SHOW
    launcher = Launcher(["fakelib", "fakeort"], project=str(tmp_path))
    try:
        launcher.zygote_for(env)  # preloaded fakeort's onnx_model: PYTHONPATH had none then
        write(extra, {"onnx_model.py": "WHO = 'pythonpath'\n"})
        ours, fresh = both(launcher, [PY, "-c", code], env, cwd)
        assert ours.stdout == fresh.stdout
        assert f"helperlib {root / 'helperlib.py'} site" in ours.stdout
        assert f"onnx_model {extra / 'onnx_model.py'} pythonpath" in ours.stdout
    finally:
        launcher.close()


def test_a_folder_made_after_the_preload_is_searched_as_at_a_fresh_start(site, tmp_path):
    root, env = site
    later = tmp_path / "later"  # on PYTHONPATH, missing while the zygote imports
    env = dict(env, PYTHONPATH=f"{later}{os.pathsep}{root}")
    code = "NAMES = ['late_mod']\n" + SHOW
    launcher = Launcher(["fakelib"], project=str(tmp_path))
    try:
        launcher.zygote_for(env)
        write(later, {"late_mod.py": "WHO = 'later'\n"})
        ours, fresh = both(launcher, [PY, "-c", code], env, tmp_path)
        assert ours.returncode == fresh.returncode == 0, ours.stdout
        assert ours.stdout == fresh.stdout == f"late_mod {later / 'late_mod.py'} later\n"
    finally:
        launcher.close()


def test_a_zip_rebuilt_after_the_preload_is_read_as_it_is_now(site, tmp_path):
    import zipfile
    root, env = site
    archive = tmp_path / "lib.zip"

    def build(files):
        with zipfile.ZipFile(archive, "w") as z:
            for name, text in files.items():
                z.writestr(name, text)

    build({"zmod.py": "WHO = 'old'\n"})
    env = dict(env, PYTHONPATH=f"{archive}{os.pathsep}{root}")
    code = "NAMES = ['zmod', 'znew']\n" + SHOW
    launcher = Launcher(["fakelib"], project=str(tmp_path))
    try:
        launcher.zygote_for(env)  # its zip importer has read the archive's table of contents
        build({"aaa.py": "#" * 100 + "\n", "zmod.py": "WHO = 'new'\n", "znew.py": "WHO = 'new'\n"})
        ours, fresh = both(launcher, [PY, "-c", code], env, tmp_path)
        assert ours.returncode == fresh.returncode == 0, ours.stdout
        assert ours.stdout == fresh.stdout
        assert f"zmod {archive / 'zmod.py'} new" in ours.stdout
    finally:
        launcher.close()


def test_the_user_site_is_the_one_the_steps_home_gives(site, tmp_path):
    """``HOME`` places the user base (where ``pip install --user`` goes) and the user
    site-packages folder, which is on ``sys.path`` when it exists."""
    import sys
    root, env = site
    home_a, home_b = tmp_path / "home-a", tmp_path / "home-b"
    home_a.mkdir()
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    user_site = home_b / ".local" / "lib" / version / "site-packages"
    env = dict(env, HOME=str(home_a))
    env.pop("PYTHONUSERBASE", None)
    env.pop("PYTHONNOUSERSITE", None)
    code = ("import site, sys, sysconfig\n"
            "print(site.USER_BASE, site.USER_SITE, sysconfig.get_config_var('userbase'))\n"
            "print(site.USER_SITE in sys.path)\n"
            "try:\n    import usermod\n    print(usermod.WHO)\nexcept ImportError as e:\n    print(e)\n")
    launcher = Launcher(["fakelib"], project=str(tmp_path))  # (an import reading HOME keys it)
    try:
        launcher.zygote_for(env)
        step_env = dict(env, HOME=str(home_b))  # no user site in either home yet
        ours, fresh = both(launcher, [PY, "-c", code], step_env, tmp_path)
        assert ours.stdout == fresh.stdout
        assert f"{home_b / '.local'} {user_site} {home_b / '.local'}" in ours.stdout
        write(user_site, {"usermod.py": "WHO = 'user site'\n"})  # now the step's home has one
        ours = launcher.run([PY, "-c", code], env=step_env, cwd=str(tmp_path))
        fresh = plain([PY, "-c", code], env=step_env, cwd=str(tmp_path))
        assert ours.stdout == fresh.stdout
        # (a virtual environment without the system's site-packages has no user site)
        assert ("user site" in fresh.stdout) == (sys.prefix == sys.base_prefix)
        if "user site" in fresh.stdout:  # not served by a zygote without it on sys.path
            assert ours.via != "zygote" or (launcher.zygote_for(step_env)
                                            is not launcher.zygote_for(env))
    finally:
        launcher.close()


def test_a_deferred_package_is_the_steps_own_where_it_has_one(tmp_path):
    root = tmp_path / "site"
    write(root, {
        "fakeopt/__init__.py": "try:\n    from .geo import *\nexcept ImportError:\n    pass\n",
        "fakeopt/geo.py": "import fakegeo\nGEO = fakegeo.WHO\n__all__ = ['GEO']\n",
        "fakegeo/__init__.py": "from preload_launcher.cuda import fake_cuinit\nfake_cuinit()\n"
                               "WHO = 'site'\n",
        "fakeopt-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fakeopt\nVersion: 1.0\n",
    })
    example = tmp_path / "example"
    write(example, {"fakegeo.py": "WHO = 'step'\n",
                    "main.py": "import fakeopt, fakegeo\nprint(fakegeo.WHO, fakeopt.GEO)\n"})
    env = dict(os.environ, PYTHONPATH=str(root), PRELOAD_LAUNCHER_PROBE="fake",
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    launcher = Launcher(["fakeopt"], project=str(tmp_path))
    try:
        assert "fakegeo" in launcher.zygote_for(env).status["preload"]["deferred"]
        for mode in ("lazy", "eager"):
            mode_env = dict(env, PRELOAD_LAUNCHER_DEFERRED=mode)
            ours, fresh = both(launcher, [PY, str(example / "main.py")], mode_env, tmp_path)
            assert ours.stdout == fresh.stdout == "step step\n", mode
    finally:
        launcher.close()


def learned_modules(launcher):
    profile = launcher.zygotes[0].status["preload"]["learned"]["profile"]
    with open(profile) as f:
        return set(json.load(f)["modules"])


def test_learning_skips_what_the_zygote_cannot_import(site, tmp_path):
    """Never learned: a namespace folder of the step's cwd (an example's ``scripts``), nor a
    module found only through a folder a library put on sys.path at run time (``onnx_model``)."""
    root, env = site
    project = tmp_path / "project"
    write(project, {"example_scripts/tool.py": "X = 1\n"})  # an example's ``scripts`` folder
    code = "import example_scripts.tool, fakeort, onnx_model, helperlib"
    first = Launcher(["json"], project=str(project))
    try:
        result = first.run([PY, "-c", code], env=env, cwd=str(project))
        assert result.returncode == 0, result.stdout
    finally:
        first.close()
    second = Launcher(["json"], project=str(project))
    try:
        second.zygote_for(env)
        learned = learned_modules(second)
        assert {"fakeort", "helperlib"} <= learned
        assert not learned & {"example_scripts", "example_scripts.tool", "onnx_model"}
        profile = second.zygotes[0].status["preload"]["learned"]["profile"]
    finally:
        second.close()
    # What an older profile learned that the zygote cannot import is dropped at its next start.
    with open(profile) as f:
        data = json.load(f)
    data["modules"]["example_scripts"] = {"count": 3, "seconds": None}
    with open(profile, "w") as f:
        json.dump(data, f)
    third = Launcher(["json"], project=str(project))
    try:
        assert third.zygote_for(env).status["preload"]["learned"]["failed"] == 1
        assert "example_scripts" not in learned_modules(third)
        assert "fakeort" in learned_modules(third)
    finally:
        third.close()


def test_a_tqdm_next_to_the_script_wins_over_the_one_torch_imported(torch_launcher, tmp_path):
    example = tmp_path / "example"
    write(example, {"tqdm.py": "WHO = 'step'\n",
                    "main.py": "import torch, tqdm\nprint(tqdm.__file__, tqdm.WHO)\n"})
    ours, fresh = both(torch_launcher, [PY, str(example / "main.py")], dict(os.environ), tmp_path)
    assert ours.stdout == fresh.stdout == f"{example / 'tqdm.py'} step\n"
