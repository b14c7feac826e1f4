"""Thread pools and fork: a module that runs a parallel op at import never hangs a step, and a
step's thread counts are a fresh interpreter's (and real torchrun's)."""
import json
import os
import textwrap

import pytest

from preload_launcher import Launcher

from conftest import PY, plain, wait_gone

pytestmark = pytest.mark.needs_torch
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")

PARALLEL_STEP = textwrap.dedent("""
    import os, numpy, torch
    print("pid", os.getpid(), flush=True)
    x = torch.ones(1024, 1024)
    a = numpy.ones((512, 512))
    print("ok", float((x @ x).sum()), float((a @ a).sum()), torch.get_num_threads())
""")
# torch's counts, and the process's native threads (OpenBLAS starts its workers when it loads)
COUNTS = ("import os, torch; print(torch.get_num_threads(), torch.get_num_interop_threads(), "
          "len(os.listdir('/proc/self/task')))")


@pytest.fixture
def warm_at_import(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "torch_op_at_import.py").write_text(
        "import torch\nTABLE = torch.ones(512, 512) @ torch.ones(512, 512)\n")
    (site / "numpy_op_at_import.py").write_text(
        "import numpy\nTABLE = numpy.ones((512, 512)) @ numpy.ones((512, 512))\n")
    return dict(os.environ, PYTHONPATH=str(site))


@pytest.mark.parametrize("module", ["torch_op_at_import", "numpy_op_at_import"])
def test_a_parallel_op_at_import_never_hangs_a_step(warm_at_import, module):
    launcher = Launcher(["torch", "numpy", module])
    try:
        launcher.zygote_for(warm_at_import)
        assert module in launcher.zygotes[0].status["preload"]["loaded"]
        for _ in range(2):
            # A hang never ends: the timeout only bounds the wait (the step takes well under
            # a second, but more on a loaded machine).
            result = launcher.run([PY, "-c", PARALLEL_STEP], env=warm_at_import, timeout=60)
            assert result.via == "zygote" and "ok" in result.stdout, result.stdout
            pid = int(result.stdout.split()[1])
            # run() returns at most half a second after the step reported its exit, which it
            # does before the kernel tears it down: it goes soon after, unless it hangs.
            assert wait_gone(pid)
    finally:
        launcher.close()


@pytest.mark.parametrize("threads_env", [{}, {"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "3"},
                                          {"MKL_NUM_THREADS": "1"}, {"OPENBLAS_NUM_THREADS": "1"}])
def test_a_steps_thread_counts_are_a_fresh_interpreters(torch_launcher, threads_env):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(threads_env)
    ours = torch_launcher.run([PY, "-c", COUNTS], env=env)
    fresh = plain([PY, "-c", COUNTS], env=env)
    assert ours.via == "zygote"
    assert ours.stdout == fresh.stdout, (threads_env, ours.stdout, fresh.stdout)


def test_ranks_get_torchruns_thread_counts(torch_launcher, tmp_path):
    script = tmp_path / "counts.py"
    # One write per rank: two ranks share the output pipe, and print() writes the line and its
    # newline separately when output is unbuffered.
    script.write_text("import os, json, torch\nos.write(1, (json.dumps([os.environ['RANK'], "
                      "torch.get_num_threads(), torch.get_num_interop_threads(), "
                      "len(os.listdir('/proc/self/task'))]) + '\\n').encode())\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    args = [TORCHRUN, "--nproc_per_node=2", str(script)]
    ours = torch_launcher.run(args, env=env, timeout=120)
    theirs = plain(args, env=env)

    def counts(output):
        return sorted(json.loads(l) for l in output.splitlines() if l.startswith("["))

    assert ours.via == "zygote"
    assert counts(ours.stdout) == counts(theirs.stdout)
    assert [c[1] for c in counts(ours.stdout)] == [1, 1]  # torchrun's OMP_NUM_THREADS=1


def test_doctor_says_what_each_native_thread_is(torch_launcher):
    zygote = torch_launcher.zygote_for(dict(os.environ))
    rows = zygote.request("status")["native_threads_described"]
    assert rows[0]["what"] == "the zygote's main thread"
    assert sum(r["count"] for r in rows) == sum(zygote.request("status")["native_threads"].values())
    assert all(r["fork_safe"] for r in rows)


def test_a_probe_without_an_answer_leaves_the_counts_to_the_step(tmp_path, monkeypatch):
    """A fresh interpreter that gives the zygote no answer (it died, or ran past its two
    minutes) is no table entry and no error in the zygote: the step then asks one itself, as
    for counts the zygote could not foresee, and gets a fresh interpreter's."""
    import subprocess

    import torch  # noqa: F401  (the step's own torch: it sizes torch's pools)

    from preload_launcher.zygote import threads

    def silent(*args, **kwargs):
        return subprocess.Popen([PY, "-c", "pass"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, text=True)

    monkeypatch.setattr(threads, "_start_probe", silent)
    fresh = threads.FreshCounts(str(tmp_path / "counts.json"), [3, 3])
    assert fresh.table_for({}, multi_rank=True) == {}
    monkeypatch.undo()
    intra, inter, _ = threads._counts_here({}, None)
    ref = plain([PY, "-c", COUNTS], timeout=120)
    assert [intra, inter] == [int(n) for n in ref.stdout.split()[:2]], ref.stdout
