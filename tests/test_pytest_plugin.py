"""The pytest plugin in real pytest sessions (pytester, each in its own process)."""
import os
import subprocess
import textwrap

import pytest

from preload_launcher import run_capturing

from conftest import PY, wait_gone

INNER_CONFTEST = """
import pytest
"""

VIA_TEST = """
import os, sys
import preload_launcher

def test_via(preload_launcher):
    r = preload_launcher.run([sys.executable, "-c", "import os; print(os.environ.get('LANE_MARK'))"],
                             env=dict(os.environ, LANE_MARK="passed-through"))
    print("VIA", r.via, r.stdout.strip())
    assert r.stdout.strip() == "passed-through"
    r2 = preload_launcher.run([sys.executable, "-c", "print(2)"])  # the module-level run()
    print("VIA2", r2.via)
"""


def runpytest(pytester, *args, env=None):
    pytester.makeini("[pytest]\npreload_launcher_modules = json\n")
    for k, v in (env or {}).items():
        pytester._monkeypatch.setenv(k, v)
    return pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", *args)


def test_default_lane_uses_the_zygote_and_prints_a_summary(pytester):
    pytester.makepyfile(test_via=VIA_TEST)
    result = runpytest(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*VIA zygote passed-through*", "*VIA2 zygote*",
                                 "*preload_launcher*",
                                 "*steps via zygote: 2 (* s in them), via subprocess: 0 (0.0 s)*",
                                 "*zygotes started: 1; steps waited * s in all for a zygote's preload*",
                                 "*preloaded json*"])
    # Only measured figures: no estimate of a saving.
    assert "saved" not in result.stdout.str() and "estimated" not in result.stdout.str()


@pytest.mark.parametrize("how", ["env", "option"])
def test_lane_toggle_off(pytester, how):
    pytester.makepyfile(test_via=VIA_TEST)
    if how == "env":
        result = runpytest(pytester, env={"PRELOAD_LAUNCHER": "0"})
    else:
        result = runpytest(pytester, "--no-preload-launcher")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*VIA subprocess passed-through*", "*VIA2 subprocess*"])


def test_env_wins_over_the_option(pytester):
    pytester.makepyfile(test_via=VIA_TEST)
    result = runpytest(pytester, "--no-preload-launcher", env={"PRELOAD_LAUNCHER": "1"})
    result.stdout.fnmatch_lines(["*VIA zygote*"])


def run_call(how: str, code: str) -> str:
    """Source of a ``preload_launcher.run(...)`` call running ``python -c code``: directly, or
    from a shell step (the interpreter's directory first on its PATH, so a stand-in serves it)."""
    if how == "direct":
        return f"preload_launcher.run([sys.executable, '-c', {code!r}])"
    return (f"preload_launcher.run(['bash', '-c', 'python -c \"$CODE\"'], env=dict(os.environ, "
            f"CODE={code!r}, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ['PATH']))")


@pytest.mark.parametrize("how", ["direct", "shell"])
@pytest.mark.parametrize("method", ["signal", "thread"])
def test_pytest_timeout_leaves_no_step_behind(pytester, tmp_path, method, how):
    pidfile = tmp_path / "step.pid"
    # The program notes its pid and whether it was forked from the zygote.
    call = run_call(how, f"import os, sys, time; open({str(pidfile)!r}, 'w').write("
                         "'%d %s' % (os.getpid(), 'module_table' in repr(sys.meta_path))); time.sleep(600)")
    pytester.makepyfile(test_hang=f"""
        import os, sys
        import preload_launcher

        def test_hangs(request):  # stand-ins ask only a zygote that serves: its preload first
            request.getfixturevalue("preload_launcher").zygote_for_standins(os.environ).wait_ready()
            {call}
    """)
    # The program would sleep far past the outer timeout: the test ends only if it is stopped.
    result = runpytest(pytester, "--timeout=5", f"--timeout-method={method}")
    assert result.ret != 0
    assert "Timeout" in result.stdout.str() + result.stderr.str()
    step_pid, preloaded = pidfile.read_text().split()
    assert preloaded == "True"  # forked from the zygote, directly or through a stand-in
    assert wait_gone(int(step_pid)), f"step {step_pid} outlived pytest-timeout ({method})"


@pytest.mark.parametrize("how", ["direct", "shell"])
def test_coverage_of_a_forked_step_is_measured(pytester, tmp_path, how):
    scripts = pytester.mkdir("scripts")
    (scripts / "covered.py").write_text(textwrap.dedent("""
        def branch(x):
            if x:
                return "yes"
            return "no"
        print(branch(True))
    """))
    (pytester.path / ".coveragerc").write_text("[run]\npatch = subprocess\nsource = scripts\n")
    pytester.makepyfile(test_cov="""
        import sys, os
        import preload_launcher

        def test_runs_script():
            r = preload_launcher.run([sys.executable, "scripts/covered.py"])
            assert (r.via, r.stdout) == ("zygote", "yes\\n"), r
    """ if how == "direct" else """
        import sys, os
        import preload_launcher

        def test_runs_script():  # python started by a shell step, through its stand-in
            r = preload_launcher.run(["bash", "-c", "python scripts/covered.py"], env=dict(
                os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]))
            assert (r.via, r.stdout) == ("subprocess", "yes\\n") and "forked" in r.reason, r
    """)
    result = runpytest(pytester, "--cov=scripts", "--cov-report=term-missing")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*scripts/covered.py*5*1*80%*5*"])


TRANSIENT_MARKERS = ("HTTPError 503", "Connection reset by peer")


def run_example_command(cmd_parts, example_path, env=None, max_retries=3):
    """A copy of the shape of the example tests' helper, with run_capturing swapped in."""
    for attempt in range(max_retries):
        returncode, output = run_capturing(cmd_parts, cwd=example_path,
                                           env=env or os.environ.copy())
        print(output)
        if returncode == 0:
            return output
        if attempt + 1 < max_retries and any(m in output for m in TRANSIENT_MARKERS):
            continue
        raise subprocess.CalledProcessError(returncode, cmd_parts, output)


def test_drop_in_helper_keeps_retries_env_and_errors(tmp_path):
    counter = tmp_path / "attempts"
    script = tmp_path / "flaky.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        path = {str(counter)!r}
        n = int(open(path).read()) if os.path.exists(path) else 0
        open(path, "w").write(str(n + 1))
        if n == 0:
            sys.exit("huggingface_hub HTTPError 503 Server Error")
        print("ok after", n, "retries", os.environ["HELPER_MARK"])
    """))
    out = run_example_command([PY, "flaky.py"], str(tmp_path),
                              env=dict(os.environ, HELPER_MARK="kept"))
    assert out == "ok after 1 retries kept\n"
    with pytest.raises(subprocess.CalledProcessError) as info:
        run_example_command([PY, "-c", "raise SystemExit('fatal')"], str(tmp_path))
    assert info.value.output == "fatal\n"


def test_the_summary_counts_interpreters_a_shell_step_started(pytester):
    pytester.makepyfile(test_shell="""
        import os, sys
        import preload_launcher

        def test_shell_step(request):
            env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
            # Stand-ins ask only a zygote that serves: its preload first.
            request.getfixturevalue("preload_launcher").zygote_for_standins(env).wait_ready()
            r = preload_launcher.run(["bash", "-c", "python -c 'print(1)'; python -c 'print(2)'"], env=env)
            assert (r.via, r.stdout) == ("subprocess", "1\\n2\\n"), r
    """)
    result = runpytest(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*steps via zygote: 0 (* s in them), via subprocess: 1 (* s)*",
                                 "*interpreters those subprocesses started, forked by the zygote: 2 "
                                 "(python/torchrun/accelerate stand-ins on the PATH of 1 step)*"])


def test_the_zygote_starts_before_the_suites_conftests_load(pytester):
    """Its preload overlaps the conftests' own imports (torch, transformers, ...) and the
    collection, instead of starting after them."""
    pytester.makeconftest("""
        from preload_launcher.caller import client
        launcher = client._session_launcher
        STARTED = launcher is not None and [z.process.poll() for z in launcher.zygotes] == [None]
    """)
    pytester.makepyfile(test_early="""
        import sys
        from conftest import STARTED

        def test_early(preload_launcher):
            print("STARTED", STARTED)
            assert preload_launcher.run([sys.executable, "-c", "pass"]).via == "zygote"
    """)
    result = runpytest(pytester)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*STARTED True*"])
    assert "zygotes started: 1" in result.stdout.str()


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_a_zygote_that_dies_mid_session_is_replaced_and_the_summary_says_so(pytester, workers):
    """The session goes on (its next step gets a new zygote) and the summary names what ended
    the old one and where its log is, instead of quietly running unserved. Under xdist it is
    the controller's zygote the workers share."""
    pytester.makepyfile(test_lost="""
        import os, signal, sys

        def test_kill_the_sessions_zygote(preload_launcher):
            assert preload_launcher.run([sys.executable, "-c", "pass"]).via == "zygote"
            zygote = preload_launcher.zygotes[0]
            os.kill(zygote.pid, signal.SIGKILL)
            if zygote.process is not None:
                zygote.process.wait()  # ours: gone before the next step asks for it
            else:  # the controller's: gone once it stops answering
                while zygote.alive():
                    pass
            again = preload_launcher.run([sys.executable, "-c", "print('again')"])
            assert (again.via, again.stdout) == ("zygote", "again\\n")
    """)
    result = runpytest(pytester, *workers)
    assert result.ret == 0, result.stdout.str()
    if workers:  # the worker's new zygote is its own; the controller reports its lost one
        result.stdout.fnmatch_lines(["*zygote * ended on its own (killed by SIGKILL); later steps "
                                     "went to a new one; its log: *.log"])
    else:
        result.stdout.fnmatch_lines(["*zygotes started: 2*", "*zygote * ended on its own (killed "
                                     "by SIGKILL); later steps went to a new one; its log: *.log"])
