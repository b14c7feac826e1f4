"""Interpreters a step's multiprocessing starts (spawn, forkserver, resource tracker, Manager)
are forked by the zygote through the spawn proxy, and behave as ``multiprocessing`` expects."""
import os
import subprocess
import textwrap

import pytest

from conftest import PY, wait_gone
from preload_launcher.standin import installed


def standin_program(launcher):
    return installed(launcher.zygotes[0].socket_path)


def step(tmp_path, body: str) -> list[str]:
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(body))
    return [PY, str(script)]


def test_spawned_process_is_forked_by_the_zygote(torch_launcher, tmp_path):
    # main.py never imports torch: only a child forked from the zygote has it loaded.
    args = step(tmp_path, """
        import multiprocessing as mp, sys

        def child(q):
            q.put(("module_table" in repr(sys.meta_path), sys.executable, sys.argv[0]))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            print(q.get(timeout=60))
            p.join()
            print("exitcode", p.exitcode)
    """)
    result = torch_launcher.run(args, timeout=120)
    assert result.returncode == 0, result.stdout
    assert result.stdout == f"(True, {PY!r}, {args[1]!r})\nexitcode 0\n"
    assert subprocess.run(args, capture_output=True, text=True).stdout == \
        f"(False, {PY!r}, {args[1]!r})\nexitcode 0\n"  # the same, but importing for itself


def test_exit_codes_signals_and_tracebacks_reach_the_parent(light, tmp_path):
    args = step(tmp_path, """
        import multiprocessing as mp, os, sys, time

        def boom():
            raise ValueError("from the spawned child")

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            for target, args in ((sys.exit, (5,)), (boom, ())):
                p = ctx.Process(target=target, args=args)
                p.start(); p.join()
                print("exitcode", p.exitcode, flush=True)
            p = ctx.Process(target=time.sleep, args=(60,))
            p.start(); time.sleep(0.5); p.terminate(); p.join()
            print("terminated", p.exitcode, flush=True)
            p = ctx.Process(target=time.sleep, args=(60,))
            p.start(); time.sleep(0.5); p.kill(); p.join()
            print("killed", p.exitcode, flush=True)
            with ctx.Manager() as manager:
                shared = manager.dict(a=1)
                print("manager", dict(shared), flush=True)
    """)
    result = light.run(args, timeout=120)
    assert result.returncode == 0, result.stdout
    for line in ("exitcode 5", "exitcode 1", "terminated -15", "killed -9", "manager {'a': 1}"):
        assert line in result.stdout
    assert "ValueError: from the spawned child" in result.stdout


def test_killed_proxy_takes_its_child_along(light, tmp_path):
    pidfile = tmp_path / "child.pid"
    args = step(tmp_path, f"""
        import multiprocessing as mp, os, time

        def child():
            # Written whole before it appears: the parent reads it as soon as it exists.
            with open({str(pidfile)!r} + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename({str(pidfile)!r} + ".tmp", {str(pidfile)!r})
            time.sleep(60)

        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=child)
            p.start()
            while not os.path.exists({str(pidfile)!r}):
                time.sleep(0.01)
            p.kill()
            p.join()
            print("joined", p.exitcode)
    """)
    result = light.run(args, timeout=120)
    assert "joined -9" in result.stdout, result.stdout
    assert wait_gone(int(pidfile.read_text()))


@pytest.mark.parametrize("off", ["0", "false", "OFF"])
def test_switched_off_spawn_runs_the_real_interpreter(torch_launcher, tmp_path, off):
    args = step(tmp_path, """
        import multiprocessing as mp, sys

        def child(q):
            q.put("module_table" in repr(sys.meta_path))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start(); print("torch loaded:", q.get(timeout=60)); p.join()
    """)
    result = torch_launcher.run(args, env=dict(os.environ, PRELOAD_LAUNCHER_SPAWN=off), timeout=120)
    assert "torch loaded: False" in result.stdout, result.stdout


def test_proxy_hands_what_it_cannot_serve_to_python(light):
    light.run([PY, "-c", "pass"])
    proxy = standin_program(light)
    assert os.access(proxy, os.X_OK)
    # -O changes compilation: not served, so the proxy becomes the real interpreter.
    out = subprocess.run([proxy, "-O", "-c", "import sys; print(sys.flags.optimize, sys.executable)"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", PY]


def test_proxy_without_a_zygote_is_plain_python(tmp_path, light):
    light.run([PY, "-c", "pass"])
    proxy = standin_program(light)
    text = open(proxy).read().replace(light.zygotes[0].socket_path, str(tmp_path / "none.sock"))
    orphan = tmp_path / "proxy.python"
    orphan.write_text(text)
    orphan.chmod(0o700)
    out = subprocess.run([str(orphan), "-c", "import sys; sys.exit(4)"], timeout=60)
    assert out.returncode == 4


def test_proxy_file_goes_with_its_zygote(tmp_path):
    from preload_launcher import Launcher
    launcher = Launcher(["json"])
    launcher.run([PY, "-c", "pass"])
    proxy = standin_program(launcher)
    assert os.path.exists(proxy)
    launcher.close()
    assert not os.path.exists(os.path.dirname(proxy))


def test_forkserver_server_is_forked_by_the_zygote(torch_launcher, tmp_path):
    # The forkserver process is started like a spawned one; its children fork from it.
    args = step(tmp_path, """
        import multiprocessing as mp, sys

        def child(q):
            q.put("module_table" in repr(sys.meta_path))

        if __name__ == "__main__":
            ctx = mp.get_context("forkserver")
            q = ctx.Queue()
            procs = [ctx.Process(target=child, args=(q,)) for _ in range(2)]
            for p in procs:
                p.start()
            print("torch loaded:", [q.get(timeout=60) for _ in procs])
            for p in procs:
                p.join()
            print("exitcodes", [p.exitcode for p in procs])
    """)
    result = torch_launcher.run(args, timeout=120)
    assert result.returncode == 0, result.stdout
    assert result.stdout == "torch loaded: [True, True]\nexitcodes [0, 0]\n"
