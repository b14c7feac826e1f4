"""A step's module table is a fresh interpreter's, and a variable a program sets before importing
a preloaded module is read as a fresh import reads it: the step runs on as a fresh interpreter,
or, where its output has begun, fails with one line. Each program runs plainly and through the
launcher: ``run()``, the CLI, the suite switch and torchrun's ranks, and the outputs are compared."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from preload_launcher import Launcher

from conftest import PY, plain

# What a lazy-import test checks, and what importing a preloaded module leaves.
TABLE = textwrap.dedent("""\
    import importlib.util, sys
    import mypkg
    print(sorted(m for m in ("json", "json.decoder", "logging") if m in sys.modules))
    print(importlib.util.find_spec("logging").origin, "logging" in sys.modules)
    import json
    print(sorted(m for m in sys.modules if m.partition(".")[0] == "json"))
    """)

# A script that configures a library before importing it, as example scripts do.
HUB = textwrap.dedent("""\
    import os, sys
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HOME"] = os.path.join(os.getcwd(), "hf-home")
    print("configured")
    import huggingface_hub.constants as constants
    print(constants.HF_HUB_OFFLINE, constants.HF_HOME == os.environ["HF_HOME"])
    """)

TORCH = textwrap.dedent("""\
    import os
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["PYTORCH_JIT"] = "0"
    import torch
    line = f"{os.environ.get('RANK', '-')} {torch.get_num_threads()} {torch.jit._state._enabled.enabled}"
    os.write(1, (line + "\\n").encode())
    """)


@pytest.fixture
def scripts(tmp_path):
    (tmp_path / "mypkg.py").write_text("VALUE = 1\n")
    for name, text in (("table.py", TABLE), ("hub.py", HUB), ("torch_env.py", TORCH)):
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.fixture(scope="module")
def hub_launcher():
    pytest.importorskip("huggingface_hub")
    launcher = Launcher(["huggingface_hub.constants"])
    yield launcher
    launcher.close()


def fresh_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHONUNBUFFERED"))}
    env.pop("OMP_NUM_THREADS", None)
    return dict(env, **extra)


def test_a_step_starts_with_a_fresh_interpreters_module_table(light, scripts):
    args = [PY, "table.py"]
    ours = light.run(args, cwd=scripts, env=fresh_env())
    assert ours.via == "zygote", ours.reason
    assert ours.stdout == plain(args, cwd=scripts, env=fresh_env()).stdout
    assert ours.stdout.startswith("[]\n")


def test_a_variable_set_before_the_import_is_read_as_fresh(hub_launcher, scripts):
    args = [PY, "hub.py"]
    ours = hub_launcher.run(args, cwd=scripts, env=fresh_env())
    assert ours.stdout == plain(args, cwd=scripts, env=fresh_env()).stdout == "configured\nTrue True\n"
    assert ours.via == "subprocess"
    assert ours.reason.startswith("run fresh: HF_") and "huggingface_hub.constants" in ours.reason


def test_a_step_that_changes_nothing_a_module_read_stays_forked(hub_launcher, scripts):
    (scripts / "other.py").write_text(HUB.replace('os.environ["HF_', 'os.environ["NOT_HF_'))
    ours = hub_launcher.run([PY, "other.py"], cwd=scripts, env=fresh_env())
    assert ours.via == "zygote", ours.reason
    assert ours.stdout == plain([PY, "other.py"], cwd=scripts, env=fresh_env()).stdout


def test_output_before_the_change_fails_with_one_line_naming_it(hub_launcher, scripts):
    args = [PY, "-u", "hub.py"]  # "configured" is written before the import
    ours = hub_launcher.run(args, cwd=scripts, env=fresh_env())
    assert plain(args, cwd=scripts, env=fresh_env()).stdout == "configured\nTrue True\n"
    first, message = ours.stdout.splitlines()
    assert (ours.returncode, first) == (1, "configured")
    assert message.startswith("preload_launcher: this step cannot go on: HF_")
    assert "huggingface_hub.constants" in message and "it had written output" in message


def test_torch_configured_before_its_import_through_run(torch_launcher, scripts):
    args = [PY, "torch_env.py"]
    ours = torch_launcher.run(args, cwd=scripts, env=fresh_env())
    assert ours.stdout == plain(args, cwd=scripts, env=fresh_env()).stdout == "- 1 False\n"
    assert ours.via == "subprocess"
    assert "OMP_NUM_THREADS" in ours.reason and "PYTORCH_JIT" in ours.reason


def test_torch_configured_before_its_import_in_torchrun_ranks(torch_launcher, scripts):
    args = ["torchrun", "--nproc-per-node=2", "torch_env.py"]
    env = fresh_env(OMP_NUM_THREADS="2")  # torchrun would set 1 for two ranks
    ours = torch_launcher.run(args, cwd=scripts, env=env)
    theirs = plain(args, cwd=scripts, env=env)
    assert ours.returncode == theirs.returncode == 0, ours.stdout
    assert sorted(ours.stdout.splitlines()) == sorted(theirs.stdout.splitlines()) == [
        "0 1 False", "1 1 False"]
    assert ours.via == "zygote" and ours.reason.startswith("a rank ran fresh: ")


def test_through_the_cli(scripts, runtime_base):
    pytest.importorskip("huggingface_hub")  # hub.py's
    env = fresh_env(PRELOAD_LAUNCHER_MODULES="huggingface_hub.constants,json",
                    XDG_RUNTIME_DIR=str(runtime_base))
    for script, via in (("hub.py", "via subprocess (run fresh: HF_"),
                        ("table.py", "via zygote")):
        ours = subprocess.run([PY, "-m", "preload_launcher.cli", "run", "-v", "--no-daemon", "--",
                               PY, script], cwd=scripts, env=env, capture_output=True, text=True,
                              timeout=300)
        assert ours.stdout == plain([PY, script], cwd=scripts, env=env).stdout
        assert via in ours.stderr, ours.stderr


SWITCHED = textwrap.dedent("""\
    import os, subprocess, sys

    import pytest

    @pytest.fixture(scope="session", autouse=True)
    def preloaded(preload_launcher):  # a stand-in asks only a zygote that serves
        if os.environ.get("PRELOAD_LAUNCHER") != "0":
            preload_launcher.zygote_for_standins(dict(os.environ)).wait_ready()

    def test_programs():
        with open(os.environ["RESULTS"], "w") as out:
            for name in ("hub.py", "table.py"):
                done = subprocess.run([sys.executable, name], capture_output=True, text=True)
                out.write(done.stdout)
    """)


def test_under_the_suite_switch(scripts, tmp_path):
    pytest.importorskip("huggingface_hub")  # hub.py's
    (scripts / "test_switched.py").write_text(SWITCHED)
    seen = {}
    for mode in ("0", "suite"):
        env = fresh_env(PRELOAD_LAUNCHER=mode, RESULTS=str(tmp_path / f"results-{mode}"),
                        PRELOAD_LAUNCHER_MODULES="huggingface_hub.constants,json")
        done = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "test_switched.py"], cwd=scripts, env=env, capture_output=True,
                              text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stdout + done.stderr
        seen[mode] = (tmp_path / f"results-{mode}").read_text(), done.stdout
    assert seen["suite"][0] == seen["0"][0]
    assert seen["0"][0].startswith("configured\nTrue True\n[]\n")
    # hub.py became a fresh interpreter (it set HF_HUB_OFFLINE before importing the hub): one fork
    assert "stand-ins had the zygote fork 1 interpreters" in seen["suite"][1], seen["suite"][1]
    assert "1 ran the real program because it ran fresh: HF_" in seen["suite"][1]


def test_start_up_settings_are_a_fresh_interpreters(light, tmp_path):
    show_path = [PY, "-c", "import sys; print(sys.path)"]
    env = fresh_env(PYTHONSAFEPATH="1")
    assert light.run(show_path, env=env, cwd=tmp_path).stdout == \
        plain(show_path, env=env, cwd=tmp_path).stdout
    # Import-time profiling and another bytecode cache folder: only a fresh start applies them.
    env = fresh_env(PYTHONPROFILEIMPORTTIME="1")
    ours = light.run([PY, "-c", "import colorsys"], env=env, cwd=tmp_path)
    assert ours.via == "subprocess" and "import-time profiling" in ours.reason
    names = lambda out: [line.rpartition("|")[2].strip() for line in out.splitlines()]  # noqa: E731
    assert names(ours.stdout) == names(plain([PY, "-c", "import colorsys"], env=env).stdout)
    env = fresh_env(PYTHONPYCACHEPREFIX=str(tmp_path / "pyc"))
    show_prefix = [PY, "-c", "import sys; print(sys.pycache_prefix)"]
    ours = light.run(show_prefix, env=env, cwd=tmp_path)
    assert ours.via == "subprocess" and "bytecode cache folder" in ours.reason
    assert ours.stdout == plain(show_prefix, env=env, cwd=tmp_path).stdout


def test_the_clis_own_interpreter_leaves_python_settings_to_the_command(runtime_base):
    """PYTHONINSPECT is the command's: the CLI's interpreter does not stay interactive after it."""
    env = fresh_env(PRELOAD_LAUNCHER_MODULES="json", XDG_RUNTIME_DIR=str(runtime_base),
                    PYTHONINSPECT="1")
    code = "import colorsys; print('done')"
    ours = subprocess.run([PY, "-m", "preload_launcher.cli", "run", "--no-daemon", "--", PY, "-c",
                           code], env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    theirs = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True,
                            stdin=subprocess.DEVNULL)
    assert (ours.returncode, ours.stdout, ours.stderr) == \
        (theirs.returncode, theirs.stdout, theirs.stderr) == (0, "done\n", "")


TQDM = textwrap.dedent("""\
    import os, sys
    if sys.argv[1:] == ["set"]:
        os.environ["TQDM_DISABLE"] = "1"
    from tqdm import tqdm
    print(tqdm(range(3)).disable)
    """)


@pytest.mark.parametrize("where", ["the step's environment", "the script"])
def test_settings_a_library_scans_the_environment_for_are_read_as_fresh(tmp_path, where):
    """tqdm reads its ``TQDM_*`` settings by scanning the environment at import."""
    pytest.importorskip("tqdm")
    (tmp_path / "bar.py").write_text(TQDM)
    env = fresh_env(PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    args = [PY, "bar.py"]
    if where == "the script":
        args.append("set")
    else:
        env["TQDM_DISABLE"] = "1"
    launcher = Launcher(["tqdm"])
    try:
        launcher.zygote_for(fresh_env())  # preloaded without the setting
        ours = launcher.run(args, cwd=tmp_path, env=env)
    finally:
        launcher.close()
    assert ours.stdout == plain(args, cwd=tmp_path, env=env).stdout == "True\n"
    if where == "the script":
        assert ours.via == "subprocess" and "TQDM_" in ours.reason
    else:
        assert ours.via == "zygote", ours.reason  # by a zygote started with it


def preloading_one_of_the_folders_own(folder, module: str, code: str):
    """(through a one-off zygote that preloads ``module`` from ``folder``, plainly) for
    ``python -c code`` with ``folder`` on PYTHONPATH."""
    env = fresh_env(PYTHONPATH=str(folder), PRELOAD_LAUNCHER_CACHE_DIR=str(folder / "cache"))
    launcher = Launcher(["json", module])
    try:
        got = launcher.run([PY, "-c", code], env=env, timeout=120)
    finally:
        launcher.close()
    return got, plain([PY, "-c", code], env=env, timeout=120)


def test_a_name_a_module_puts_under_itself_comes_back_with_it(tmp_path):
    """A module that is no package may put names under its own in ``sys.modules`` (``typing``
    puts ``typing.io`` there on 3.10, which pip's certifi imports): importing such a name
    after a preloaded import finds it, as in a fresh interpreter."""
    (tmp_path / "aliasing.py").write_text(
        "import sys, types\nview = types.ModuleType('aliasing.view')\nview.VALUE = 42\n"
        "sys.modules['aliasing.view'] = view\n")
    code = "from aliasing.view import VALUE\nimport aliasing.view\nprint(VALUE)\n"
    got, ref = preloading_one_of_the_folders_own(tmp_path, "aliasing", code)
    assert (got.via, got.returncode, got.stdout) == ("zygote", 0, ref.stdout) == \
        ("zygote", 0, "42\n")


PLACING = {
    "placing/__init__.py": textwrap.dedent("""\
        import importlib.util, os, sys, types
        ops = types.ModuleType("placing.ops")  # as torch puts torch.ops and torch.classes
        ops.VALUE = 1
        sys.modules.setdefault("placing.ops", ops)
        spec = importlib.util.spec_from_file_location(  # a plugin loaded by hand, then run
            "placing_plugin", os.path.join(os.path.dirname(__file__), "plugin.py"))
        plugin = importlib.util.module_from_spec(spec)
        sys.modules["placing_plugin"] = plugin
        spec.loader.exec_module(plugin)
        last = types.ModuleType("placing.last")  # placed after the import's last import
        last.VALUE = 3
        sys.modules["placing.last"] = last
        """),
    "placing/plugin.py": "import colorsys\nVALUE = 2\n",
}
PLACED = "sorted(n for n in sys.modules if n.startswith('placing'))"


@pytest.mark.parametrize("code", [
    f"import sys\nimport placing\nprint(placing.ops.VALUE, placing.plugin.VALUE, "
    f"placing.last.VALUE, {PLACED})\n",
    f"import sys\nprint({PLACED})\nimport placing.ops\nprint({PLACED})\n",
])
def test_a_module_an_import_puts_into_sys_modules_by_hand_comes_back_with_that_import(
        tmp_path, code):
    """What an import puts into ``sys.modules`` itself (torch's ``torch.ops``, a plugin loaded
    with ``module_from_spec``) is there after the step imports it, and an attribute of the
    package that holds it too, as in a fresh interpreter; not before."""
    for name, text in PLACING.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    got, ref = preloading_one_of_the_folders_own(tmp_path, "placing", code)
    assert (got.via, got.returncode, got.stdout) == ("zygote", 0, ref.stdout), got.stdout
    assert "placing_plugin" in ref.stdout


TRYING = {  # as modelopt tries its megatron plugins, catching the ImportError
    "trying/__init__.py": "try:\n    from trying import plugin\nexcept ImportError:\n"
                          "    plugin = None\n",
    "trying/plugin.py": "import colorsys\nfrom trying import helper\nimport not_installed_here\n",
    "trying/helper.py": "VALUE = 1\n",
}


def test_what_a_failed_import_imported_before_it_failed_comes_back_with_the_import_that_tried_it(
        tmp_path):
    """A package that tries a plugin and catches its ImportError keeps what the plugin imported
    before it failed (megatron.core's post_training modules after ``import modelopt.torch``
    without Transformer Engine): in ``sys.modules``, and a submodule as its package's
    attribute, as in a fresh interpreter."""
    for name, text in TRYING.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    code = ("import sys\nimport trying\nprint(trying.plugin, trying.helper.VALUE, 'colorsys' "
            "in sys.modules, sorted(n for n in sys.modules if n.startswith('trying')))\n")
    got, ref = preloading_one_of_the_folders_own(tmp_path, "trying", code)
    assert (got.via, got.returncode, got.stdout) == ("zygote", 0, ref.stdout), got.stdout
    assert ref.stdout == "None 1 True ['trying', 'trying.helper']\n"


@pytest.mark.needs_torch
def test_torch_ops_and_torch_compile_in_a_step(torch_launcher):
    """``torch.ops`` and ``torch.classes`` are names torch puts into ``sys.modules`` by hand;
    torch.compile's tracing looks operators up there."""
    code = textwrap.dedent("""\
        import torch
        print(torch.ops.aten.add.default, torch.classes.__name__)
        double = torch.compile(lambda x: x * 2 + 1, backend="eager")
        print(double(torch.ones(2)).tolist())
        """)
    env = fresh_env()
    got = torch_launcher.run([PY, "-c", code], env=env, timeout=300)
    ref = plain([PY, "-c", code], env=env, timeout=300)
    assert (got.via, got.returncode, got.stdout) == ("zygote", 0, ref.stdout), got.stdout
