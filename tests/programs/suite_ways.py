"""A suite whose tests start interpreters in every way a suite does (tests/test_suite_wide.py
runs it with the launcher off and suite-wide, and compares what each program saw)."""
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys

import pytest

PROBE = os.environ["SUITE_PROBE"]
RESULTS = os.environ["SUITE_RESULTS"]


def record(name, **seen):
    with open(os.path.join(RESULTS, name + ".json"), "w") as f:
        json.dump(seen, f, sort_keys=True)


def parse(out):
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="session", autouse=True)
def preloaded(preload_launcher):
    """A stand-in asks only a zygote that serves (one that still preloads: the real program
    runs); what is compared here is what forked programs see, so the preload is done first."""
    if os.environ.get("PRELOAD_LAUNCHER") != "0":
        preload_launcher.zygote_for_standins(dict(os.environ)).wait_ready()


def test_sys_executable():
    done = subprocess.run([sys.executable, PROBE, "3"], capture_output=True, text=True,
                          input="to stdin")
    record("sys_executable", code=done.returncode, seen=parse(done.stdout), err=done.stderr)


def test_name_on_path():
    elsewhere = os.path.dirname(RESULTS)  # the same folder in both runs
    done = subprocess.run(["python3", PROBE], capture_output=True, text=True, cwd=elsewhere,
                          env=dict(os.environ, SUITE_MARKER="given"))
    record("name_on_path", code=done.returncode, seen=parse(done.stdout), err=done.stderr)


def test_os_system(tmp_path):
    out = tmp_path / "out"
    status = os.system(f"python3 {PROBE} 5 > {out}")
    record("os_system", status=status, seen=parse(out.read_text()))


def test_shell_script(tmp_path):
    script = tmp_path / "step.sh"
    script.write_text(f"set -e\npython3 {PROBE} </dev/null\nexec python3 {PROBE} 7\n")
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    record("shell_script", code=done.returncode, seen=parse(done.stdout), err=done.stderr)


def test_popen_signal():
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); "
                             "time.sleep(60)"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    record("popen_signal", code=code, first=first, err=proc.stderr.read())


def test_timeout():
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        subprocess.run([sys.executable, "-c", "import time; print('up', flush=True); "
                        "time.sleep(60)"], capture_output=True, text=True, timeout=2)
    output = caught.value.output  # bytes: subprocess does not decode what a timeout cut short
    record("timeout", output=output.decode() if output is not None else None)


def test_asyncio():
    async def main():
        proc = await asyncio.create_subprocess_exec(sys.executable, PROBE, "9",
                                                    stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        return proc.returncode, out.decode()
    code, out = asyncio.run(main())
    record("asyncio", code=code, seen=parse(out))


def test_os_popen():
    with os.popen(f"python3 {PROBE}") as pipe:
        seen = parse(pipe.read())
    record("os_popen", seen=seen)


def _worker(queue):
    queue.put({"executable": sys.executable, "forked": "module_table" in repr(sys.meta_path),
               "main": sys.modules["__main__"].__name__})


def test_multiprocessing_spawn():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(queue,))
    proc.start()
    seen = queue.get(timeout=120)
    proc.join(timeout=120)
    record("multiprocessing_spawn", code=proc.exitcode, seen=[seen])


def test_switched_off_for_one_program():
    done = subprocess.run([sys.executable, PROBE], capture_output=True, text=True,
                          env=dict(os.environ, PRELOAD_LAUNCHER="0"))
    record("switched_off", code=done.returncode, seen=parse(done.stdout))


def test_venv():
    where = os.path.join(RESULTS, "venv")
    done = subprocess.run([sys.executable, "-m", "venv", "--without-pip", where],
                          capture_output=True, text=True)
    with open(os.path.join(where, "pyvenv.cfg")) as f:
        config = f.read().replace(where, "<venv>")
    record("venv", code=done.returncode, python=os.readlink(os.path.join(where, "bin", "python")),
           config=config)


def test_pip_writes_the_real_interpreter():
    """A console script pip installs names the interpreter pip ran in."""
    import zipfile
    wheel = os.path.join(RESULTS, "tool-1.0-py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tool.py", "def main():\n    print('tool')\n")
        z.writestr("tool-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tool\nVersion: 1.0\n")
        z.writestr("tool-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                   "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("tool-1.0.dist-info/entry_points.txt", "[console_scripts]\ntool = tool:main\n")
        z.writestr("tool-1.0.dist-info/RECORD", "")
    target = os.path.join(RESULTS, "site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--disable-pip-version-check", "--target", target, wheel],
                          capture_output=True, text=True)
    with open(os.path.join(target, "bin", "tool")) as f:
        record("pip", code=done.returncode, shebang=f.readline())


def test_another_interpreter():
    other = os.environ.get("SUITE_OTHER_PYTHON")
    if not other:
        pytest.skip("no other interpreter")
    done = subprocess.run([other, "-c", "import json, os, sys; print(json.dumps("
                           "[os.environ.get('PATH'), sorted(k for k in os.environ "
                           "if 'PRELOAD' in k)]))"], capture_output=True, text=True)
    record("another_interpreter", code=done.returncode, out=done.stdout)


def test_unserved_option():
    """An option the zygote does not model: the real interpreter, and the summary says why."""
    done = subprocess.run([sys.executable, "-E", PROBE], capture_output=True, text=True)
    record("unserved_option", code=done.returncode, seen=parse(done.stdout))
