"""A step runs with the configuration a fresh interpreter would have, whatever the zygote read
or answered while preloading: the device queries a preloaded module kept from its import
(answered from NVML while preloading) call torch's own; what native code read from the
environment at load (the time zone, torch.distributed's debug level, thread pools) is re-read
through the library's own API in the step, or, where a library has none (torch's C++ stack
traces, OpenMP's binding, ...), a step whose value differs from the zygote's runs in a
zygote (or an interpreter) started with it.

Differential: ``tests/programs/step_config.py`` run plainly and through ``run()``, the CLI
(a daemon started under another environment), ``PRELOAD_LAUNCHER=suite`` and torchrun ranks,
each under environments the zygote did not have. A machine without GPUs gets a stand-in NVML
(``tests/programs/preloaded/pynvml.py``), so the zygote answers from it as on a GPU machine."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from preload_launcher import Launcher
from preload_launcher.step.native_env import REREAD
from preload_launcher.settings import NATIVE_ENV, THREAD_ENV

from conftest import PY, plain, program

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.needs_torch

MODULES = "torch,captures_cuda"
PROGRAM = program("step_config.py")
# Each case: the step's extra environment, and whether the zygote started without it serves
# it (the library re-reads the value in the step) or a fresh one must.
CASES = {
    "as_the_zygote": ({}, "same"),
    "re_read_in_the_step": ({"TZ": "America/New_York", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
                             "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}, "same"),
    "another_time_zone_and_blas_count": ({"TZ": "Asia/Kolkata", "GOTO_NUM_THREADS": "1"},
                                         "same"),
    "read_at_load_only": ({"TORCH_SHOW_CPP_STACKTRACES": "1"}, "fresh"),
    "openmp_binding": ({"OMP_PROC_BIND": "true", "OMP_NUM_THREADS": "1"}, "fresh"),
}
STEP_KEYS = {k for extra, _ in CASES.values() for k in extra}


@pytest.fixture(scope="module")
def base_env(tmp_path_factory):
    """The zygote's environment: none of the cases' variables, the stand-in NVML and the
    capturing module on PYTHONPATH, a private cache."""
    env = {k: v for k, v in os.environ.items() if k not in STEP_KEYS and k not in NATIVE_ENV}
    path = [program("preloaded"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env.update(PYTHONPATH=os.pathsep.join(path), PRELOAD_LAUNCHER_MODULES=MODULES,
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path_factory.mktemp("cache")))
    return env


def seen(output: str) -> list[dict]:
    """What each process reported (one line each; ranks in rank order), minus whether it was
    forked."""
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return sorted(({k: v for k, v in s.items() if k != "preloaded"} for s in lines),
                  key=lambda s: str(s["rank"]))


def forked(output: str) -> list[bool]:
    return [json.loads(line)["preloaded"] for line in output.splitlines() if line.startswith("{")]


def test_run_gives_each_step_a_fresh_interpreters_configuration(base_env):
    launcher = Launcher(MODULES.split(","))
    try:
        launcher.prestart(base_env)
        for name, (extra, served) in CASES.items():
            env = dict(base_env, **extra)
            got = launcher.run([PY, PROGRAM], env=env)
            ref = plain([PY, PROGRAM], env=env)
            assert (got.returncode, ref.returncode) == (0, 0), got.stdout + ref.stdout
            assert seen(got.stdout) == seen(ref.stdout), name
            assert got.via == "zygote" and forked(got.stdout) == [True], name
            assert len(launcher.zygotes) == {"same": 1, "fresh": 2}[served], name
            if served == "fresh":  # started for this environment; the next case starts over
                launcher.zygotes.pop().close()
        # A level torch refuses fails a fresh interpreter's `import torch`: the step runs as one.
        env = dict(base_env, TORCH_DISTRIBUTED_DEBUG="LOUD")
        got, ref = launcher.run([PY, PROGRAM], env=env), plain([PY, PROGRAM], env=env)
        assert (got.returncode, got.stdout) == (ref.returncode, ref.stdout)
        assert ref.returncode == 1 and "TORCH_DISTRIBUTED_DEBUG must be" in ref.stdout
        assert got.via == "subprocess" and "TORCH_DISTRIBUTED_DEBUG" in got.reason
    finally:
        launcher.close()


def test_torchrun_ranks_get_a_fresh_interpreters_configuration(base_env):
    launcher = Launcher(MODULES.split(","))
    launch = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", PROGRAM]
    try:
        launcher.prestart(base_env)
        for name in ("as_the_zygote", "re_read_in_the_step"):
            env = dict(base_env, **CASES[name][0])
            got = launcher.run(launch, env=env)
            ref = plain(launch, env=env)
            assert (got.returncode, ref.returncode) == (0, 0), got.stdout + ref.stdout
            assert seen(got.stdout) == seen(ref.stdout), name
            assert got.via == "zygote" and forked(got.stdout) == [True, True], name
        assert len(launcher.zygotes) == 1
    finally:
        launcher.close()


def test_the_cli_gives_each_step_a_fresh_interpreters_configuration(base_env, runtime_base):
    runtime = dict(base_env, XDG_RUNTIME_DIR=str(runtime_base))
    cli = [PY, "-m", "preload_launcher.cli"]
    started = subprocess.run([*cli, "serve", "--detach"], env=runtime, capture_output=True,
                             text=True, timeout=300)
    assert started.returncode == 0, started.stderr
    try:
        for name, (extra, served) in CASES.items():
            env = dict(runtime, **extra)
            got = subprocess.run([*cli, "run", "-v", "--", PY, PROGRAM], env=env,
                                 capture_output=True, text=True, timeout=300)
            ref = plain([PY, PROGRAM], env=env)
            assert seen(got.stdout) == seen(ref.stdout), name
            assert forked(got.stdout) == [True], name
            how = {"same": "through the daemon", "fresh": "one-off zygote"}[served]
            assert how in got.stderr, (name, got.stderr)
    finally:
        subprocess.run([*cli, "stop"], env=runtime, capture_output=True, timeout=120)


SUITE = """
    import json, os, subprocess, sys
    import pytest

    CASES = json.loads(os.environ["STEP_CASES"])


    @pytest.fixture(scope="session", autouse=True)
    def preloaded(preload_launcher):  # a stand-in asks only a zygote that serves
        if os.environ.get("PRELOAD_LAUNCHER") != "0":
            preload_launcher.zygote_for_standins(dict(os.environ)).wait_ready()

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_step(name):
        env = dict(os.environ, **CASES[name])
        done = subprocess.run([sys.executable, os.environ["STEP_PROGRAM"]], env=env,
                              capture_output=True, text=True)
        with open(os.path.join(os.environ["STEP_RESULTS"], name), "w") as f:
            f.write(done.stdout)
        assert done.returncode == 0, done.stderr
"""


def test_the_suite_switch_gives_each_step_a_fresh_interpreters_configuration(base_env, tmp_path):
    (tmp_path / "test_steps.py").write_text(textwrap.dedent(SUITE))
    outputs = {}
    for mode in ("0", "suite"):
        results = tmp_path / f"results-{mode}"
        results.mkdir()
        env = dict(base_env, PRELOAD_LAUNCHER=mode, STEP_PROGRAM=PROGRAM,
                   STEP_RESULTS=str(results),
                   STEP_CASES=json.dumps({name: extra for name, (extra, _) in CASES.items()}))
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "test_steps.py"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        outputs[mode] = {p.name: p.read_text() for p in results.iterdir()}
    for name, (_, served) in CASES.items():
        assert seen(outputs["suite"][name]) == seen(outputs["0"][name]), name
        assert forked(outputs["suite"][name]) == [served == "same"], name
        assert forked(outputs["0"][name]) == [False], name


@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler")
def test_every_variable_native_code_reads_at_load_is_handled():
    """Each variable the stack's native code reads while torch (and numpy) load is re-read in
    the step (``native_env``, ``threads``) or in ``settings.NATIVE_ENV``: a library upgrade
    that reads a new one fails here, not silently in a step."""
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "native_env_reads.sh"),
                           "numpy,torch"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    read = [name for name in done.stdout.split() if not name.startswith("==")]
    assert "OMP_PROC_BIND" in read and "TORCH_SHOW_CPP_STACKTRACES" in read, read
    assert unhandled(read) == []


def unhandled(read: list[str], also: tuple[str, ...] = ()) -> list[str]:
    """The variables of ``read`` that no step re-reads (``native_env``, ``threads``) and no
    entry or family of ``settings.NATIVE_ENV`` routes on; ``also``: more names or prefixes
    a test accounts for itself."""
    handled = set(REREAD) | set(THREAD_ENV) | set(NATIVE_ENV)
    prefixes = tuple(entry[:-1] for entry in NATIVE_ENV if entry.endswith("*")) + also
    return [name for name in read if name not in handled and not name.startswith(prefixes)]


# Read by the CUDA driver at cuInit (megatron.core's import initialises CUDA in a plain
# interpreter; in a forked step cuInit, and these reads, happen in the step itself), and NVML's
# own debug switches, read when the zygote asks NVML (a machine-wide answer).
AT_CUINIT = ("CUDA_", "CUDBG_", "NV_PROFILE_", "NV_OPENCL_", "NVCL_", "__RM_", "__CUDA_",
             "__NVML_", "__NVIDIA_NVML_", "FORCE_ENABLE_COOPERATIVE_LAUNCH_PATCH", "HOME")


def test_every_variable_the_h200_stack_reads_at_load_is_handled():
    """The same rule for what the GPU image's stack read on an H200 (torch+CUDA, Transformer
    Engine, megatron.core, modelopt.torch, transformers; the committed output of
    ``lanes.sh native-env``): each variable is re-read in the step, routed on, or read by the
    CUDA driver at cuInit, which a forked step does itself."""
    log = os.path.join(ROOT, "docs", "runs", "2026-12-03-h200-native_env_reads.log")
    with open(log) as f:  # variable names only (the log also has the compiler's words)
        read = [line.strip() for line in f if re.fullmatch(r"[A-Z_][A-Za-z0-9_]*\n?", line)]
    assert "PYTORCH_CUDA_ALLOC_CONF" in read and "CUBLAS_LOGINFO_DBG" in read, read
    # TMPDIR: SQLite's, once a preloaded import opened a database (a known difference in
    # docs/user-guide.md: routing on it would split zygotes by every test's TMPDIR).
    assert [name for name in unhandled(read, AT_CUINIT) if name != "TMPDIR"] == []


def test_a_collective_mismatch_is_detected_in_forked_ranks_as_under_torchrun():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL, which torch.distributed read when the zygote (started
    without it) imported it: both ranks detect the mismatched all_reduce, as under the real
    torchrun."""
    launch = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2",
              program("collective_mismatch.py")]
    zygote_env = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}
    env = dict(zygote_env, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    launcher = Launcher(["torch"])
    try:
        launcher.prestart(zygote_env)
        got = launcher.run(launch, env=env, timeout=300)
        ref = plain(launch, env=env, timeout=300)
        assert len(launcher.zygotes) == 1
    finally:
        launcher.close()
    lines = [sorted(line for line in out.splitlines() if line.startswith("rank "))
             for out in (got.stdout, ref.stdout)]
    assert lines[0] == lines[1] == ["rank 0: level DebugLevel.DETAIL: mismatch detected",
                                    "rank 1: level DebugLevel.DETAIL: mismatch detected"]
    assert (got.returncode, got.via) == (ref.returncode, "zygote")


def test_a_family_of_native_variables_is_compared_as_a_whole():
    """``OMP_*`` in NATIVE_ENV: any variable of the family that differs (one the zygote lacked
    included) sets a step apart; the thread counts in it do not (each step applies its own)."""
    from preload_launcher.interpreter import env_value, import_env_mismatch
    zygote = {"OMP_*": env_value({"OMP_PROC_BIND": "true", "OMP_NUM_THREADS": "4"}, "OMP_*")}
    assert import_env_mismatch(zygote, {"OMP_PROC_BIND": "true", "OMP_NUM_THREADS": "1"}) == []
    assert import_env_mismatch(zygote, {"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"}) == ["OMP_*"]
    assert import_env_mismatch(zygote, {}) == ["OMP_*"]
    assert import_env_mismatch({"OMP_*": None}, {"OMP_NUM_THREADS": "2"}) == []


KEEPS_IMPORT = "import builtins\nIMPORT = builtins.__import__  # to wrap imports, as some do\n"
USES_IMPORT = """import keeps_import
path = keeps_import.IMPORT("os.path", fromlist=["join"])
print(path.__name__, keeps_import.IMPORT("colorsys").__name__,
      getattr(keeps_import.IMPORT, "__name__", None), keeps_import.IMPORT.__doc__)
"""


def test_the_import_function_a_preloaded_module_kept_behaves_as_pythons(tmp_path):
    """The zygote watches each preloaded import through ``builtins.__import__``; a module that
    kept that function at import gets python's own behaviour from it in a step (scouts on)."""
    (tmp_path / "keeps_import.py").write_text(KEEPS_IMPORT)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PRELOAD_LAUNCHER_PROBE="fake",
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    launcher = Launcher(["json", "keeps_import"])
    try:
        got = launcher.run([PY, "-c", USES_IMPORT], env=env, timeout=120)
    finally:
        launcher.close()
    ref = plain([PY, "-c", USES_IMPORT], env=env)
    assert (got.via, got.returncode, got.stdout) == ("zygote", ref.returncode, ref.stdout)
    assert ref.stdout.startswith("posixpath colorsys __import__ ")


KEPT_AFTER_RECORDING = """
import builtins
from preload_launcher.zygote import import_graph
with import_graph.recording():
    kept = builtins.__import__
edges = {k: set(v) for k, v in import_graph.edges.items()}
import_graph._importing = None  # a kept function that still looked for its importer fails
exec(compile("import colorsys; kept('wave'); kept('os.path', fromlist=['join'])",
             "kept_user", "exec"), {"__name__": "kept_user", "kept": kept})
print(kept is not builtins.__import__, import_graph.edges == edges,
      [getattr(kept, a) == getattr(builtins.__import__, a)
       for a in ("__name__", "__qualname__", "__doc__", "__module__")])
"""


def test_the_kept_import_function_records_nothing_once_recording_ends():
    """What a module kept while the zygote recorded imports goes straight to python's own once
    recording is over: it looks for no importer and adds no edge."""
    done = subprocess.run([PY, "-c", KEPT_AFTER_RECORDING], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (0, "True True [True, True, True, True]\n"), \
        done.stderr
