import os
import sys

import pytest

from preload_launcher.command import (StepSpec, Unsupported, parse_command, parse_python_argv,
                                      runner_env_of)

ENV = dict(os.environ)


def test_python_forms_are_served():
    spec = parse_command([sys.executable, "-u", "-B", "-W", "ignore", "-Xfaulthandler", "s.py", "a"],
                         ENV, "/tmp")
    assert isinstance(spec, StepSpec)
    t = spec.target
    assert (t.kind, t.value, t.args) == ("script", "s.py", ["a"])
    assert t.unbuffered and t.dont_write_bytecode
    assert t.warnoptions == ["ignore"] and t.xoptions == ["faulthandler"]


def test_module_and_code_forms():
    assert parse_python_argv(["python", "-m", "pkg.mod", "--x"]).args == ["--x"]
    t = parse_python_argv(["python", "-uc", "print(1)", "z"])
    assert (t.kind, t.value, t.args, t.unbuffered) == ("code", "print(1)", ["z"], True)
    assert parse_python_argv(["python", "-mpkg"]).value == "pkg"


def test_unknown_or_unsafe_forms_fall_back():
    for argv in (["python", "-E", "s.py"], ["python"], ["python", "-", "x"],
                 ["python", "-X", "importtime", "s.py"], ["python", "-I", "s.py"]):
        assert isinstance(parse_python_argv(argv), Unsupported), argv
    assert isinstance(parse_command([], ENV, "/tmp"), Unsupported)
    assert isinstance(parse_command(["bash", "-c", "true"], ENV, "/tmp"), Unsupported)
    assert isinstance(parse_command(["/no/such/python3", "s.py"], ENV, "/tmp"), Unsupported)


@pytest.mark.needs_torch
def test_torchrun_forms():
    spec = parse_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "s.py"],
                         ENV, "/tmp")
    assert spec.torchrun_args == ["--nproc-per-node=2", "s.py"]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    spec = parse_command([torchrun, "--nproc_per_node", "2", "s.py"], ENV, "/tmp")
    assert isinstance(spec, StepSpec) and spec.torchrun_args[0] == "--nproc_per_node"


def test_spec_round_trips_as_json():
    spec = parse_command([sys.executable, "-c", "pass", "\udcff"], ENV, "/tmp")
    again = StepSpec.from_json_dict(spec.to_json_dict())
    assert again == spec


def test_only_a_console_script_naming_this_interpreter_alone_is_served(tmp_path):
    """A ``#!`` line with an option, ``env``, a shell or another interpreter: the real program."""
    env = dict(ENV, PATH=f"{tmp_path}{os.pathsep}{ENV['PATH']}")
    lines = {"plain": f"#!{sys.executable}", "spaced": f"#!  {sys.executable}  ",
             "option": f"#!{sys.executable} -u", "env": "#!/usr/bin/env python3",
             "shell": "#!/bin/sh", "other": "#!/no/such/python3", "relative": "#!python3"}
    for name, line in lines.items():
        (tmp_path / name).write_text(f"{line}\nprint('x')\n")
        (tmp_path / name).chmod(0o755)
    (tmp_path / "not_executable").write_text(f"#!{sys.executable}\n")
    served = {name for name in [*lines, "not_executable"]
              if isinstance(parse_command([name, "a"], env, str(tmp_path)), StepSpec)}
    assert served == {"plain", "spaced"}
    t = parse_command(["plain", "a"], env, "/").target
    assert (t.kind, t.value, t.args, t.prog) == ("script", str(tmp_path / "plain"), ["a"],
                                                 sys.executable)


def test_a_pytest_step_imports_with_what_pytest_sets_for_itself():
    """pytest sets PYTEST_VERSION in its own process before a conftest loads: a pytest step is
    chosen a zygote by its environment with it; any other step by its own."""
    import importlib.metadata
    version = {"PYTEST_VERSION": importlib.metadata.version("pytest")}
    spec = parse_command([sys.executable, "-m", "pytest", "-q"], ENV, "/tmp")
    assert spec.target.runner_env == version and spec.env == ENV  # its own environment as given
    assert spec.import_env() == {**ENV, **version}
    assert StepSpec.from_json_dict(spec.to_json_dict()).import_env() == spec.import_env()
    other = parse_command([sys.executable, "-c", "pass"], ENV, "/tmp")
    assert other.target.runner_env == {} and other.import_env() == ENV
    assert runner_env_of(["pytest", "-x"]) == runner_env_of(["python3", "-m", "py.test"]) == version
    assert runner_env_of(["python3", "pytest.py"]) == runner_env_of(["torchrun", "-m", "pytest"]) == {}
