"""Steps the zygote cannot serve directly (shell scripts, ``env``, ``accelerate launch``): the
interpreters they start are forked from the zygote, and behave as the real programs do."""
import json
import os
import re
import signal
import subprocess
import textwrap
import time

import pytest

from conftest import PY, plain, program, signal_submitted_step, wait_gone

pytestmark = pytest.mark.needs_torch

BIN = os.path.dirname(PY)
ACCELERATE = os.path.join(BIN, "accelerate")
VARYING = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}

# Each program notes (in $MARKS) whether torch was already imported at its first line, then
# prints what a program can see of how it was started.
PROGRAM = textwrap.dedent("""\
    import os, sys
    with open(os.environ["MARKS"], "a") as f:
        f.write("%s %s\\n" % (os.path.basename(sys.argv[0]) or "-m", "module_table" in repr(sys.meta_path)))
    print("argv", sys.argv, "executable", sys.executable, flush=True)
    print("PATH", os.environ["PATH"], flush=True)
    sys.exit(int(os.environ.get("CODE", "0")))
    """)
RANK = textwrap.dedent("""\
    import os, sys
    with open(os.environ["MARKS"], "a") as f:
        f.write("rank%s %s\\n" % (os.environ["RANK"], "module_table" in repr(sys.meta_path)))
    if os.environ["RANK"] == "0":
        print("rank 0 of", os.environ["WORLD_SIZE"], sys.argv[1:], flush=True)
    """)
SCRIPT = textwrap.dedent("""\
    set -u
    python a.py one
    python3 -m pkg.mod two
    torchrun --nproc_per_node=2 b.py three
    CODE=3 python a.py four || echo "a.py failed with $?"
    python -c 'import os; os.kill(os.getpid(), 9)' || echo "killed: $?"
    CODE=5 exec python a.py five
    """)


@pytest.fixture(autouse=True)
def preloaded(torch_launcher):
    """A stand-in asks only a zygote that serves (one that still preloads: the real program
    runs, tests/test_session_edges.py); the tests here compare forked programs."""
    torch_launcher.zygote_for_standins(dict(os.environ)).wait_ready()


@pytest.fixture
def project(tmp_path):
    (tmp_path / "a.py").write_text(PROGRAM)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(PROGRAM)
    (tmp_path / "b.py").write_text(RANK)
    (tmp_path / "s.sh").write_text(SCRIPT)
    return tmp_path


def step_env(marks, **extra):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return dict(env, PATH=BIN + os.pathsep + env.get("PATH", ""), MARKS=str(marks), **extra)


def comparable_output(output):
    """Pids differ: in torchrun's OMP_NUM_THREADS warning (dropped) and bash's "Killed"."""
    return [re.sub(r"(line \d+:)\s+\d+ Killed", r"\1 PID Killed", line)
            for line in output.splitlines() if "torch/distributed/run.py" not in line]


def test_a_shell_steps_interpreters_are_forked_from_the_zygote(torch_launcher, project):
    ref = plain(["bash", "s.sh"], cwd=project, env=step_env(project / "ref"), timeout=120)
    torch_launcher.zygote_for(step_env(project / "got"))  # a stand-in asks only a ready zygote
    got = torch_launcher.run(["bash", "s.sh"], cwd=project, env=step_env(project / "got"),
                             timeout=120)
    assert got.via == "subprocess" and "forked by the zygote" in got.reason
    assert ref.returncode == got.returncode == 5, got.stdout
    # Output, nested exit codes (handled and signalled), argv, sys.executable and PATH as
    # the programs see them: as without stand-ins.
    assert comparable_output(got.stdout) == comparable_output(ref.stdout)
    assert "a.py failed with 3" in got.stdout and "killed: 137" in got.stdout
    ours = sorted((project / "got").read_text().splitlines())
    theirs = sorted((project / "ref").read_text().splitlines())
    assert [line.split()[0] for line in ours] == [line.split()[0] for line in theirs] == \
        ["a.py", "a.py", "a.py", "mod.py", "rank0", "rank1"]
    assert all(line.endswith("True") for line in ours), ours  # torch was preloaded
    assert all(line.endswith("False") for line in theirs), theirs


def test_a_timeout_on_the_script_leaves_no_process(torch_launcher, project):
    (project / "sleep.sh").write_text(
        'python -c "import os, time; print(os.getpid(), flush=True); time.sleep(60)" &\n'
        'echo standin $!\nwait\n')
    torch_launcher.zygote_for(step_env(project / "m"))  # a stand-in asks only a ready zygote
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        torch_launcher.run(["bash", "sleep.sh"], cwd=project, env=step_env(project / "m"),
                           timeout=8)
    words = caught.value.output.split()
    # bash's echo and the program's print race: the program's pid is the other number.
    standin = int(words[words.index("standin") + 1])
    forked = next((int(w) for w in words if w.isdigit() and int(w) != standin), 0)
    assert forked and forked != standin  # the program ran in a forked child, not the stand-in
    assert wait_gone(standin) and wait_gone(forked)


def test_interrupting_the_stand_in_reaches_the_program(torch_launcher, project):
    (project / "trap.py").write_text(textwrap.dedent("""\
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(7)))
        print("ready", flush=True)
        time.sleep(60)
        """))
    (project / "kill.sh").write_text(
        "python trap.py > out.txt &\npid=$!\n"
        # Up to a minute for the program's start (signalled before its handler, it dies).
        "for i in $(seq 600); do grep -q ready out.txt 2>/dev/null && break; sleep 0.1; done\n"
        "kill -TERM $pid; wait $pid; echo \"exit $?\"; cat out.txt\n")
    got = torch_launcher.run(["bash", "kill.sh"], cwd=project, env=step_env(project / "m"),
                             timeout=120)
    assert got.stdout.split("\n")[:3] == ["exit 7", "ready", "got SIGTERM"], got.stdout


def test_nested_off_runs_the_real_programs(torch_launcher, project):
    env = step_env(project / "m", PRELOAD_LAUNCHER_NESTED="0")
    got = torch_launcher.run(["bash", "-c", "python a.py"], cwd=project, env=env, timeout=120)
    assert got.returncode == 0 and "forked" not in got.reason
    assert (project / "m").read_text() == "a.py False\n"


def test_a_python_of_another_interpreter_gets_no_stand_in(torch_launcher, project):
    other = project / "other"
    other.mkdir()
    (other / "python").write_text("#!/bin/sh\necho other python \"$@\"\n")
    (other / "python").chmod(0o755)
    env = step_env(project / "m")
    env["PATH"] = f"{other}{os.pathsep}{env['PATH']}"
    torch_launcher.zygote_for(env)  # a stand-in asks only a ready zygote
    got = torch_launcher.run(["bash", "-c", "command -v python; python a.py; python3 a.py"],
                             cwd=project, env=env, timeout=120)
    lines = got.stdout.splitlines()
    assert lines[0] == str(other / "python") and lines[1] == "other python a.py"
    assert (project / "m").read_text() == "a.py True\n"  # python3 is still this interpreter


def test_env_in_front_of_python_is_served_too(torch_launcher, project):
    got = torch_launcher.run(["env", "CODE=4", "python", "a.py", "x"], cwd=project,
                             env=step_env(project / "m"), timeout=120)
    ref = plain(["env", "CODE=4", "python", "a.py", "x"], cwd=project,
                env=step_env(project / "r"), timeout=120)
    assert got.returncode == ref.returncode == 4
    assert got.stdout == ref.stdout
    assert (project / "m").read_text() == "a.py True\n"


# ---------------------------------------------------------------- accelerate launch

def rank_infos(output):
    decoder = json.JSONDecoder()
    infos = [decoder.raw_decode(part)[0] for part in output.split("RANKINFO ")[1:]]
    return {info["rank"]: info for info in infos}


def accelerate_env(tmp_path):
    # An empty HF_HOME: no accelerate config file decides for either side.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return dict(env, HF_HOME=str(tmp_path / "hf"))


@pytest.mark.parametrize("launch", [
    [ACCELERATE, "launch", "--num_processes", "1"],
    [ACCELERATE, "launch", "--cpu", "--mixed_precision", "no", "--num_cpu_threads_per_process", "1"],
    [PY, "-m", "accelerate.commands.launch", "--num_processes=1"],
    [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2"],
    [PY, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2",
     "--main_process_port", "0"],
])
def test_accelerate_launch_matches_the_real_one(torch_launcher, tmp_path, launch):
    args = launch + [program("accelerate_env.py"), "--x", "1"]
    env = accelerate_env(tmp_path)
    ref = plain(args, env=env, timeout=180)
    got = torch_launcher.run(args, env=env, timeout=180)
    assert got.via == "zygote", got.reason
    assert ref.returncode == got.returncode == 0, got.stdout
    ours, theirs = rank_infos(got.stdout), rank_infos(ref.stdout)
    assert sorted(ours) == sorted(theirs) and ours, (got.stdout, ref.stdout)
    for rank in ours:
        assert {k: v for k, v in ours[rank]["env"].items() if k not in VARYING} == \
            {k: v for k, v in theirs[rank]["env"].items() if k not in VARYING}
        assert set(ours[rank]["env"]) == set(theirs[rank]["env"])
        assert ours[rank]["argv"] == theirs[rank]["argv"] == ["--x", "1"]
        assert ours[rank]["threads"] == theirs[rank]["threads"]
        assert (ours[rank]["cmdline"], ours[rank]["comm"]) == \
            (theirs[rank]["cmdline"], theirs[rank]["comm"])


def test_accelerates_thread_setting_sizes_its_programs_pools(torch_launcher, tmp_path):
    """accelerate gives its program OMP_NUM_THREADS=N from --num_cpu_threads_per_process, a
    value the zygote cannot foresee from the caller's environment: the program's pools are sized
    as a fresh interpreter sizes them under it (they kept the caller's: 2 threads, not 1)."""
    args = [ACCELERATE, "launch", "--num_processes", "1", "--num_cpu_threads_per_process", "1",
            program("accelerate_env.py")]
    env = dict(accelerate_env(tmp_path), OMP_NUM_THREADS="2")
    ref = plain(args, env=env, timeout=180)
    got = torch_launcher.run(args, env=env, timeout=180)
    assert got.via == "zygote", got.reason
    ours, theirs = rank_infos(got.stdout)[0], rank_infos(ref.stdout)[0]
    assert ours["env"]["OMP_NUM_THREADS"] == theirs["env"]["OMP_NUM_THREADS"] == "1"
    assert ours["threads"] == theirs["threads"]


@pytest.fixture
def sigint_as_a_terminal_gives_it():
    """SIGINT at python's handler in this process while the test runs, as under a terminal's
    shell, also when the suite was started with SIGINT ignored (``cmd &``, nohup): both the real
    launch and ours take the caller's disposition."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("processes", [["--num_processes", "1"],
                                       ["--multi_gpu", "--num_processes", "2"]])
def test_a_failing_program_fails_accelerate_launch_alike(torch_launcher, tmp_path, processes):
    args = [ACCELERATE, "launch", *processes, program("accelerate_env.py")]
    env = dict(accelerate_env(tmp_path), EXIT_CODE_RANK_0="3")
    ref = plain(args, env=env, timeout=180)
    got = torch_launcher.run(args, env=env, timeout=180)
    assert got.via == "zygote"
    assert ref.returncode == got.returncode == 1
    error = "CalledProcessError" if processes[1] == "1" else "ChildFailedError"
    assert error in ref.stdout and error in got.stdout, got.stdout


# A program that fails after writing to both streams (accelerate tees stderr, and 1.16 repeats it
# in its error), or that is killed.
FAILING = {
    "raises": "import sys\nprint('out', flush=True)\nprint('err', file=sys.stderr, flush=True)\n"
              "raise ValueError('boom')\n",
    "killed": "import os, sys\nprint('err', file=sys.stderr, flush=True)\nos.kill(os.getpid(), 9)\n",
}


def without_frames(output):
    """A launch's output without its tracebacks' frames (the real launcher's start in its
    console script, ours in accelerate's launcher function) and accelerate's warning about the
    defaults it chose; what is left is the programs' and the exceptions' own lines."""
    return [line for line in output.splitlines()
            if not line.startswith((" ", "\t")) and "had defaults used instead" not in line
            and not line.startswith("To avoid this warning")]


@pytest.mark.parametrize("program_kind", sorted(FAILING))
@pytest.mark.parametrize("launch", [
    [ACCELERATE, "launch", "--num_processes", "1"],
    [ACCELERATE, "launch", "--num_processes", "1", "--quiet"],
    [PY, "-m", "accelerate.commands.launch", "--num_processes=1"],
], ids=["accelerate", "quiet", "python-m"])
def test_a_failing_program_is_reported_as_the_real_accelerate_reports_it(torch_launcher, tmp_path,
                                                                        launch, program_kind):
    prog = tmp_path / "fails.py"
    prog.write_text(FAILING[program_kind])
    env = accelerate_env(tmp_path)
    ref = plain(launch + [str(prog)], env=env, timeout=180)
    got = torch_launcher.run(launch + [str(prog)], env=env, timeout=180)
    assert got.via == "zygote", got.reason
    assert got.returncode == ref.returncode == 1, got.stdout
    assert without_frames(got.stdout) == without_frames(ref.stdout), (got.stdout, ref.stdout)
    assert ("CalledProcessError" in ref.stdout) != ("--quiet" in launch)


# Starts `accelerate launch` as a terminal's job (`set -m`: its own process group, SIGINT at its
# default), signals it ($TARGET "-": its group, as Ctrl-C does) once its $N programs are ready,
# then says how it ended (bash names a death by signal) and whether each program outlived it.
SIGNALLED_LAUNCH = textwrap.dedent("""\
    set -m
    accelerate launch $PROCESSES waiter.py > out.txt 2>&1 &
    pid=$!
    for i in $(seq 1200); do [ "$(grep -c ready out.txt)" = "$N" ] && break; sleep 0.1; done
    kill -$SIG $TARGET$pid
    wait $pid
    echo "exit $?"
    alive() { [ -e /proc/$1 ] && ! grep -q 'State:.*Z' /proc/$1/status 2>/dev/null; }
    for f in program*.pid; do
        program=$(cat $f)
        for i in $(seq 300); do alive $program || break; sleep 0.1; done
        if alive $program; then echo "program lives on"; kill -9 $program; else echo "program gone"; fi
    done
    cat out.txt
    """)
WAITER = textwrap.dedent("""\
    import os, signal, time
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # ends silently, whichever signal comes first
    rank = os.environ.get("RANK", "0")
    with open(f"program{rank}.pid", "w") as f:
        f.write(str(os.getpid()))
    # One write: ranks run with -u and share out.txt (print writes each piece on its own).
    os.write(1, f"ready {rank}\\n".encode())
    time.sleep(60)
    """)


def accelerate_version() -> tuple:
    from importlib.metadata import version
    return tuple(int(part) for part in version("accelerate").split(".")[:2])


def signal_outcome(output):
    """Each line but the programs' fates (a real 1.15 leaves its program running on SIGTERM),
    sorted (ranks print in any order); torch elastic's log lines without time, pid and source
    line, bash's job report without its padding."""
    lines = [line for line in without_frames(output) if not line.startswith("program ")]
    lines = [re.sub(r"^([WEI])\d{4} [\d:.]+ \d+ [^]]*\] ", r"\1 ", line) for line in lines]
    lines = [re.sub(r"([Pp]rocess) \d+", r"\1 PID", line) for line in lines]
    return sorted(re.sub(r"\s+", " ", line) for line in lines)


@pytest.mark.parametrize("processes", [["--num_processes", "1"],
                                       # a free port: another launch may hold the default one
                                       ["--multi_gpu", "--main_process_port", "0",
                                        "--num_processes", "2"]],
                         ids=["one", "multi_gpu"])
@pytest.mark.parametrize("sig, target", [("TERM", ""), ("INT", "-")], ids=["sigterm", "ctrl-c"])
@pytest.mark.usefixtures("sigint_as_a_terminal_gives_it")
def test_a_signalled_accelerate_launch_ends_as_the_real_one(torch_launcher, tmp_path, sig, target,
                                                            processes):
    (tmp_path / "sig.sh").write_text(SIGNALLED_LAUNCH)
    (tmp_path / "waiter.py").write_text(WAITER)
    env = dict(accelerate_env(tmp_path), PATH=BIN + os.pathsep + os.environ["PATH"], SIG=sig,
               TARGET=target, PROCESSES=" ".join(processes), N=processes[-1],
               TMPDIR=str(tmp_path))  # where the real torchrun leaves its log folder
    ref = plain(["bash", "sig.sh"], cwd=tmp_path, env=env, timeout=180)
    got = torch_launcher.run(["bash", "sig.sh"], cwd=tmp_path, env=env, timeout=180)
    assert "forked by the zygote" in got.reason
    assert signal_outcome(got.stdout) == signal_outcome(ref.stdout), (got.stdout, ref.stdout)
    assert "program lives on" not in got.stdout, got.stdout  # ours never outlives its launch
    if accelerate_version() >= (1, 16):  # its own exit status for each signal
        assert f"exit {128 + signal.Signals['SIG' + sig]}" in ref.stdout.splitlines()


def test_accelerate_usage_errors_are_accelerates(torch_launcher, tmp_path):
    args = [ACCELERATE, "launch", "--num_processes", "many", program("accelerate_env.py")]
    ref = plain(args, env=accelerate_env(tmp_path), timeout=120)
    got = torch_launcher.run(args, env=accelerate_env(tmp_path), timeout=120)
    assert ref.returncode == got.returncode == 2
    assert got.stdout.splitlines()[-1] == ref.stdout.splitlines()[-1]


def test_launches_accelerate_does_not_model_here_run_the_real_accelerate(torch_launcher, tmp_path):
    got = torch_launcher.run([ACCELERATE, "launch", "--use_deepspeed", "--num_processes", "1",
                              program("accelerate_env.py")], env=accelerate_env(tmp_path),
                             timeout=120)
    assert got.via == "subprocess" and "DeepSpeed" in got.reason


def test_accelerate_launch_in_a_script_is_forked(torch_launcher, tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(f"accelerate launch --num_processes 1 {program('accelerate_env.py')}\n")
    env = dict(accelerate_env(tmp_path), PATH=BIN + os.pathsep + os.environ["PATH"])
    torch_launcher.run([PY, "-c", "pass"], env=env)  # a ready zygote for this environment first
    before = torch_launcher.standin_steps()
    got = torch_launcher.run(["bash", str(script)], env=env, timeout=180)
    assert got.returncode == 0 and "RANKINFO" in got.stdout, got.stdout
    assert torch_launcher.standin_steps() == before + 1


def test_what_accelerate_imports_is_learned(tmp_path):
    from preload_launcher import Launcher
    launcher = Launcher(["torch"], project=str(tmp_path))
    env = dict(accelerate_env(tmp_path), PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    try:
        got = launcher.run([ACCELERATE, "launch", "--num_processes", "1",
                            program("accelerate_env.py")], env=env, timeout=180)
        assert got.via == "zygote" and got.returncode == 0, got.stdout
        zygote, deadline = launcher.zygotes[0], time.monotonic() + 60
        while not zygote.request("status")["preload"]["learned"].get("in_session"):
            assert time.monotonic() < deadline, "nothing was learned while idle"
            time.sleep(0.2)
        profile = json.load(open(zygote.request("status")["preload"]["learned"]["profile"]))
        assert "accelerate.commands.launch" in profile["modules"]  # the accelerate process's
    finally:
        launcher.close()


@pytest.mark.usefixtures("sigint_as_a_terminal_gives_it")
def test_ctrl_c_ends_accelerate_launch_as_it_ends_the_real_one(torch_launcher, tmp_path):
    from preload_launcher import process_attrs
    from preload_launcher.command import parse_command
    prog = tmp_path / "wait.py"
    prog.write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    args, env = [ACCELERATE, "launch", "--num_processes", "1", str(prog)], accelerate_env(tmp_path)

    def until_ready(read) -> str:
        out = ""
        while "ready" not in out:
            out += read()
        return out

    real = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    until_ready(lambda: real.stdout.readline())
    os.killpg(real.pid, signal.SIGINT)
    real_out = real.stdout.read()
    real.wait(timeout=60)

    zygote = torch_launcher.zygote_for(env)
    spec = parse_command(args, env, str(tmp_path))
    spec.process = process_attrs.capture()  # what run() sends: this caller's dispositions
    events, ours_out = signal_submitted_step(
        zygote, spec, signal.SIGINT,
        lambda out_r: until_ready(lambda: os.read(out_r, 4096).decode()))
    # accelerate 1.16 exits 130 (its own handling); older ones die of the KeyboardInterrupt.
    assert events["exit"]["returncode"] == real.returncode, (real_out, ours_out)
    assert real.returncode in (130, -signal.SIGINT), real_out
    assert "CalledProcessError" not in real_out and b"CalledProcessError" not in ours_out
    if real.returncode == -signal.SIGINT:
        assert "KeyboardInterrupt" in real_out and b"KeyboardInterrupt" in ours_out
