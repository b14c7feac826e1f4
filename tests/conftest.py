import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from preload_launcher import Launcher

import suite_dirs  # the suite's own directories (loaded earlier still, by ``-p suite_dirs``)

PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")
PY = sys.executable

pytest_plugins = ["pytester"]

TORCH_FIXTURES = {"torch_launcher", "warm_torch_launcher"}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Nothing is left in the temporary directory of the programs the suite started (only the
    suite's own: other jobs' files in /tmp are none of its business)."""
    if suite_dirs.OWNER and suite_dirs.leftovers():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    left = suite_dirs.leftovers() if suite_dirs.OWNER else []
    if left:
        terminalreporter.write_sep("=", "left behind by the suite's programs", red=True)
        terminalreporter.write_line(f"in {suite_dirs.TMP}: {', '.join(left)}", red=True)


@pytest.fixture
def runtime_base():
    """A new short directory for a test's own ``XDG_RUNTIME_DIR`` (``suite_dirs.short_dir``)."""
    path = suite_dirs.short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Tests that need torch (its fixtures, or marked ``needs_torch``) are skipped where it is
    not installed: the core suite also runs on the Pythons the stack has no CPU build for."""
    have_torch = importlib.util.find_spec("torch") is not None
    for item in items:
        if TORCH_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker("needs_torch")
        if not have_torch and item.get_closest_marker("needs_torch"):
            item.add_marker(pytest.mark.skip(reason="needs torch (not installed for this Python)"))


def program(name: str) -> str:
    return os.path.join(PROGRAMS, name)


# A caller process that does ``before``, starts its zygote, does ``change`` (its own attributes
# at call time) and runs ``python -c code`` plainly or through the launcher (then a last line
# "via …"): the steps' process attributes against a subprocess's.
CALLER = textwrap.dedent("""\
    import ctypes, os, resource, subprocess, sys
    how, modules, code, before, change = sys.argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    exec(before)  # its zygote starts with what this leaves
    args = [sys.executable, "-c", code]
    if how == "launcher":
        from preload_launcher import Launcher
        launcher = Launcher(modules.split(","))
        launcher.run([sys.executable, "-c", "pass"])
    exec(change)  # the caller's own, at call time
    if how == "plain":
        out = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(out.stdout, end="")
    else:
        try:
            result = launcher.run(args)
            print(result.stdout, end="")
            print("via", result.via, result.reason)
        finally:
            launcher.close()
    """)


def caller_runs(how: str, code: str, change: str, env: dict, before: str = "",
                modules: str = "json") -> str:
    """The caller's output (``how``: "plain" or "launcher")."""
    out = subprocess.run([PY, "-c", CALLER, how, modules, code, before, change], env=env,
                         timeout=300, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert out.returncode == 0, out.stdout
    return out.stdout


def plain(args, **kwargs) -> subprocess.CompletedProcess:
    """The reference: what subprocess.run gives for the same command."""
    return subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          **kwargs)


@pytest.fixture(scope="session")
def light():
    """A launcher whose zygote preloads only the standard library (fast to start)."""
    launcher = Launcher(["json", "logging"])
    yield launcher
    launcher.close()


@pytest.fixture(scope="session")
def torch_launcher():
    launcher = Launcher(["torch"])
    yield launcher
    launcher.close()


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pid: int, timeout: float = 60.0) -> bool:
    """Whether ``pid`` ends within ``timeout``: a deadline, not a measurement (on a loaded
    machine a killed process may wait a while to be scheduled, exit and be reaped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def signal_submitted_step(zygote, spec, signum, wait_ready) -> tuple[dict, bytes]:
    """Submit ``spec`` to ``zygote`` (stdin, and one pipe for its output), wait with
    ``wait_ready(output_fd)``, then send ``signum`` as a caller relays Ctrl-C. Returns the
    step's events by name and the output that followed."""
    from preload_launcher import protocol
    out_r, out_w = os.pipe()
    sock = zygote.submit(spec, [0, out_w])
    os.close(out_w)
    try:
        wait_ready(out_r)
        protocol.send_op(sock, "signal", signum=signum)
        reader, events = protocol.EventReader(), {}
        while "exit" not in events:
            events.update({e["event"]: e for e in reader.feed(sock.recv(4096))})
        output = b""
        while chunk := os.read(out_r, 65536):
            output += chunk
    finally:
        sock.close()
        os.close(out_r)
    return events, output
