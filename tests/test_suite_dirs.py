"""The suite keeps to its own directories: the zygote the plugin starts for the session (before
any conftest loads) sees the suite's runtime directory and cache, never the user's."""
import os

import suite_dirs


def test_the_sessions_zygote_uses_the_suites_directories(preload_launcher):
    zygote = preload_launcher.zygotes[0]
    with open(f"/proc/{zygote.process.pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    root = suite_dirs.ROOT.encode()
    assert env[b"XDG_RUNTIME_DIR"] == root + b"/run"
    assert env[b"PRELOAD_LAUNCHER_CACHE_DIR"] == root + b"/cache"
    assert zygote.socket_path.startswith(os.path.join(suite_dirs.ROOT, "run", ""))


def test_a_short_dir_holds_the_longest_socket_path_whatever_tmpdir_is():
    from preload_launcher.rundir import LONGEST_SOCKET_NAME, MAX_SOCKET_PATH
    runtime = os.path.join(suite_dirs.short_dir(), f"preload_launcher-{2**32 - 1}")
    assert len(os.fsencode(runtime)) + 1 + LONGEST_SOCKET_NAME <= MAX_SOCKET_PATH
