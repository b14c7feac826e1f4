"""The suite's own directories: its runtime directory (sockets, logs), its cache (verdicts,
learned profiles) and the temporary directory of every program it starts, under one root that
goes with the session.

pytest loads this module with ``-p suite_dirs`` (pyproject's ``addopts``), before any plugin
starts: the preload_launcher plugin starts the session's zygote before the conftests load, and
that zygote must already see these directories, never the user's cache or a daemon of the
user's. The root sits in ``/tmp`` whatever ``TMPDIR`` or the user's name is, so that every
socket the suite makes fits a Unix socket's 107 bytes (``short_dir`` makes more such places).
An xdist worker, which inherits the variables, uses its controller's root.
"""
import os
import pathlib
import shutil
import tempfile

import pytest

__all__ = ["ROOT", "TMP", "OWNER", "short_dir", "leftovers", "remove"]

ROOT_ENV = "PL_TESTS_ROOT"
# pytest's tmp_path folders stay in the user's temporary directory (pytest keeps the last
# few and prunes them): this process's tempfile reads TMPDIR now, before it changes below.
tempfile.gettempdir()

OWNER = not os.path.isdir(os.environ.get(ROOT_ENV, ""))
if OWNER:
    _base = "/tmp" if os.access("/tmp", os.W_OK | os.X_OK) else tempfile.gettempdir()
    os.environ[ROOT_ENV] = tempfile.mkdtemp(prefix="pl-tests-", dir=_base)
    # Other users may pass through (never list): tests that play another uid connect to a
    # socket in a short_dir.
    os.chmod(os.environ[ROOT_ENV], 0o711)
    for name, mode in (("run", 0o700), ("cache", 0o700), ("tmp", 0o700), ("s", 0o711)):
        os.mkdir(os.path.join(os.environ[ROOT_ENV], name), mode)
ROOT = os.environ[ROOT_ENV]
TMP = os.path.join(ROOT, "tmp")
os.environ["XDG_RUNTIME_DIR"] = os.path.join(ROOT, "run")
os.environ["PRELOAD_LAUNCHER_CACHE_DIR"] = os.path.join(ROOT, "cache")
# The programs the tests start keep their temporary files here too (the real torchrun leaves
# a torchelastic_* folder per launch); ``leftovers`` looks at nothing else.
os.environ["TMPDIR"] = TMP


def short_dir() -> pathlib.Path:
    """A new private directory (mode 0700) with a short path, for an ``XDG_RUNTIME_DIR`` of a
    test's own: a socket's path under ``tmp_path`` grows with TMPDIR, the user's name and the
    test's name, and a Unix socket takes 107 bytes at most."""
    return pathlib.Path(tempfile.mkdtemp(prefix="", dir=os.path.join(ROOT, "s")))


# What programs keep there by design: the real torchrun's log folders (the launcher's torchrun
# removes its own: tests/test_torchrun_fidelity.py), torch's compile cache (megatron.core
# compiles at import) and the tmp_path folders of the pytest sessions tests start (pytest keeps
# the last few).
KEPT_BY_DESIGN = ("torchelastic_", "torchinductor_", "pytest-of-")


def leftovers() -> list[str]:
    """What the programs the suite started left in their temporary directory."""
    return sorted(name for name in os.listdir(TMP) if not name.startswith(KEPT_BY_DESIGN))


def remove() -> None:
    if OWNER:
        shutil.rmtree(ROOT, ignore_errors=True)


@pytest.hookimpl(trylast=True)  # after the plugin has ended the session's zygote (it may still
def pytest_unconfigure(config):  # be preloading, and would write its cache here afterwards)
    """The session that made the root removes it: the suite's, and any other session the ini
    loads this plugin in (the demo's example suite)."""
    remove()
