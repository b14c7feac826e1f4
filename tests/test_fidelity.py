"""A forked python step against a fresh interpreter, side by side: the same program run with
``subprocess.run`` and through the launcher must show the same returncode (and its type),
output, files and process attributes."""
import contextlib
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import PY, caller_runs, plain

BIN = os.path.dirname(PY)
# Variables of the machine running the tests that would change what both sides show.
SCRUBBED = ("PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONOPTIMIZE", "PYTHONDEVMODE",
            "PYTHONVERBOSE", "PYTHONINTMAXSTRDIGITS", "PYTHONWARNDEFAULTENCODING",
            "PYTHONTRACEMALLOC", "PYTHONUTF8")


def fresh_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    return dict(env, **extra)


def both(launcher, args, **kwargs):
    """(the fresh interpreter's result, the launcher's), for the same command."""
    kwargs.setdefault("env", fresh_env())
    ref = plain(args, timeout=120, **kwargs)
    got = launcher.run(args, timeout=120, **kwargs)
    return ref, got


def same_run(launcher, args, via="zygote", **kwargs):
    ref, got = both(launcher, args, **kwargs)
    assert got.via == via, got.reason
    assert type(got.returncode) is int
    assert (got.returncode, without_addresses(got.stdout)) == \
        (ref.returncode, without_addresses(ref.stdout))
    return ref, got


def without_addresses(text):
    return re.sub(r" at 0x[0-9a-f]+", " at 0x…", text)


# ---------------------------------------------------------------- the program's end

FINALISED = textwrap.dedent("""\
    import sys, tempfile
    log = open(sys.argv[1], "w")
    log.write("result: 42\\n")
    held = tempfile.NamedTemporaryFile(prefix=sys.argv[2], dir=sys.argv[3])
    class Noisy:
        def __del__(self):
            print("del ran")
            raise ValueError("in __del__")
    noisy = Noisy()
    class Cycle:
        def __del__(self):
            print("cycle collected")
    _cycle = Cycle()
    _cycle.me = _cycle
    """)


def test_the_programs_objects_are_finalised_at_exit(light, tmp_path):
    """Unclosed files are flushed, temporary files removed, ``__del__`` run, its error printed."""
    script = tmp_path / "fin.py"
    script.write_text(FINALISED)
    outputs = {}
    for name, runner in (("ref", plain), ("got", light.run)):
        result = runner([PY, str(script), str(tmp_path / name), f"held-{name}-", str(tmp_path)],
                        env=fresh_env(), timeout=120)
        lines = without_addresses(result.stdout).splitlines()
        if sys.version_info < (3, 11):  # 3.10 finalises a cycle and a plain global in another order
            lines.sort()
        outputs[name] = (result.returncode, "\n".join(lines))
        assert (tmp_path / name).read_text() == "result: 42\n"
    assert outputs["got"] == outputs["ref"]
    assert "cycle collected" in outputs["ref"][1] and "ValueError: in __del__" in outputs["ref"][1]
    assert not list(tmp_path.glob("held-*"))


# ---------------------------------------------------------------- exit statuses

@pytest.mark.parametrize("code", [
    "sys.exit(-1)", "sys.exit(256)", "sys.exit(300)", "raise SystemExit(True)",
    "sys.exit('bye')", "sys.exit(None)",
    "sys.stdout.close()",
    "sys.stdout.close(); sys.exit(3)",
    # Flushing a still-open stdout fails at exit: python says so and exits 120, whatever code.
    "fd = os.open('/dev/full', os.O_WRONLY); os.dup2(fd, 1); print('x')",
    "fd = os.open('/dev/full', os.O_WRONLY); os.dup2(fd, 1); print('x'); sys.exit(3)",
    # Without a sys.stderr python writes the message to fd 2; a closed one gets the newline.
    "sys.stderr = None; sys.exit('fatal: config missing')",
    "sys.stderr.close(); sys.exit('bye')",
    # A replacement of sys.stdout without `closed` is open to python; one without `flush`
    # fails at exit (120).
    "class Tee:\n def __init__(self, s): self.s = s\n def write(self, t): return self.s.write(t)\n"
    " def flush(self): self.s.flush()\nsys.stdout = Tee(sys.stdout); print('hello')",
    "class Tee:\n def write(self, t): return sys.__stdout__.write(t)\nsys.stdout = Tee(); print('hello')",
])
def test_exit_statuses_are_pythons(light, code):
    same_run(light, [PY, "-c", f"import os, sys\n{code}"])


@pytest.mark.parametrize("ending", ["pass", "raise KeyError('boom')", "sys.exit(3)"])
def test_a_trace_function_left_set_sees_what_python_runs_at_exit(light, ending):
    """Python keeps a trace or profile function the program left set for what it runs in
    Python at exit (the excepthook, thread shutdown, atexit callbacks), and for nothing else."""
    program = textwrap.dedent(f"""\
        import atexit, sys
        calls = []
        def trace(frame, event, arg):
            calls.append(frame.f_code.co_name)
        def profile(frame, event, arg):
            if event == "call":
                calls.append("profiled " + frame.f_code.co_name)
        def hook(*exc):
            print("hook", exc[0].__name__)
        sys.excepthook = hook
        atexit.register(lambda: print("atexit", calls[:]))
        sys.settrace(trace)
        sys.setprofile(profile)
        def work():
            return 1
        work()
        {ending}
        """)
    ref, _ = same_run(light, [PY, "-c", program])
    assert "atexit ['work', 'profiled work'" in ref.stdout


def test_an_uncaught_exception_is_kept_in_sys_last_vars(light):
    """python's ``PyErr_Print`` sets ``sys.last_type`` & co. before the hook: atexit sees them."""
    program = ("import atexit, sys\natexit.register(lambda: print('atexit sees', "
               "getattr(sys, 'last_type', None), repr(getattr(sys, 'last_value', None)), "
               "getattr(sys, 'last_exc', None) is getattr(sys, 'last_value', None)))\n"
               "raise KeyError('boom')\n")
    ref, _ = same_run(light, [PY, "-c", program])
    assert "atexit sees <class 'KeyError'> KeyError('boom')" in ref.stdout


@pytest.mark.parametrize("source", ["def f(:\n", "if True:\nx = 1\n"])
def test_a_script_that_does_not_compile_is_reported_as_python_does(light, tmp_path, source):
    """No traceback: none of the program ran (a SyntaxError, an IndentationError)."""
    script = tmp_path / "broken.py"
    script.write_text(source)
    ref, _ = same_run(light, [PY, str(script)])
    assert ref.returncode == 1 and "Traceback" not in ref.stdout


def test_the_exit_status_rule_is_pythons():
    from preload_launcher.step.runtime import exit_status_of
    for code in (None, 0, 1, -1, 255, 256, 300, -300, 2**31, 2**63, -2**63 - 1, True, False):
        ref = subprocess.run([PY, "-c", f"import sys; sys.exit({code!r})"])
        assert exit_status_of(SystemExit(code)) == ref.returncode, code


# ---------------------------------------------------------------- stdio

STREAMS = textwrap.dedent("""\
    import sys
    for name in ("stdin", "stdout", "stderr"):
        s = getattr(sys, name)
        b = s.buffer
        raw = getattr(b, "raw", b)
        print(name, s is getattr(sys, "__%s__" % name), type(b).__name__, type(raw).__name__,
              raw.name, s.name, s.mode, b.mode, s.encoding, s.errors, s.line_buffering,
              s.write_through, s.seekable(), raw.closefd)
    """)


@pytest.mark.parametrize("extra,flags", [
    ({}, []), ({"PYTHONIOENCODING": "latin-1:ignore"}, []), ({"PYTHONIOENCODING": ":replace"}, []),
    ({"PYTHONIOENCODING": "UTF8"}, []), ({"PYTHONUNBUFFERED": "1"}, []),
    ({"PYTHONUNBUFFERED": "0"}, []), ({}, ["-u"])])
def test_stdio_objects_are_a_fresh_interpreters(light, extra, flags):
    with stdin_from_a_pipe():  # as a CI runner's often is (not seekable)
        same_run(light, [PY, *flags, "-c", STREAMS], env=fresh_env(**extra))


@contextlib.contextmanager
def stdin_from_a_pipe():
    """The caller's fd 0 (what both sides inherit) is a pipe for a while."""
    saved = os.dup(0)
    r, w = os.pipe()
    os.close(w)
    os.dup2(r, 0)
    os.close(r)
    try:
        yield
    finally:
        os.dup2(saved, 0)
        os.close(saved)


def test_buffered_bytes_come_after_unbuffered_writes_as_in_python(light):
    same_run(light, [PY, "-c", "import os, sys; sys.stdout.buffer.write(b'A'); os.write(1, b'B')"])


INTERRUPTED = textwrap.dedent("""\
    import signal, sys
    signal.signal(signal.SIGALRM, lambda *a: None)
    signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
    for _ in range(20):
        sys.stdout.write("x" * 2_000_000)
    signal.setitimer(signal.ITIMER_REAL, 0)
    """)


def test_writes_interrupted_by_signals_deliver_every_byte(light):
    ref, got = both(light, [PY, "-c", INTERRUPTED])
    assert got.via == "zygote"
    assert (got.returncode, len(got.stdout)) == (ref.returncode, len(ref.stdout)) == (0, 40_000_000)


def test_a_closed_pipe_is_a_broken_pipe_error(light):
    """``python … | head -c10``: python's BrokenPipeError and exit 1 (the pipeline's python is
    forked through its stand-in)."""
    script = ("python3 -c 'import sys; sys.stdout.write(\"x\" * 200000)' 2>&3 | head -c10 >/dev/null; "
              "echo rc=${PIPESTATUS[0]}")
    env = fresh_env(PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    light.run([PY, "-c", "pass"], env=env)  # a ready zygote for this environment first
    before = light.standin_steps()
    ref, got = both(light, ["bash", "-c", "{ %s; } 3>&1" % script], env=env)
    assert light.standin_steps() == before + 1, got.reason
    assert got.stdout == ref.stdout and "rc=1" in ref.stdout and "BrokenPipeError" in ref.stdout


PRELOADED_LOGGER = textwrap.dedent("""\
    import logging
    handler = logging.StreamHandler()  # holds sys.stderr as it is at import
    logging.getLogger("prelog").addHandler(handler)
    """)


def test_log_handlers_made_at_preload_hold_the_steps_stderr(tmp_path):
    from preload_launcher import Launcher
    (tmp_path / "prelog.py").write_text(PRELOADED_LOGGER)
    env = fresh_env(PYTHONPATH=str(tmp_path))
    code = ("import logging, sys, prelog; print(prelog.handler.stream is sys.stderr); "
            "logging.getLogger('prelog').warning('to stderr'); print('after')")
    launcher = Launcher(["prelog"])
    try:
        ref, got = both(launcher, [PY, "-c", code], env=env)
        status = launcher.zygotes[0].request("status")
    finally:
        launcher.close()
    assert got.via == "zygote" and "prelog" in str(status.get("preload")), got.reason
    # stderr is line-buffered, stdout (a pipe) block-buffered: the warning comes first
    assert got.stdout == ref.stdout == "to stderr\nTrue\nafter\n"


# ---------------------------------------------------------------- interpreter settings

SETTINGS = textwrap.dedent("""\
    import locale, os, sys, warnings
    print("flags", sys.flags.optimize, sys.flags.dev_mode, sys.flags.utf8_mode,
          getattr(sys.flags, "warn_default_encoding", None),
          getattr(sys.flags, "int_max_str_digits", None), __debug__)
    print("digits", getattr(sys, "get_int_max_str_digits", lambda: None)())
    print("locale", locale.setlocale(locale.LC_CTYPE), os.environ.get("LC_CTYPE"),
          sys.stdout.encoding, sys.stdout.errors, sys.getfilesystemencoding())
    print("warnings", [f[0] for f in warnings.filters][:4])
    try:
        assert False, "asserts run"
    except AssertionError as e:
        print(e)
    """)


@pytest.mark.parametrize("extra", [
    {"PYTHONOPTIMIZE": "1"}, {"PYTHONOPTIMIZE": "2"}, {"PYTHONDEVMODE": "1"},
    {"PYTHONINTMAXSTRDIGITS": "640"}, {"PYTHONWARNDEFAULTENCODING": "1"},
    {"LC_ALL": "C"}, {"LANG": "C", "LC_ALL": ""}, {"PYTHONUTF8": "1"}, {"PYTHONUTF8": "0"}])
def test_interpreter_settings_are_the_steps_own(extra):
    """A step with the setting, one without, and one with again, through one launcher: each
    as a fresh interpreter started with its own environment."""
    from preload_launcher import Launcher
    launcher = Launcher(["json"])
    try:
        for env in (fresh_env(**extra), fresh_env(), fresh_env(**extra)):
            ref, got = both(launcher, [PY, "-c", SETTINGS], env=env)
            assert got.stdout == ref.stdout, got.reason
            assert got.via == "zygote" or "start-up settings" in got.reason, got.reason
    finally:
        launcher.close()


@pytest.mark.parametrize("args,extra", [
    (["-X", "warn_default_encoding"], {}), (["-O"], {}), (["-X", "dev"], {}),
    ([], {"PYTHONVERBOSE": "1"})])
def test_start_up_options_a_zygote_lacks_run_as_a_fresh_interpreter(light, args, extra):
    ref, got = both(light, [PY, *args, "-c", SETTINGS], env=fresh_env(**extra))
    assert got.via == "subprocess" and got.reason
    assert without_addresses(got.stdout) == without_addresses(ref.stdout)


def test_tracemalloc_from_the_environment(light):
    code = "import tracemalloc; print(tracemalloc.is_tracing(), tracemalloc.get_traceback_limit())"
    for value in ("5", "0"):
        same_run(light, [PY, "-c", code], env=fresh_env(PYTHONTRACEMALLOC=value))


# ---------------------------------------------------------------- sys.path

@pytest.mark.parametrize("pythonpath", ["src", ".", "src:.::../up", "./src:" + os.sep + "abs"])
def test_a_relative_pythonpath_is_resolved_against_the_steps_cwd(light, tmp_path, pythonpath):
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "src" / "mylib.py").write_text("VALUE = 42\n")
    code = "import sys; print(sys.path[:6]); import mylib; print(mylib.VALUE)"
    same_run(light, [PY, "-c", code], cwd=work, env=fresh_env(PYTHONPATH=pythonpath))


# ---------------------------------------------------------------- fds

# The step's fds, less the one it reports its exit on (at the top of the fd range).
FDS = textwrap.dedent("""\
    import os, resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    report = min(soft, 1024) - 1
    print(sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) != report))
    """)


@pytest.mark.needs_torch
def test_a_steps_fds_are_a_fresh_interpreters(torch_launcher):
    """Nothing of the zygote's (its thread-count probe's pipe, its sockets) reaches a step."""
    same_run(torch_launcher, [PY, "-c", "import torch\n" + FDS],
             env=fresh_env(OMP_NUM_THREADS="1"))  # a thread environment the zygote probes


def test_a_program_that_takes_the_report_fd_keeps_its_file(light, tmp_path):
    """A program that ``dup2``s its own file onto the exit report's fd: the file gets only what
    the program wrote, and the exit code still arrives."""
    code = textwrap.dedent("""\
        import os, resource, sys
        top = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 1024) - 1
        fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        for n in (top, 100):
            os.dup2(fd, n)
        os.write(top, b"mine\\n")
        sys.exit(7)
        """)
    for name, runner in (("ref", plain), ("got", light.run)):
        result = runner([PY, "-c", code, str(tmp_path / name)], env=fresh_env(), timeout=60)
        assert result.returncode == 7
        assert (tmp_path / name).read_text() == "mine\n"


def test_a_step_sees_no_fds_of_steps_waiting_for_gpus(tmp_path, monkeypatch):
    """GPU packing: a step started while another waits for a GPU holds none of the waiting
    step's fds (its connection, its stdin and output)."""
    import threading
    import time
    from preload_launcher import Launcher
    monkeypatch.setenv("PRELOAD_LAUNCHER_CACHE_DIR", str(tmp_path / "cache"))
    release = tmp_path / "release"
    hold = ("import os, sys, time\n"
            "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n")
    launcher = Launcher(["json"], gpus="0")
    threads = []
    try:
        launcher.run([PY, "-c", "pass"], env=fresh_env())
        for _ in range(2):  # one holds GPU 0, the other waits for it
            threads.append(threading.Thread(target=launcher.run, args=(
                [PY, "-c", hold, str(release)],), kwargs={"env": fresh_env(), "timeout": 120}))
            threads[-1].start()
        zygote = launcher.zygotes[0]
        deadline = time.monotonic() + 60
        while zygote.request("status")["gpus"]["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert zygote.request("status")["gpus"]["waiting"] == 1
        same_run(launcher, [PY, "-c", FDS], env=fresh_env(CUDA_VISIBLE_DEVICES=""))
    finally:
        release.write_text("")
        for thread in threads:
            thread.join()
        launcher.close()


# ---------------------------------------------------------------- what python FILE runs

MAIN = textwrap.dedent("""\
    import sys
    print("file", __file__, "argv0", sys.argv[0], "path0", sys.path[0])
    print("spec", __spec__, "loader", type(__loader__).__name__)
    print("cached", globals().get("__cached__"), "package", repr(__package__))
    """)


@pytest.fixture
def scripts(tmp_path):
    import py_compile
    import zipapp
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.py").write_text(MAIN)
    (tmp_path / "dirapp").mkdir()
    (tmp_path / "dirapp" / "__main__.py").write_text(MAIN)
    zipapp.create_archive(str(tmp_path / "dirapp"), str(tmp_path / "app.pyz"))
    py_compile.compile(str(tmp_path / "sub" / "x.py"), cfile=str(tmp_path / "x.pyc"))
    (tmp_path / "work").mkdir()
    return tmp_path


@pytest.mark.parametrize("path", ["../sub/x.py", "./../sub/x.py", "../app.pyz", "../dirapp",
                                  "../x.pyc", "../sub", "../missing.py"])
def test_a_file_python_runs_is_run_as_python_runs_it(light, scripts, path):
    same_run(light, [PY, path, "arg"], cwd=scripts / "work")


# ---------------------------------------------------------------- process attributes

ATTRIBUTES = textwrap.dedent("""\
    import os, resource, signal
    print("umask", oct(os.umask(0o22)))
    print("nofile", resource.getrlimit(resource.RLIMIT_NOFILE))
    print("affinity", sorted(os.sched_getaffinity(0)))
    print("nice", os.getpriority(os.PRIO_PROCESS, 0))
    print("ignored", [s.name for s in signal.valid_signals() if s in signal.Signals.__members__.values()
                      and signal.getsignal(s) == signal.SIG_IGN])
    print("sigint", signal.getsignal(signal.SIGINT))
    print("blocked", sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    """)
# What the caller changes after its zygote started (``conftest.caller_runs``).
ATTRIBUTE_CHANGES = textwrap.dedent("""\
    import signal
    os.umask(0o077)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus[-1:])
    os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 5)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    """)


def caller_env():
    return fresh_env(PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))


def caller_with_other_attributes(code, how, modules="json"):
    """A caller with other attributes than the test's (and than its zygote's) runs ``code``."""
    return caller_runs(how, code, ATTRIBUTE_CHANGES, caller_env(), modules=modules)


def test_process_attributes_are_the_callers_at_call_time():
    ref = caller_with_other_attributes(ATTRIBUTES, "plain")
    got = caller_with_other_attributes(ATTRIBUTES, "launcher")
    assert "via zygote" in got
    assert got.replace(got.splitlines()[-1] + "\n", "") == ref


def test_a_signal_the_zygote_ignores_is_not_ignored_for_a_caller_that_does_not():
    """A zygote started while SIGINT was ignored (its starter ran under ``&`` or nohup), and a
    caller that then takes SIGINT back: its step gets python's KeyboardInterrupt handler, as a
    fresh interpreter started by that caller does."""
    code = ("import signal; print('sigint', signal.getsignal(signal.SIGINT) is "
            "signal.default_int_handler)")
    change = ATTRIBUTE_CHANGES.replace("signal.signal(signal.SIGINT, signal.SIG_IGN)",
                                       "signal.signal(signal.SIGINT, signal.default_int_handler)")
    assert change.count("default_int_handler") == 1
    before = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    outs = [caller_runs(how, code, change, caller_env(), before) for how in ("plain", "launcher")]
    assert outs[0] == "sigint True\n", outs
    assert outs[1].splitlines()[0] == "sigint True" and "via zygote" in outs[1], outs


THREADS_AS_PACKAGES_LOAD = """\
import os
count = lambda: len(os.listdir("/proc/self/task"))
before = count()
import numpy
with_numpy = count()
import torch
print(before, with_numpy, count(), torch.get_num_threads(), torch.get_num_interop_threads())
"""


@pytest.mark.needs_torch
@pytest.mark.parametrize("omp", [None, "1"])
def test_thread_pools_start_when_the_step_imports_their_package(torch_launcher, omp):
    """A pool sized for the step starts its workers then: a fresh interpreter has none before
    it imports numpy (OpenBLAS's) or torch."""
    env = fresh_env(**({"OMP_NUM_THREADS": omp} if omp else {}))
    same_run(torch_launcher, [PY, "-c", THREADS_AS_PACKAGES_LOAD], env=env)


@pytest.mark.needs_torch
def test_torch_threads_follow_the_callers_cpu_set():
    code = "import torch; print(torch.get_num_threads(), torch.get_num_interop_threads())"
    ref = caller_with_other_attributes(code, "plain")
    got = caller_with_other_attributes(code, "launcher", "torch")
    assert "via zygote" in got
    assert got.splitlines()[0] == ref.strip()


def test_a_shell_steps_python_gets_the_shells_attributes(light):
    """``(umask 077; ulimit -n 512; trap '' HUP; python3 …)`` in a shell step: its python is
    forked through its stand-in, with the shell's attributes."""
    script = f"umask 077; ulimit -n 512; trap '' HUP; python3 -c '{ATTRIBUTES}'"
    env = fresh_env(PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    light.run([PY, "-c", "pass"], env=env)  # a ready zygote for this environment first
    before = light.standin_steps()
    ref, got = both(light, ["bash", "-c", script], env=env)
    assert light.standin_steps() == before + 1, got.reason
    assert got.stdout == ref.stdout and "0o77" in ref.stdout and "SIGHUP" in ref.stdout


@pytest.mark.needs_torch
def test_a_zygote_holds_only_what_its_entries_import(tmp_path):
    """A zygote that preloads ``json`` holds no torch, even where torch is installed: a step's
    process has the libraries a fresh interpreter's has, not the stack's (its import-time
    settings, exit handlers and memory)."""
    from preload_launcher import Launcher
    code = "print(any('libtorch' in line for line in open('/proc/self/maps')))"
    launcher = Launcher(["json"])
    try:
        env = fresh_env(PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
        ref, got = both(launcher, [PY, "-c", code], env=env)
    finally:
        launcher.close()
    assert (got.via, got.stdout) == ("zygote", ref.stdout) and ref.stdout == "False\n", got.reason
