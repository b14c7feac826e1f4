"""torchrun's contract at its edges, against the real torchrun (``python -m torch.distributed.run``
and the ``torchrun`` script): signals, failure reports and error files, rendezvous, argument
macros, the ranks' stdio, interpreter and process groups; also inside shell steps, where the
launch is forked for a stand-in. Every rank writes each line in one ``os.write`` (ranks share
the stream and interleave)."""
import glob
import json
import os
import re
import signal
import textwrap

import pytest

from preload_launcher import Launcher

from conftest import PY, plain, signal_submitted_step

pytestmark = pytest.mark.needs_torch

BIN = os.path.dirname(PY)
TORCHRUN = os.path.join(BIN, "torchrun")

# Notes whether torch was loaded before its first line (forked from the zygote), then how it
# was started; on a signal it says which, once, and ends after a moment.
SLEEPER = textwrap.dedent("""\
    import os, signal, sys, time
    preloaded = 'module_table' in repr(sys.meta_path)  # forked
    rank = os.environ["LOCAL_RANK"]
    def say(text):
        os.write(1, f"rank {rank} {text}\\n".encode())
    def stop(signum, frame):
        say(f"got {signal.Signals(signum).name} group={os.getpgrp() == os.getpid()} "
            f"session={os.getsid(0) == os.getpid()}")
        time.sleep(0.3)
        say("finished its handler")
        sys.exit(0)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, stop)
    with open(os.environ["MARKS"], "a") as f:
        f.write(f"rank{rank} {preloaded}\\n")
    open(f"ready{rank}", "w").close()
    time.sleep(120)
    say("was never signalled")
    """)
# Starts the launch in the background, signals torchrun once both ranks are ready.
SIGNAL_SCRIPT = textwrap.dedent("""\
    rm -f ready0 ready1
    torchrun --nproc-per-node=2 $FLAGS sleeper.py > out.txt 2> err.txt &
    pid=$!
    for i in $(seq 600); do [ -f ready0 ] && [ -f ready1 ] && break; sleep 0.1; done
    kill -$SIG $pid
    wait $pid
    echo "exit $?"
    """)


def step_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MASTER_PORT")}
    return dict(env, PATH=BIN + os.pathsep + env.get("PATH", ""), MARKS=str(tmp_path / "marks"),
                TMPDIR=str(tmp_path), **extra)


def run_both(launcher, args, tmp_path, **extra):
    """(real, ours) for the same command in the same directory."""
    ref = plain(args, cwd=tmp_path, env=step_env(tmp_path, **extra), timeout=180)
    marks_before = _read(tmp_path / "marks")
    got = launcher.run(args, cwd=tmp_path, env=step_env(tmp_path, **extra), timeout=180)
    forked = _read(tmp_path / "marks")[len(marks_before):]
    return ref, got, forked


def _read(path) -> str:
    return path.read_text() if path.exists() else ""


def signal_outcome(tmp_path, output):
    """What a signalled launch shows: its exit, each rank's lines (sorted), the exception."""
    errors = [line for line in _read(tmp_path / "err.txt").splitlines()
              if line.startswith("torch.distributed.elastic")]
    return (output.strip().splitlines()[-1], sorted(_read(tmp_path / "out.txt").splitlines()),
            [re.sub(r"Process \d+", "Process PID", line) for line in errors])


@pytest.mark.parametrize("sig, flags", [
    ("TERM", ""), ("INT", ""), ("HUP", ""), ("QUIT", ""),
    ("USR1", "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1"),
])
def test_a_signal_to_torchrun_reaches_each_rank_once_as_with_torchrun(torch_launcher, tmp_path,
                                                                     sig, flags):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "sig.sh").write_text(SIGNAL_SCRIPT)
    ref = plain(["bash", "sig.sh"], cwd=tmp_path, env=step_env(tmp_path, SIG=sig, FLAGS=flags),
                timeout=180)
    theirs = signal_outcome(tmp_path, ref.stdout)
    # A stand-in asks only a zygote that serves: the shell's torchrun is forked once one is ready.
    torch_launcher.zygote_for(step_env(tmp_path))
    got = torch_launcher.run(["bash", "sig.sh"], cwd=tmp_path,
                             env=step_env(tmp_path, SIG=sig, FLAGS=flags), timeout=180)
    ours = signal_outcome(tmp_path, got.stdout)
    name = signal.Signals[f"SIG{sig}"]
    assert theirs[0] == "exit 1", ref.stdout
    handled = name != signal.SIGQUIT  # the sleeper handles the others, each rank in its session
    assert theirs[1] == (sorted(f"rank {r} {what}" for r in "01" for what in
                                (f"got {name.name} group=True session=True",
                                 "finished its handler")) if handled else [])
    assert theirs[2] == [f"torch.distributed.elastic.multiprocessing.api.SignalException: "
                         f"Process PID got signal: {int(name)}"]
    assert ours == theirs, (got.stdout, _read(tmp_path / "err.txt"))
    assert _read(tmp_path / "marks").split("\n").count("rank0 True") == 1  # forked, preloaded


def test_ctrl_c_on_a_run_caller_reaches_each_rank_once(torch_launcher, tmp_path):
    """Ctrl-C on the caller of ``run()`` (a signal relayed to the launch's group)."""
    from preload_launcher.command import parse_command
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    env = step_env(tmp_path)
    zygote = torch_launcher.zygote_for(env)
    spec = parse_command([TORCHRUN, "--nproc-per-node=2", "sleeper.py"], env, str(tmp_path))
    events, output = signal_submitted_step(
        zygote, spec, signal.SIGINT, lambda _: _wait_for_files(tmp_path, ["ready0", "ready1"]))
    text = output.decode()
    assert events["exit"]["returncode"] == 1, text
    assert sorted(l for l in text.splitlines() if l.startswith("rank ")) == sorted(
        f"rank {r} {what}" for r in "01"
        for what in ("got SIGINT group=True session=True", "finished its handler"))
    assert "SignalException: Process" in text and "got signal: 2" in text


def _wait_for_files(directory, names, timeout=120.0):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all((directory / n).exists() for n in names):
        time.sleep(0.05)


FAILING = textwrap.dedent("""\
    import os, signal, sys, time
    rank = int(os.environ["LOCAL_RANK"])
    if rank == 1:
        while not os.path.exists("ready0"):
            time.sleep(0.02)
        sys.exit(int(sys.argv[1]))
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(int(sys.argv[2])))
    open("ready0", "w").close()
    time.sleep(120 if int(sys.argv[1]) % 256 else 0)  # until terminated, when rank 1 fails
    """)


def failure_report(output):
    """torchrun's report, less what differs between two runs (times, pids, paths)."""
    lines = []
    for line in output.splitlines():
        if line.startswith("E1") and "failed (exitcode" in line:
            lines.append("E " + re.sub(r"pid: \d+", "pid: PID", line.split("] ", 1)[1]))
        elif line.startswith(("  rank", "  exitcode", "[", "Failures", "Root Cause", "  traceback",
                              "torch.distributed.elastic", "Traceback (most recent")):
            lines.append(re.sub(r"(pid:? )\d+", r"\1PID", re.sub(r"PID \d+", "PID PID", line)))
    return lines


@pytest.mark.parametrize("codes", [["3", "3"], ["1", "0"], ["256", "0"]])
def test_failure_reports_list_every_failed_rank_as_torchrun(torch_launcher, tmp_path, codes):
    """Rank 1 exits first; rank 0 is then terminated (SIGTERM) and exits with the second
    code: every failed rank is listed, the root cause first observed; exit status 1 (a rank's
    sys.exit(256) is 0, as its exit status reads)."""
    (tmp_path / "failing.py").write_text(FAILING)
    args = [TORCHRUN, "--nproc-per-node=2", "failing.py", *codes]
    ref, got, _ = run_both(torch_launcher, args, tmp_path)
    assert got.via == "zygote", got.reason
    want = 0 if codes == ["256", "0"] else 1
    assert ref.returncode == got.returncode == want, (ref.stdout, got.stdout)
    assert failure_report(got.stdout) == failure_report(ref.stdout), got.stdout


RECORDED = textwrap.dedent("""\
    import os
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        if os.environ["LOCAL_RANK"] == "1":
            raise ValueError("the root cause, recorded")

    main()
    """)


def test_a_recorded_root_cause_reaches_the_launchs_error_file(torch_launcher, tmp_path):
    (tmp_path / "recorded.py").write_text(RECORDED)
    args = [TORCHRUN, "--nproc-per-node=2", "recorded.py"]
    messages = []
    for name, run in (("real", lambda env: plain(args, cwd=tmp_path, env=env, timeout=180)),
                      ("ours", lambda env: torch_launcher.run(args, cwd=tmp_path, env=env,
                                                               timeout=180))):
        error_file = tmp_path / f"{name}.json"
        result = run(step_env(tmp_path, TORCHELASTIC_ERROR_FILE=str(error_file)))
        assert result.returncode == 1, result.stdout
        assert "ValueError: the root cause, recorded" in result.stdout
        messages.append(json.loads(error_file.read_text())["message"]["message"])
    assert messages[0] == messages[1] == "ValueError: the root cause, recorded"


# Each rank says where it meets the others, what it was given and how it was started.
PROBE = textwrap.dedent("""\
    import os, sys
    e = os.environ
    os.write(1, (f"RANK{e['RANK']} {e['MASTER_ADDR']} {e['MASTER_PORT']} {e['LOCAL_RANK']} "
                 f"{e.get('CUDA_VISIBLE_DEVICES')} {sys.argv[1:]} {sys.executable} "
                 f"{sys.orig_argv[0]}\\n").encode())
    """)


def probe_lines(output, dynamic_port):
    lines = sorted(l for l in output.splitlines() if l.startswith("RANK"))
    if dynamic_port:
        lines = [re.sub(r"^(RANK\d \S+) \d+", r"\1 PORT", l) for l in lines]
    return lines


@pytest.mark.parametrize("flags, dynamic_port", [
    ([], True),
    (["--standalone"], True),
    (["--rdzv-backend=static", "--rdzv-endpoint=localhost:{port}"], False),
    (["--master-port={port}"], False),
    (["--virtual-local-rank"], True),
])
@pytest.mark.parametrize("launch", [[TORCHRUN], [PY, "-m", "torch.distributed.run"]],
                         ids=["torchrun", "python-m"])
def test_rendezvous_macros_and_interpreter_match_torchrun(torch_launcher, tmp_path, flags,
                                                         dynamic_port, launch):
    """MASTER_ADDR/PORT as torchrun's rendezvous picks them (MASTER_PORT in the environment is
    not read), ``${local_rank}`` substituted, --virtual-local-rank's LOCAL_RANK and
    CUDA_VISIBLE_DEVICES, and the launcher's interpreter as the ranks' sys.executable."""
    (tmp_path / "probe.py").write_text(PROBE)
    port = _free_port()
    args = [*launch, "--nproc-per-node=2", *[f.format(port=port) for f in flags], "probe.py",
            "--out=log_${local_rank}.txt"]
    ref, got, _ = run_both(torch_launcher, args, tmp_path, MASTER_PORT=str(_free_port()))
    assert got.via == "zygote", got.reason
    assert ref.returncode == got.returncode == 0, (ref.stdout, got.stdout)
    theirs = probe_lines(ref.stdout, dynamic_port)
    assert len(theirs) == 2 and "log_1.txt" in theirs[1]
    assert probe_lines(got.stdout, dynamic_port) == theirs


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Two single-node launches at once, each rank waiting until the other launch's rank started.
CONCURRENT = textwrap.dedent("""\
    import os, sys, time
    import torch.distributed as dist
    me, other = sys.argv[1], sys.argv[2]
    open(me, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(other) and time.monotonic() < deadline:
        time.sleep(0.02)
    dist.init_process_group("gloo")
    dist.barrier()
    os.write(1, f"launch {me} met {other}: {os.path.exists(other)}\\n".encode())
    """)
CONCURRENT_SCRIPT = textwrap.dedent("""\
    torchrun --nproc-per-node=1 both.py a b & first=$!
    torchrun --nproc-per-node=1 both.py b a & second=$!
    wait $first; echo "first $?"
    wait $second; echo "second $?"
    """)


def test_two_single_node_launches_at_once_with_master_port_exported(torch_launcher, tmp_path):
    (tmp_path / "both.py").write_text(CONCURRENT)
    (tmp_path / "two.sh").write_text(CONCURRENT_SCRIPT)
    env = dict(MASTER_PORT=str(_free_port()))
    ref, got, forked = run_both(torch_launcher, ["bash", "two.sh"], tmp_path, **env)

    def outcome(output):
        return sorted(l for l in output.splitlines() if l.startswith(("first", "second", "launch")))
    assert outcome(ref.stdout) == ["first 0", "launch a met b: True", "launch b met a: True",
                                   "second 0"], ref.stdout
    assert outcome(got.stdout) == outcome(ref.stdout), got.stdout


STDERR_PROBE = "import os\nos.write(1, b'to stdout\\n')\nos.write(2, b'to stderr\\n')\n"


@pytest.mark.parametrize("launch", [
    "torchrun --nproc-per-node=2 probe.py",
    "accelerate launch --multi_gpu --num_processes 2 probe.py",
], ids=["torchrun", "accelerate-multi-gpu"])
def test_ranks_stderr_stays_stderr_in_a_shell_step(torch_launcher, tmp_path, launch):
    (tmp_path / "probe.py").write_text(STDERR_PROBE)
    (tmp_path / "s.sh").write_text(f"{launch} 2>/dev/null > out.txt\n"
                                   f"{launch} 2> err.txt > /dev/null\n")
    env = dict(HF_HOME=str(tmp_path / "hf"))  # no accelerate config decides for either side
    outcomes = []
    for run in (lambda: plain(["bash", "s.sh"], cwd=tmp_path, env=step_env(tmp_path, **env),
                              timeout=180),
                lambda: torch_launcher.run(["bash", "s.sh"], cwd=tmp_path,
                                           env=step_env(tmp_path, **env), timeout=180)):
        assert run().returncode == 0
        outcomes.append((sorted((tmp_path / "out.txt").read_text().splitlines()),
                         [l for l in (tmp_path / "err.txt").read_text().splitlines()
                          if l.startswith("to ")]))
    assert outcomes[0] == (["to stdout", "to stdout"], ["to stderr", "to stderr"])
    assert outcomes[1] == outcomes[0]


def test_a_launch_leaves_no_temporary_folder(torch_launcher, tmp_path):
    """torchrun's temporary log folder (``torchelastic_*``: error files, redirected logs) goes
    with the launch, whether it succeeded or failed."""
    (tmp_path / "failing.py").write_text(FAILING)
    (tmp_path / "probe.py").write_text(PROBE)
    for args in ([TORCHRUN, "--nproc-per-node=2", "probe.py"],
                 [TORCHRUN, "--nproc-per-node=2", "--redirects=3", "probe.py"],
                 [TORCHRUN, "--nproc-per-node=2", "failing.py", "3", "3"]):
        got = torch_launcher.run(args, cwd=tmp_path, env=step_env(tmp_path), timeout=180)
        assert got.via == "zygote", got.reason
        assert glob.glob(str(tmp_path / "torchelastic_*")) == [], args


# A program forked for a stand-in: its parent handles SIGTERM and finds its child alive;
# a background child it started outlives it, as with plain python.
GROUPS_SCRIPT = textwrap.dedent("""\
    rm -f child.txt
    python -c "import subprocess, sys; print(subprocess.Popen(['sleep', '31.5']).pid)
    with open('marks', 'a') as f: f.write(f'bg {\\"module_table\\" in repr(sys.meta_path)}\\n')" > bg.txt
    for i in $(seq 30); do kill -0 $(cat bg.txt) 2>/dev/null || break; sleep 0.1; done
    if kill -0 $(cat bg.txt) 2>/dev/null; then echo "background child lives on"; kill $(cat bg.txt); fi
    python parent.py > parent.txt &
    pid=$!
    for i in $(seq 6000); do grep -q ready parent.txt 2>/dev/null && break; sleep 0.1; done  # <= 600 s
    kill -TERM $pid; wait $pid; echo "parent exit $?"; cat parent.txt
    """)
CHILD = ("import signal, time\n"
         "signal.signal(signal.SIGTERM, lambda *_: open('child.txt', 'w').write('got SIGTERM'))\n"
         "open('child.txt', 'w').close()\n"
         "time.sleep(60)\n")
PARENT = textwrap.dedent("""\
    import os, signal, subprocess, sys, time
    CHILD = %r
    with open("marks", "a") as f:
        f.write(f"parent {'module_table' in repr(sys.meta_path)}\\n")
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    def stop(*_):
        time.sleep(0.5)  # time enough for the child to note a SIGTERM it got too
        child.kill()
        child.wait()
        with open("child.txt") as f:
            print("child:", f.read().strip() or "not signalled", flush=True)
        sys.exit(4)
    signal.signal(signal.SIGTERM, stop)
    while not os.path.exists("child.txt"):
        time.sleep(0.02)
    print("ready", flush=True)
    time.sleep(60)
    """) % CHILD


def test_a_stand_ins_program_owns_what_the_real_one_would(torch_launcher, tmp_path):
    (tmp_path / "groups.sh").write_text(GROUPS_SCRIPT)
    (tmp_path / "parent.py").write_text(PARENT)
    ref = plain(["bash", "groups.sh"], cwd=tmp_path, env=step_env(tmp_path), timeout=900)
    torch_launcher.zygote_for(step_env(tmp_path))  # a stand-in asks only a ready zygote
    got = torch_launcher.run(["bash", "groups.sh"], cwd=tmp_path, env=step_env(tmp_path),
                             timeout=900)
    assert got.via == "subprocess" and "forked by the zygote" in got.reason
    assert ref.stdout.splitlines() == ["background child lives on", "parent exit 4", "ready",
                                       "child: not signalled"]
    assert got.stdout.splitlines() == ref.stdout.splitlines()
    assert (tmp_path / "marks").read_text().split() == ["bg", "False", "parent", "False",
                                                        "bg", "True", "parent", "True"]


def test_run_path_keeps_the_scripts_path_as_given(torch_launcher, tmp_path):
    (tmp_path / "pkgx").mkdir()
    (tmp_path / "pkgx" / "mod.py").write_text(
        "import os, sys\nos.write(1, f'RANK{os.environ[\"RANK\"]} {__file__} {sys.argv}\\n'.encode())\n")
    args = [TORCHRUN, "--nproc-per-node=2", "--run-path", "pkgx/mod.py", "x"]
    ref, got, _ = run_both(torch_launcher, args, tmp_path)
    assert got.via == "zygote", got.reason
    assert ref.returncode == got.returncode == 0, (ref.stdout, got.stdout)
    theirs = probe_lines(ref.stdout, False)
    assert theirs == [f"RANK{r} pkgx/mod.py ['pkgx/mod.py', 'x']" for r in "01"]
    assert probe_lines(got.stdout, False) == theirs





def test_run_path_runs_the_script_as_torchrun_s_worker_does(torch_launcher, tmp_path):
    """torchrun --run-path runs the script with ``runpy.run_path`` in a worker spawned with
    the agent's ``sys.path``: the script's folder is not on it (a module beside the script is
    not found) and ``__main__`` has no loader."""
    (tmp_path / "pkgx").mkdir()
    (tmp_path / "pkgx" / "beside.py").write_text("VALUE = 1\n")
    (tmp_path / "pkgx" / "mod.py").write_text(textwrap.dedent("""\
        import os, sys
        try:
            import beside
            found = "found"
        except ImportError as err:
            found = repr(err)
        os.write(1, f"RANK{os.environ['RANK']} {found} {sys.path[0]} {__loader__!r} "
                    f"{__package__!r} {__spec__!r}\\n".encode())
        """))
    args = [TORCHRUN, "--nproc-per-node=2", "--run-path", "pkgx/mod.py"]
    ref, got, _ = run_both(torch_launcher, args, tmp_path)
    assert got.via == "zygote", got.reason
    theirs = probe_lines(ref.stdout, False)
    assert len(theirs) == 2 and "No module named 'beside'" in theirs[0], ref.stdout
    assert probe_lines(got.stdout, False) == theirs

SIGNAL_PROBE = textwrap.dedent("""\
    import os, signal
    with open("/proc/self/status") as f:
        ignored = [line.split()[1] for line in f if line.startswith("SigIgn")][0]
    os.write(1, f"RANK{os.environ['RANK']} {signal.getsignal(signal.SIGINT)} "
                f"{signal.getsignal(signal.SIGUSR1)} {ignored}\\n".encode())
    """)


@pytest.mark.parametrize("launcher_args", [[], ["--max-restarts=1"]])  # either agent
def test_ranks_take_on_what_a_subprocess_of_torchrun_would_inherit(tmp_path, launcher_args):
    """A rank inherits its agent's process attributes, which are the caller's: a signal the
    zygote ignores (it started in a job run with ``&``) is not ignored, one the caller ignores
    is."""
    (tmp_path / "signals.py").write_text(SIGNAL_PROBE)
    args = [TORCHRUN, "--nproc-per-node=2", *launcher_args, "signals.py"]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        launcher = Launcher(["torch"])
        launcher.zygote_for(step_env(tmp_path))  # started now: with SIGINT ignored
    finally:
        signal.signal(signal.SIGINT, previous)
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        ref, got, _ = run_both(launcher, args, tmp_path)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        launcher.close()
    assert got.via == "zygote", got.reason
    theirs = probe_lines(ref.stdout, False)
    assert len(theirs) == 2 and theirs[0].split()[-2] == "1", ref.stdout  # SIGUSR1: SIG_IGN
    assert "default_int_handler" in theirs[0]
    assert probe_lines(got.stdout, False) == theirs

NOTICE = "Setting OMP_NUM_THREADS environment variable for each process"
PRINT_RANK = "import os; os.write(1, f\"rank {os.environ['RANK']}\\n\".encode())"


def _notice(output: str) -> list[str]:
    """torchrun's OMP_NUM_THREADS notice as printed, less the time and pid of torch's prefix."""
    return [re.sub(r"^[WI]\d{4} [\d:.]+ \d+ ", "", line) for line in output.splitlines()
            if NOTICE in line or "*****" in line]


def test_torchruns_notice_is_torchruns_under_python_m(torch_launcher, tmp_path):
    """``python -m torch.distributed.run`` logs as ``__main__`` (no torch log prefix)."""
    (tmp_path / "ranks.py").write_text(PRINT_RANK)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    args = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(tmp_path / "ranks.py")]
    ref = plain(args, env=env, timeout=120)
    got = torch_launcher.run(args, env=env, timeout=120)
    assert (got.via, got.returncode, ref.returncode) == ("zygote", 0, 0), got.stdout
    assert _notice(got.stdout) == _notice(ref.stdout) and len(_notice(ref.stdout)) == 3


def test_a_launch_the_agent_leaves_to_torchrun_prints_its_notice_once(tmp_path, runtime_base):
    """The CLI's output of a launch torchrun itself runs (``--local-addr``): one notice."""
    (tmp_path / "ranks.py").write_text(PRINT_RANK)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(XDG_RUNTIME_DIR=str(runtime_base), PRELOAD_LAUNCHER_MODULES="torch")
    args = [TORCHRUN, "--nproc-per-node", "2", "--local-addr", "127.0.0.1",
            str(tmp_path / "ranks.py")]
    ref = plain(args, env=env, timeout=120)
    got = plain([PY, "-m", "preload_launcher.cli", "run", "--no-daemon", "--", *args], env=env,
                timeout=300)
    assert (got.returncode, ref.returncode) == (0, 0), got.stdout
    assert _notice(got.stdout) == _notice(ref.stdout) and len(_notice(ref.stdout)) == 3
