"""Stage 1: a command line -> a ``StepSpec`` the zygote can serve, or the reason it cannot.

Only forms whose meaning is certain are served; everything else runs as a plain subprocess.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

__all__ = ["StepSpec", "PythonTarget", "Unsupported", "parse_command", "parse_python_argv",
           "runner_env", "runner_env_of", "import_environment"]

# -X options that can be honoured in a forked child (others, warn_default_encoding among them,
# set sys.flags at interpreter start-up).
APPLICABLE_XOPTIONS = ("faulthandler", "tracemalloc")


@dataclass
class PythonTarget:
    """What ``python [opts] script|-m mod|-c code args…`` runs."""

    kind: str  # "script", "module" or "code"
    value: str
    args: list[str] = field(default_factory=list)
    prog: str = "python"  # argv[0] as typed, for python's own error messages
    unbuffered: bool = False
    dont_write_bytecode: bool = False
    warnoptions: list[str] = field(default_factory=list)
    xoptions: list[str] = field(default_factory=list)
    executable: str = ""  # sys.executable as python computes it from argv[0] ("" = the zygote's)
    # torchrun --run-path: the agent's sys.path[0], which its spawned worker keeps (the
    # script's folder is not on sys.path) before ``runpy.run_path`` runs the script as given
    run_path_from: Optional[str] = None
    # What the test runner it starts sets in its own process before any test code (runner_env).
    runner_env: dict = field(default_factory=dict)
    # The command line as given up to the script, module or code ([] = rebuilt from the above)
    head: list[str] = field(default_factory=list)

    def command_line(self) -> list[str]:
        """The argv ``execve`` gives a fresh interpreter (its ``sys.orig_argv``): as given
        (``-uB``, ``-Werror``, ``-cCODE`` stay as typed), else rebuilt."""
        if self.head:
            return [*self.head, *self.args]
        flags = (["-u"] if self.unbuffered else []) + (["-B"] if self.dont_write_bytecode else [])
        for w in self.warnoptions:
            flags += ["-W", w]
        for x in self.xoptions:
            flags += ["-X", x]
        lead = [] if self.kind == "script" else [f"-{self.kind[0]}"]
        return [self.prog, *flags, *lead, self.value, *self.args]


@dataclass
class StepSpec:
    """One step as the zygote's child receives it (plain data, sent as JSON)."""

    args: list[str]
    env: dict[str, str]
    cwd: str
    target: Optional[PythonTarget] = None  # single-rank python step
    torchrun_args: Optional[list[str]] = None  # multi-rank step: torchrun's own arguments
    grace_s: float = 30.0  # SIGTERM -> SIGKILL grace for sibling ranks (torchrun's default)
    spawned: bool = False  # an interpreter a step's multiprocessing started (standin)
    nested: bool = False  # a stand-in's command line, for the zygote to classify (standin)
    accelerate_args: Optional[list[str]] = None  # ``accelerate launch``'s own arguments
    fd_targets: Optional[list[int]] = None  # where the passed fds go; default stdin, output
    stdout_file: str = ""  # a rank's torchrun log files (--redirects/--tee); "" = the console
    stderr_file: str = ""
    # Torch's (intra, inter)-op threads in a fresh interpreter, by thread env (the zygote's).
    thread_counts: dict = field(default_factory=dict)
    # The caller's umask, rlimits, CPU affinity, nice, ignored and blocked signals at call time
    # (process_attrs), which a subprocess would inherit.
    process: dict = field(default_factory=dict)

    def to_json_dict(self) -> dict:
        return asdict(self)

    def import_env(self) -> dict[str, str]:
        """The environment a zygote is chosen by (``import_environment``)."""
        return import_environment(self.to_json_dict())

    @classmethod
    def from_json_dict(cls, data: dict) -> "StepSpec":
        target = data.get("target")
        return cls(**{**data, "target": PythonTarget(**target) if target else None})


@dataclass
class Unsupported:
    """The command is not one the zygote serves; ``reason`` says why."""

    reason: str


# A test runner's own settings: pytest sets PYTEST_VERSION in its main(), before it loads a
# conftest, keeps it for the whole run, and every program a test starts inherits it.
PYTEST_NAMES = ("pytest", "py.test")


@functools.lru_cache(maxsize=None)
def _installed_version(distribution: str) -> str:
    import importlib.metadata  # only for a step that starts a test runner
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def runner_env(target: PythonTarget) -> dict[str, str]:
    """What the test runner ``target`` starts (``python -m pytest``, the ``pytest`` console
    script) sets in its own process before it imports a test's code: the environment its
    imports and its tests' programs see. A preloaded module may read it at import (modelopt's
    triton kernels keep fewer autotune configs under pytest), so the step is matched with a
    zygote, and its module table checked, as if it had started with it."""
    runs_pytest = (target.kind == "module" and target.value in PYTEST_NAMES) or (
        target.kind == "script" and os.path.basename(target.value) in PYTEST_NAMES)
    version = _installed_version("pytest") if runs_pytest else ""
    return {"PYTEST_VERSION": version} if version else {}


def runner_env_of(args: list[str]) -> dict[str, str]:
    """``runner_env`` of a command line (``{}`` for anything but a test runner)."""
    if args and os.path.basename(args[0]) in PYTEST_NAMES:
        return runner_env(PythonTarget(kind="script", value=args[0]))
    target = parse_python_argv(list(args)) if args and _looks_like_python(args[0]) else None
    return runner_env(target) if isinstance(target, PythonTarget) else {}


def import_environment(spec: dict) -> dict[str, str]:
    """A step's environment (``StepSpec.to_json_dict()``) as its imports see it, where a
    zygote's choice goes: its own, with what the test runner it starts sets for itself."""
    return {**spec["env"], **((spec.get("target") or {}).get("runner_env") or {})}


def _shebang_interpreter(path: str) -> Optional[str]:
    """The interpreter named by a script's ``#!`` line, or None."""
    try:
        with open(path, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    if not words:
        return None
    if os.path.basename(words[0]) == "env" and len(words) > 1:
        return None  # "#!/usr/bin/env X" depends on PATH: ask the program instead
    return words[0]


@functools.lru_cache(maxsize=64)
def _probe_executable(program: str, path_env: str, cwd: str, selector: str) -> Optional[str]:
    """Ask a wrapper (pyenv shim, ``env`` shebang) which interpreter it really starts."""
    env = dict(os.environ, PATH=path_env)
    env.update(json.loads(selector))
    try:
        out = subprocess.run([program, "-c", "import sys; print(sys.executable)"], env=env,
                             cwd=cwd or None, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _same_file_and_dir(a: str, b: str) -> bool:
    # A venv's bin/python links to the base interpreter but starts with another sys.prefix.
    return (os.path.realpath(a) == os.path.realpath(b)
            and os.path.dirname(os.path.abspath(a)) == os.path.dirname(os.path.abspath(b)))


def resolves_to_this_interpreter(program: str, env: dict[str, str], cwd: str,
                                 python_sibling: bool = False) -> bool:
    """True when ``program`` (through the step's PATH) starts ``sys.executable``.

    Binaries are compared by file and directory; ``#!`` scripts by their interpreter;
    wrappers (pyenv shims, ``#!/usr/bin/env``) are asked once. ``python_sibling`` asks the
    ``python`` beside a wrapper instead (for ``torchrun``, which takes no ``-c``).
    """
    path_env = env.get("PATH", os.defpath)
    found = program if os.sep in program else shutil.which(program, path=path_env)
    if not found or not os.path.isfile(found):
        return False
    if cwd and not os.path.isabs(found):
        found = os.path.join(cwd, found)
    if _same_file_and_dir(found, sys.executable):
        return True
    with open(found, "rb") as f:
        is_script = f.read(2) == b"#!"
    if not is_script:
        return False
    interpreter = _shebang_interpreter(found)
    if interpreter is not None and not interpreter.endswith("sh"):
        return _same_file_and_dir(interpreter, sys.executable)
    probe = os.path.join(os.path.dirname(found), "python") if python_sibling else found
    selector = json.dumps({k: v for k, v in env.items() if k.startswith(("PYENV", "VIRTUAL_ENV"))},
                          sort_keys=True)
    return _probe_executable(probe, path_env, cwd, selector) == sys.executable


def _invoked_path(program: str, env: dict[str, str], cwd: str) -> str:
    """``sys.executable`` as python computes it from ``argv[0]``: a path is made absolute
    (links kept), a bare name is looked up on PATH."""
    found = program if os.sep in program else shutil.which(program, path=env.get("PATH", os.defpath))
    return os.path.normpath(os.path.join(cwd, found)) if found else ""


def launcher_interpreter(args: list[str], env: dict[str, str], cwd: str) -> str:
    """The interpreter a launcher (``torchrun``, ``accelerate``, ``python -m …``) runs in, as
    its own ``sys.executable`` reads: what it starts its programs with. A console script
    names it on its ``#!`` line; behind a wrapper (a pyenv shim), the script of the same name
    beside this interpreter does."""
    if _looks_like_python(args[0]):
        return _invoked_path(args[0], env, cwd) or sys.executable
    script = _launcher_script(args, env, cwd)
    return script[1] if script else sys.executable


def launcher_path0(args: list[str], env: dict[str, str], cwd: str) -> str:
    """The launcher's ``sys.path[0]`` (which a worker torchrun spawns keeps): the cwd for
    ``python -m``, else its console script's folder, links resolved."""
    if _looks_like_python(args[0]):
        return cwd
    script = _launcher_script(args, env, cwd)
    return os.path.dirname(os.path.realpath(script[0] if script else sys.executable))


def _launcher_script(args: list[str], env: dict[str, str], cwd: str) -> Optional[tuple[str, str]]:
    """(the console script a launcher's command runs, the interpreter its ``#!`` names)."""
    found = args[0] if os.sep in args[0] else shutil.which(args[0], path=env.get("PATH", os.defpath))
    for script in (os.path.join(cwd, found) if found else "",
                   os.path.join(os.path.dirname(sys.executable), os.path.basename(args[0]))):
        interpreter = _shebang_interpreter(script) if script else None
        if interpreter and not interpreter.endswith("sh"):
            return script, interpreter
    return None


BINPRM_BUF_SIZE = 256  # Linux reads this much of a script for its ``#!`` line


def console_script_interpreter(path: str) -> Optional[str]:
    """The interpreter the kernel starts an executable ``path`` with when it is a console
    script of this interpreter (``pytest``, a ``pip install``'s entry points): its ``#!`` line
    names exactly this interpreter, by an absolute path and without options. None for anything
    else (a wrapper, ``env``, a shell, another python, a file not executable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(BINPRM_BUF_SIZE)
    except OSError:
        return None
    line, newline, _ = head.partition(b"\n")
    if not (line.startswith(b"#!") and newline and os.access(path, os.X_OK)):
        return None
    words = line[2:].strip(b" \t").split(b" ")
    interpreter = os.fsdecode(words[0])
    if len(words) != 1 or b"\t" in words[0] or not os.path.isabs(interpreter):
        return None  # an option, or a name the kernel would look up relative to the cwd
    return interpreter if _same_file_and_dir(interpreter, sys.executable) else None


def _console_script_step(args: list[str], env: dict[str, str], cwd: str) -> Optional[StepSpec]:
    """``pytest …`` as python runs it once the kernel has read the ``#!`` line:
    ``INTERPRETER SCRIPT ARGS``, with SCRIPT as found on PATH (``sys.argv[0]``)."""
    found = args[0] if os.sep in args[0] else shutil.which(args[0], path=env.get("PATH", os.defpath))
    interpreter = console_script_interpreter(os.path.join(cwd, found)) if found else None
    if interpreter is None:
        return None
    target = PythonTarget(kind="script", value=found, args=list(args[1:]), prog=interpreter,
                          executable=_invoked_path(interpreter, env, cwd))
    target.runner_env = runner_env(target)
    return StepSpec(args=list(args), env=env, cwd=cwd, target=target)


def _looks_like_python(program: str) -> bool:
    name = os.path.basename(program)
    return (name in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}")
            or os.path.abspath(program) == os.path.abspath(sys.executable))


def parse_python_argv(argv: list[str]) -> Union[PythonTarget, Unsupported]:
    """Parse ``python`` options the way CPython's getopt does, for the forms we serve.

    ``argv[0]`` is the program; supported options: ``-u -B -W arg -X opt`` (combinable,
    ``-Warg`` and ``-W arg`` both), then ``script``, ``-m mod`` or ``-c code``.
    """
    target = PythonTarget(kind="", value="", prog=argv[0])
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--" and i + 1 < len(argv):
            target.kind, target.value, target.args = "script", argv[i + 1], argv[i + 2:]
            target.head = argv[:i + 2]
            return target
        if not arg.startswith("-") or arg == "-":
            if arg == "-":
                return Unsupported("script from standard input")
            target.kind, target.value, target.args = "script", arg, argv[i + 1:]
            target.head = argv[:i + 1]
            return target
        j = 1
        while j < len(arg):
            opt = arg[j]
            rest = arg[j + 1:]
            if opt in "mcWX":
                if rest:
                    value = rest
                elif i + 1 < len(argv):
                    i += 1
                    value = argv[i]
                else:
                    return Unsupported(f"option -{opt} needs an argument")
                if opt in "mc":
                    target.kind = "module" if opt == "m" else "code"
                    target.value, target.args, target.head = value, argv[i + 1:], argv[:i + 1]
                    return target
                if opt == "W":
                    target.warnoptions.append(value)
                else:
                    if value.split("=", 1)[0] not in APPLICABLE_XOPTIONS:
                        return Unsupported(f"-X {value} changes interpreter start-up")
                    target.xoptions.append(value)
                break
            if opt == "u":
                target.unbuffered = True
            elif opt == "B":
                target.dont_write_bytecode = True
            else:
                return Unsupported(f"python option -{opt} is not served by the zygote")
            j += 1
        i += 1
    return Unsupported("no script, -m or -c: interactive interpreter")


MAX_ARG_STRLEN = 32 * 4096  # Linux: the longest single argument or environment string


def check_exec_limits(args: list[str], env: dict[str, str]) -> None:
    """Raise the ``OSError(E2BIG)`` that ``exec`` (and so ``subprocess.run``) would raise.

    A forked child would accept any size, so without this a command that cannot run as a
    process would run through the zygote."""
    strings = [os.fsencode(a) for a in args] + [os.fsencode(f"{k}={v}") for k, v in env.items()]
    pointer = 8
    total = sum(len(s) + 1 + pointer for s in strings)
    if total > os.sysconf("SC_ARG_MAX") or any(len(s) + 1 > MAX_ARG_STRLEN for s in strings):
        raise OSError(errno.E2BIG, os.strerror(errno.E2BIG), args[0] if args else None)


def _verbose_refusal(env: dict[str, str]) -> Optional[Unsupported]:
    if env.get("PYTHONVERBOSE"):
        return Unsupported("PYTHONVERBOSE: a fresh interpreter reports every import, preloaded ones too")
    return None


def parse_command(args: list[str], env: dict[str, str], cwd: str) -> Union[StepSpec, Unsupported]:
    """Classify ``args``: a python step, a torchrun step, or ``Unsupported`` with a reason."""
    if not args:
        return Unsupported("empty command")
    check_exec_limits(args, env)
    program = args[0]
    if os.path.basename(program) in ("torchrun", "accelerate"):
        if not resolves_to_this_interpreter(program, env, cwd, python_sibling=True):
            return Unsupported(f"{program} does not run {sys.executable}")
        if os.path.basename(program) == "torchrun":
            return StepSpec(args=list(args), env=env, cwd=cwd, torchrun_args=list(args[1:]))
        if args[1:2] != ["launch"]:
            return Unsupported(f"accelerate {' '.join(args[1:2])} is not a launch")
        return StepSpec(args=list(args), env=env, cwd=cwd, accelerate_args=list(args[2:]))
    if not _looks_like_python(program):
        script = _console_script_step(args, env, cwd)
        if script is None:
            return Unsupported(f"{os.path.basename(program)} is not a python interpreter or a "
                               f"console script of {sys.executable}")
        return _verbose_refusal(env) or script
    if not resolves_to_this_interpreter(program, env, cwd):
        return Unsupported(f"{program} does not run {sys.executable}")
    target = parse_python_argv(list(args))
    if isinstance(target, Unsupported):
        return target
    refusal = _verbose_refusal(env)
    if refusal:
        return refusal
    target.executable = _invoked_path(program, env, cwd)
    target.runner_env = runner_env(target)
    if target.kind == "module" and target.value == "torch.distributed.run":
        return StepSpec(args=list(args), env=env, cwd=cwd, torchrun_args=list(target.args))
    if target.kind == "module" and target.value == "accelerate.commands.launch":
        return StepSpec(args=list(args), env=env, cwd=cwd, accelerate_args=list(target.args))
    return StepSpec(args=list(args), env=env, cwd=cwd, target=target)
