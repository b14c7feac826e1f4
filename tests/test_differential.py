"""The same programs as plain subprocesses and through run(): every observation must agree."""
import json
import os
import sys

import pytest

from conftest import PY, plain, program

# Observations that differ between any two fresh processes, compared separately.
PER_PROCESS = ("random", "torch_rand")


def observe(runner, args, **kwargs):
    # env=None means os.environ for run(); C code may putenv() behind os.environ's back, and
    # subprocess would pass that on, so both get the same explicit mapping.
    kwargs.setdefault("env", dict(os.environ))
    result = runner(args, **kwargs)
    assert result.returncode == 0, result.stdout
    return json.loads(result.stdout.strip().splitlines()[-1])


def strip(obs):
    return {k: v for k, v in obs.items() if k not in PER_PROCESS}


@pytest.mark.parametrize("form", ["script", "relative-script", "module", "code", "options"])
def test_fresh_interpreter_observations_match(light, tmp_path, form):
    env = dict(os.environ, OBSERVE_MARKER="m1", PYTHONPATH=os.path.dirname(program("observe.py")))
    src = open(program("observe.py")).read()
    args = {
        "script": [PY, program("observe.py"), "arg1", "--flag"],
        "relative-script": [PY, "programs/observe.py", "x"],
        "module": [PY, "-m", "observe", "y"],
        "code": [PY, "-c", src, "z"],
        "options": [PY, "-uB", "-Wdefault", "-c" + src, "--", "w"],
    }[form]
    cwd = os.path.dirname(os.path.dirname(program("observe.py"))) if form == "relative-script" \
        else str(tmp_path)
    ref = observe(plain, args, cwd=cwd, env=env)
    got_result = light.run(args, cwd=cwd, env=env)
    assert got_result.via == "zygote", got_result.reason
    got = json.loads(got_result.stdout.strip().splitlines()[-1])
    assert strip(got) == strip(ref)


def test_random_streams_differ_between_steps(light):
    draws = {observe(light.run, [PY, program("observe.py")])["random"] for _ in range(3)}
    assert len(draws) == 3


def test_torch_generator_starts_fresh_in_every_step(torch_launcher):
    args = [PY, program("observe.py"), "torch"]
    ref = observe(plain, args)
    runs = [torch_launcher.run(args) for _ in range(3)]
    assert {r.via for r in runs} == {"zygote"}
    obs = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
    assert len({o["torch_rand"] for o in obs}) == 3  # torch seeds from entropy per process
    assert {o["torch_threads"] for o in obs} == {ref["torch_threads"]}
    assert strip(obs[0]) == strip(ref)


def test_python_options_are_applied(light):
    args = [PY, "-B", "-W", "error::DeprecationWarning", program("observe.py")]
    assert strip(observe(light.run, args)) == strip(observe(plain, args))


@pytest.mark.parametrize("how,code", [("ok", 0), ("code3", 3), ("message", 1), ("raise", 1),
                                      ("signal", -15), ("segv", -11), ("atexit", 0),
                                      ("thread", 0), ("keyboard", -2), ("gc-callback", 0),
                                      ("hook-raises", 1), ("hook-none", 1), ("hook-missing", 1),
                                      ("hook-exits", 7)])
def test_exit_semantics_match(light, how, code):
    args = [PY, program("exits.py"), how]
    ref = plain(args)
    got = light.run(args)
    assert got.via == "zygote"
    assert (got.returncode, ref.returncode) == (code, code)
    assert got.stdout == ref.stdout


def test_missing_script_is_pythons_own_error(light, tmp_path):
    args = [PY, str(tmp_path / "nope.py")]
    ref, got = plain(args), light.run(args)
    assert got.via == "zygote"
    assert (got.returncode, got.stdout) == (ref.returncode, ref.stdout) == (2, ref.stdout)
    assert "can't open file" in got.stdout


def test_missing_module_is_pythons_own_error(light):
    args = [PY, "-m", "no_such_module_xyz"]
    ref, got = plain(args), light.run(args)
    assert (got.returncode, got.stdout) == (ref.returncode, ref.stdout)


def test_interleaved_output_order_is_kept(light):
    code = ("import sys\nfor i in range(200):\n    print('out', i, flush=True)\n"
            "    print('err', i, file=sys.stderr, flush=True)\n")
    ref, got = plain([PY, "-c", code]), light.run([PY, "-c", code])
    assert got.stdout == ref.stdout


CONSOLE_SCRIPT = (
    "import json, sys\n"
    "print(json.dumps({'argv': sys.argv, 'executable': sys.executable, 'orig_argv': sys.orig_argv,\n"
    "                  'path0': sys.path[0], 'file': __file__, 'name': __name__}))\n"
    "sys.exit(5)\n")


def another_name_of_this_interpreter() -> str:
    """A sibling name of sys.executable (python3.X beside python3): the ``#!`` line's name is
    the program's sys.executable, not ours."""
    folder = os.path.dirname(PY)
    names = ["python", "python3", "python{}.{}".format(*sys.version_info[:2])]
    others = [os.path.join(folder, n) for n in names if os.path.join(folder, n) != PY]
    return next((p for p in others if os.path.exists(p)
                 and os.path.realpath(p) == os.path.realpath(PY)), PY)


@pytest.mark.parametrize("form", ["on-path", "absolute", "relative", "linked-on-path"])
def test_a_console_script_of_this_interpreter_runs_as_the_kernel_starts_it(light, tmp_path, form):
    """``pytest …`` and the like: a file whose ``#!`` line names this interpreter is python
    started with the script as found (argv[0]) and the ``#!`` line's interpreter."""
    bin_dir, links = tmp_path / "bin", tmp_path / "links"
    bin_dir.mkdir()
    links.mkdir()
    tool = bin_dir / "tool"
    tool.write_text(f"#!{another_name_of_this_interpreter()}\n{CONSOLE_SCRIPT}")
    tool.chmod(0o755)
    (links / "linked").symlink_to(tool)
    env = dict(os.environ, PATH=f"{links}{os.pathsep}{bin_dir}{os.pathsep}{os.environ['PATH']}")
    command = {"on-path": "tool", "absolute": str(tool), "relative": "bin/tool",
               "linked-on-path": "linked"}[form]
    args = [command, "an arg", "--flag"]
    ref = plain(args, cwd=str(tmp_path), env=env)
    got = light.run(args, cwd=str(tmp_path), env=env)
    assert got.via == "zygote", got.reason
    assert (got.returncode, ref.returncode) == (5, 5)
    assert json.loads(got.stdout) == json.loads(ref.stdout)


def test_every_setting_python_takes_from_the_environment_has_a_rule():
    """A start-up variable without a rule would be whatever the zygote's first step had."""
    import re
    from preload_launcher import settings
    documented = subprocess_help_env()
    if documented is None:
        pytest.skip("this python has no --help-env (3.11+)")
    ruled = set(settings.IMPORT_ENV_KEYS + settings.STARTUP_FLAG_ENV + settings.STEP_STARTUP_ENV
                + settings.FRESH_START_ENV + settings.STEP_ENV)
    assert sorted(set(re.findall(r"\bPYTHON[A-Z0-9_]*[A-Z0-9]", documented)) - ruled) == []


def subprocess_help_env():
    import subprocess
    done = subprocess.run([PY, "--help-env"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


STARTUP = {"PYTHONFAULTHANDLER": "1", "PYTHONNODEBUGRANGES": "1", "PYTHONMALLOC": "malloc",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONTRACEMALLOC": "2"}


def test_no_step_gets_a_start_up_setting_of_another_steps(tmp_path):
    """The first step (which starts the zygote) sets them, the second does not, the third does
    again: each observes what a fresh interpreter under its own environment does."""
    from preload_launcher import Launcher
    base = {k: v for k, v in os.environ.items() if k not in STARTUP}
    launcher = Launcher(["json"])
    try:
        for step, env in enumerate((dict(base, **STARTUP), base, dict(base, **STARTUP))):
            args = [PY, program("startup_settings.py")]
            ref = observe(plain, args, cwd=str(tmp_path), env=env)
            got = launcher.run(args, cwd=str(tmp_path), env=env)
            assert got.returncode == 0, got.stdout
            assert json.loads(got.stdout.strip().splitlines()[-1]) == ref, step
    finally:
        launcher.close()


def test_loggers_a_preloaded_import_made_are_the_steps_once_it_imports_it(tmp_path):
    """dictConfig (disable_existing_loggers) before the import: the library's loggers stay
    enabled, as they do plainly (they were disabled: they existed already in the zygote)."""
    from preload_launcher import Launcher
    site = os.path.join(os.path.dirname(program("observe.py")), "site_loggers")
    env = dict(os.environ, PYTHONPATH=site)
    launcher = Launcher(["json", "logging", "makes_loggers"])
    try:
        args = [PY, program("logging_config.py")]
        ref = plain(args, cwd=str(tmp_path), env=env)
        got = launcher.run(args, cwd=str(tmp_path), env=env)
        assert got.via == "zygote", got.reason
        assert "makes_loggers" in launcher.zygotes[0].status["preload"]["loaded"]
        assert (got.returncode, got.stdout) == (ref.returncode, ref.stdout)
        assert "library says hello" in ref.stdout
    finally:
        launcher.close()


def test_a_spawn_pools_results_of_the_scripts_own_classes(tmp_path):
    """multiprocessing's import makes __main__ also __mp_main__; a result of a class the script
    defines is unpickled through it (forked, it was the zygote's __main__: the pool's result
    thread failed on the attribute and map() waited for ever)."""
    from preload_launcher import Launcher
    launcher = Launcher(["json", "multiprocessing"])
    try:
        args = [PY, program("spawn_pool_result.py")]
        ref = plain(args, cwd=str(tmp_path))
        got = launcher.run(args, cwd=str(tmp_path), timeout=120)  # bounds a hang only
        assert got.via == "zygote", got.reason
        assert (got.returncode, got.stdout) == (ref.returncode, ref.stdout)
        assert "[Result(2), Result(4)]" in ref.stdout
    finally:
        launcher.close()


def test_a_submodule_the_step_has_not_imported_is_no_attribute_of_its_package(tmp_path):
    """``from pkg import sub`` after setting sub's variable: sub is imported then, and reads it
    (forked, pkg held the zygote's sub as an attribute: the variable was silently not read)."""
    from preload_launcher import Launcher
    site = os.path.join(os.path.dirname(program("observe.py")), "site_lazy")
    env = dict(os.environ, PYTHONPATH=site)
    env.pop("LAZY_PKG_OFFLINE", None)
    launcher = Launcher(["json", "lazy_pkg", "imports_constants"])
    try:
        args = [PY, program("configure_then_import.py")]
        ref = plain(args, cwd=str(tmp_path), env=env)
        got = launcher.run(args, cwd=str(tmp_path), env=env)
        assert "imports_constants" in launcher.zygotes[0].status["preload"]["loaded"]
        assert (got.returncode, got.stdout) == (ref.returncode, ref.stdout)
        assert ref.stdout.split() == ["before", "False", "offline", "True"]
    finally:
        launcher.close()


@pytest.mark.parametrize("own", [None, "the-callers-own"])
def test_a_variable_a_preloaded_import_sets_arrives_with_that_import(tmp_path, own):
    """Before the step imports the module, neither it nor a process it starts has the variable
    (both had it from the step's first line); the import replaces a value the environment
    gave, as it does in a fresh interpreter (the step kept its own)."""
    from preload_launcher import Launcher
    site = os.path.join(os.path.dirname(program("observe.py")), "site_env")
    env = dict(os.environ, PYTHONPATH=site)
    env.pop("SETS_ENV_CACHE", None)
    if own is not None:
        env["SETS_ENV_CACHE"] = own
    launcher = Launcher(["json", "sets_env"])
    try:
        args = [PY, program("env_set_at_import.py")]
        ref = plain(args, cwd=str(tmp_path), env=env)
        got = launcher.run(args, cwd=str(tmp_path), env=env)
        assert got.via == "zygote", got.reason
        assert (got.returncode, got.stdout) == (ref.returncode, ref.stdout)
        assert ref.stdout.strip() == f"[{own!r}, '{own}', 'cache-of-sets-env']"
    finally:
        launcher.close()


@pytest.mark.needs_torch
def test_import_torch_brings_what_a_fresh_one_does(tmp_path):
    """The zygote preloaded torch._dynamo: `import torch` in a step hands back torch's own
    imports only (dynamo came too, through an edge a package's attributes made up)."""
    from preload_launcher import Launcher
    launcher = Launcher(["torch", "torch._dynamo"])
    try:
        args = [PY, program("torch_submodules.py")]
        ref = plain(args, cwd=str(tmp_path))
        got = launcher.run(args, cwd=str(tmp_path), timeout=300)
        assert got.via == "zygote", got.reason
        assert (got.returncode, got.stdout) == (ref.returncode, ref.stdout)
    finally:
        launcher.close()


def test_a_variable_read_with_a_default_may_hold_that_default(tmp_path):
    """Megatron sets ``NVTE_FLASH_ATTN=1`` in a process that builds a model; Transformer Engine
    read it unset at import as ``os.getenv("NVTE_FLASH_ATTN", "1")``: the same. Such a step is
    served (every process a rank or test started after a model was built ran plainly); one
    holding another value, a variable a read could tell from unset, or one the import itself
    sets after reading it, is not, as before."""
    from preload_launcher import Launcher
    site = os.path.join(os.path.dirname(program("observe.py")), "site_defaults")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFAULTS_")}
    env["PYTHONPATH"] = site
    launcher = Launcher(["json", "reads_defaults"])
    try:
        launcher.prestart(env)
        # (the step's environment, what it sets before the import) -> served by the same zygote
        for extra, sets, served in (({"DEFAULTS_FLASH": "1"}, [], True),
                                    ({"DEFAULTS_FLASH": "0"}, [], False),
                                    ({"DEFAULTS_STRICT": "1"}, [], False),
                                    ({}, ["DEFAULTS_FLASH=1"], True),
                                    ({}, ["DEFAULTS_FLASH=0"], False),
                                    ({}, ["DEFAULTS_STRICT=1"], False),
                                    # read with its default, then set by the import itself
                                    ({"DEFAULTS_OVERRIDDEN": "1"}, [], False),
                                    ({}, ["DEFAULTS_OVERRIDDEN=1"], False)):
            args = [PY, program("read_defaults.py"), *sets]
            step_env = dict(env, **extra)
            ref = plain(args, cwd=str(tmp_path), env=step_env)
            got = launcher.run(args, cwd=str(tmp_path), env=step_env)
            assert ref.returncode == 0, ref.stdout
            assert (got.returncode, got.stdout) == (ref.returncode, ref.stdout), (extra, sets)
            same_zygote = len(launcher.zygotes) == 1
            forked = got.via == "zygote"
            assert (same_zygote and forked) == served, (extra, sets, got.via, got.reason)
            if not same_zygote:  # started for this environment; the next case starts over
                launcher.zygotes.pop().close()
    finally:
        launcher.close()


def test_a_packages_own_binding_survives_a_submodule_of_that_name(tmp_path):
    """bound_pkg.sub is a function until something imports bound_pkg.sub (then the module):
    a step that imports only the package sees the function, as a fresh one does."""
    from preload_launcher import Launcher
    site = os.path.join(os.path.dirname(program("observe.py")), "site_lazy")
    env = dict(os.environ, PYTHONPATH=site)
    code = ("import bound_pkg\nprint(type(bound_pkg.sub).__name__)\nimport bound_pkg.sub\n"
            "print(type(bound_pkg.sub).__name__)\n")
    launcher = Launcher(["json", "bound_pkg", "imports_bound_sub"])
    try:
        ref = plain([PY, "-c", code], cwd=str(tmp_path), env=env)
        got = launcher.run([PY, "-c", code], cwd=str(tmp_path), env=env)
        assert got.via == "zygote", got.reason
        assert (got.returncode, got.stdout) == (ref.returncode, ref.stdout) == (0, "function\nmodule\n")
    finally:
        launcher.close()
