"""A step's warning filters and exit handlers are a fresh interpreter's: python's own at its
start, and a preloaded module's only once the step imports that module, placed as its fresh
import places them (after what the step set itself; what a ``catch_warnings`` block set undone;
python's own finalizer handler kept).

Differential: the same programs plainly and through ``run()`` and the CLI (its daemon), with a
zygote that preloads a package whose import adds filters and exit handlers."""
import json
import os
import subprocess
import textwrap

import pytest

from preload_launcher import Launcher

from conftest import PY, plain

PACKAGE = {
    "filtering/__init__.py": textwrap.dedent("""\
        import warnings
        warnings.filterwarnings("ignore", message="filtering says")
        with warnings.catch_warnings():  # undone at the block's end
            warnings.simplefilter("ignore")
            from . import quiet
        warnings.filterwarnings("always", category=RuntimeWarning, append=True)
        import atexit, weakref
        atexit.register(print, "filtering's exit handler")
        class Kept: pass
        KEPT = Kept()
        weakref.finalize(KEPT, print).detach()  # registers python's finalizer exit handler
        """),
    "filtering/quiet.py": "import warnings\nwarnings.simplefilter('error', SyntaxWarning)\n",
    "filtering/sub.py": textwrap.dedent("""\
        import atexit, warnings
        warnings.filterwarnings('ignore', module='filtering')

        @atexit.register
        def goodbye():
            print("filtering.sub's exit handler")
        """),
}

# Each program's last line: whether a finalizer of its own runs at exit, as in python.
FINALIZER = "class Own: pass\nOWN = Own()\nimport weakref\nweakref.finalize(OWN, print, 'own finalizer')\n"
SHOW = ("def show():\n    return [(f[0], getattr(f[1], 'pattern', f[1]), f[2].__name__,"
        " getattr(f[3], 'pattern', f[3]), f[4]) for f in warnings.filters]\n")
# A step that never imports the package; one that sets its own filter first, then imports it.
PROGRAMS = {
    "never_imports": FINALIZER + "import json, warnings\n" + SHOW + "print(json.dumps(show()))\n",
    "imports_it": FINALIZER + "import json, warnings\n" + SHOW + textwrap.dedent("""\
        before = show()
        warnings.simplefilter("error", UserWarning)
        import filtering.sub
        print(json.dumps([before, show()]))
        """),
}


@pytest.fixture
def package(tmp_path):
    for name, text in PACKAGE.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=str(tmp_path),
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PYTHONWARNINGS", None)
    return env


@pytest.mark.parametrize("options", [[], ["-W", "error::DeprecationWarning"]])
def test_through_run(package, options):
    launcher = Launcher(["json", "filtering.sub"])
    try:
        for name, code in PROGRAMS.items():
            args = [PY, *options, "-c", code]
            got = launcher.run(args, env=package, timeout=120)
            ref = plain(args, env=package, timeout=120)
            assert (got.via, got.returncode) == ("zygote", 0), got.stdout
            assert got.stdout.splitlines()[1:] == ref.stdout.splitlines()[1:], name
            assert json.loads(got.stdout.splitlines()[0]) == json.loads(ref.stdout.splitlines()[0])
    finally:
        launcher.close()


def test_through_the_cli(package, runtime_base):
    env = dict(package, XDG_RUNTIME_DIR=str(runtime_base),
               PRELOAD_LAUNCHER_MODULES="json,filtering.sub")
    cli = [PY, "-m", "preload_launcher.cli"]
    started = subprocess.run([*cli, "serve", "--detach"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert started.returncode == 0, started.stderr
    try:
        for name, code in PROGRAMS.items():
            got = subprocess.run([*cli, "run", "-v", "--", PY, "-c", code], env=env,
                                 capture_output=True, text=True, timeout=300)
            assert "via zygote" in got.stderr, got.stderr
            ref = plain([PY, "-c", code], env=env).stdout
            assert got.stdout.splitlines()[1:] == ref.splitlines()[1:], name
            assert json.loads(got.stdout.splitlines()[0]) == json.loads(ref.splitlines()[0])
    finally:
        subprocess.run([*cli, "stop"], env=env, capture_output=True, timeout=120)


def test_a_step_leaves_the_zygotes_objects_to_the_zygote(tmp_path):
    """A temporary folder a preloaded module made at import is the zygote's: a step's exit does
    not remove it from under the next step (a fresh interpreter has its own)."""
    (tmp_path / "scratch.py").write_text("import tempfile\nFOLDER = tempfile.TemporaryDirectory()\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TMPDIR=str(tmp_path),
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    code = "import os, scratch\nprint(os.path.isdir(scratch.FOLDER.name))\n"
    launcher = Launcher(["json", "scratch"])
    try:
        got = [launcher.run([PY, "-c", code], env=env, timeout=120) for _ in range(2)]
    finally:
        launcher.close()
    ref = plain([PY, "-c", code], env=env, timeout=120)
    assert [(g.via, g.stdout) for g in got] == [("zygote", ref.stdout)] * 2 == [("zygote", "True\n")] * 2


def test_the_temporary_folder_is_the_steps_own_where_a_preloaded_import_settled_it(tmp_path):
    """tempfile settles its folder at the first ``gettempdir()``; torch._dynamo's import makes
    that call. A step settles its own from its environment of that moment, as fresh."""
    (tmp_path / "settles_tmp.py").write_text("import tempfile\nFOLDER = tempfile.gettempdir()\n")
    zygote_tmp, step_tmp = tmp_path / "zygote-tmp", tmp_path / "step-tmp"
    zygote_tmp.mkdir()
    step_tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TMPDIR=str(zygote_tmp),
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    programs = {  # its own TMPDIR set before tempfile is asked; the module's import asks first
        "sets_its_own": f"import os\nos.environ['TMPDIR'] = {str(step_tmp)!r}\n"
                        "import tempfile\nprint(tempfile.gettempdir())\n",
        "imports_it": f"import os, settles_tmp\nos.environ['TMPDIR'] = {str(step_tmp)!r}\n"
                      "import tempfile\nprint(settles_tmp.FOLDER, tempfile.gettempdir())\n",
    }
    launcher = Launcher(["settles_tmp"])
    try:
        for name, code in programs.items():
            got = launcher.run([PY, "-c", code], env=env, timeout=120)
            ref = plain([PY, "-c", code], env=env, timeout=120)
            assert (got.via, got.returncode) == ("zygote", 0), got.stdout
            assert got.stdout == ref.stdout, name
        assert ref.stdout == f"{zygote_tmp} {zygote_tmp}\n"  # (the last program's, plainly)
    finally:
        launcher.close()
