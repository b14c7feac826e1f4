"""Thread pools and fork: none is live in the zygote, and each step gets a fresh process's counts.

``fork()`` copies one thread. A worker team that a preloaded import started (GNU OpenMP's, the
one torch's CPU ops use) is gone in the child while its bookkeeping says it exists: the child
hangs in its first parallel op. So while the zygote preloads, torch's intra-op pool is held at
one thread (``torch.set_num_threads``, the library's own control; ``threadpoolctl`` does the
same for other OpenMP/BLAS libraries when it is installed): an op a module runs at import runs
on the main thread, and no team exists at fork time. Torch's inter-op pool is never touched,
so a step may still size it.

OpenBLAS (its pthreads build: numpy's and scipy's wheels) starts its workers when it loads,
sized by ``OPENBLAS_NUM_THREADS`` (else the CPU count), and parks them at fork. A child that then
resizes its pool first restarts it at that load-time size (``goto_set_num_threads``' lazy
re-init after a fork), so a step given one thread would keep a worker per CPU of the zygote's,
idle, that a fresh process never starts (15 a rank on a 16-CPU machine, counted against the
job's thread and pid limits). So the zygote's imports see ``OPENBLAS_NUM_THREADS=1`` in the C
environment, which OpenBLAS reads and ``os.environ`` does not mirror (python code sees the
environment as it is): OpenBLAS loads with no worker, and a step sized to N starts N-1, as a
fresh load does. What a fresh load would choose is then asked of a fresh interpreter.

A step then gets the counts a fresh interpreter reports under the step's own thread variables
(``settings.THREAD_ENV``; torchrun sets ``OMP_NUM_THREADS=1`` for several ranks): torch's
intra- and inter-op counts, and the pool of every OpenMP/BLAS library loaded here (numpy's
OpenBLAS sizes its pool from ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS`` when it loads, in the
zygote), each set through threadpoolctl's controller of that library. The zygote starts without
those variables, so what it holds is a fresh process's default, and for any other combination
it asks a fresh interpreter once, which loads the same libraries (cached per package set on
disk, and in the zygote).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
from typing import Iterator, Mapping, Optional

from ..files import read_json, save_json
from ..settings import THREAD_ENV

__all__ = ["THREAD_ENV", "pin_for_preload", "preload_limits", "pool_libraries", "FreshCounts",
           "apply_fresh_counts", "take_counts", "describe"]

# A fresh interpreter's counts: torch's, then each library's pool (argv: the libraries' paths).
PROBE = """import ctypes, json, sys
torch = __import__("torch") if sys.argv[1] == "torch" else None
for path in sys.argv[2:]:
    ctypes.CDLL(path)
try:
    import threadpoolctl
    pools = {i["filepath"]: i["num_threads"] for i in threadpoolctl.threadpool_info()}
except ImportError:
    pools = {}
counts = [torch.get_num_threads(), torch.get_num_interop_threads()] if torch else [None, None]
print(json.dumps([*counts, pools]))
"""

_defaults: Optional[list[int]] = None  # (intra, inter) of a fresh process, once torch is here
_pools: dict = {}  # path: threadpoolctl's controller of each OpenMP/BLAS library loaded here
# In a step: what each package's pools are to be sized to, until the step takes the package.
_due: dict[Optional[str], list] = {}


def pin_for_preload() -> Optional[list[int]]:
    """Once torch is imported: remember its fresh counts, then hold intra-op at one thread."""
    global _defaults
    torch = sys.modules.get("torch")
    if _defaults is None and torch is not None and hasattr(torch, "set_num_threads"):
        _defaults = [torch.get_num_threads(), torch.get_num_interop_threads()]
        torch.set_num_threads(1)
    return _defaults


@contextlib.contextmanager
def _threadpoolctl() -> Iterator:
    """threadpoolctl (or None), imported without a trace: its import sets
    ``KMP_DUPLICATE_LIB_OK`` and registers the module. Both are undone at once, before the
    preload's imports run, so that they see the environment a fresh interpreter has, and a
    preloaded module that imports threadpoolctl runs that import (and sets the variable)
    itself, as it would in a fresh interpreter."""
    before = os.environ.get("KMP_DUPLICATE_LIB_OK")
    imported_already = "threadpoolctl" in sys.modules
    try:
        import threadpoolctl
    except ImportError:
        threadpoolctl = None
    finally:
        if not imported_already:
            sys.modules.pop("threadpoolctl", None)
            if before is None:
                os.environ.pop("KMP_DUPLICATE_LIB_OK", None)
    yield threadpoolctl


@contextlib.contextmanager
def _c_environment(name: str, value: str) -> Iterator[None]:
    """``name=value`` for native code's ``getenv`` (not in ``os.environ``), then as it was."""
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    before = libc.getenv(name.encode())
    libc.setenv(name.encode(), value.encode(), 1)
    try:
        yield
    finally:
        if before is None:
            libc.unsetenv(name.encode())
        else:
            libc.setenv(name.encode(), before, 1)


@contextlib.contextmanager
def preload_limits() -> Iterator[None]:
    """One thread for every OpenMP/BLAS library threadpoolctl finds, and for OpenBLAS loaded
    meanwhile, while the zygote imports."""
    with _threadpoolctl() as threadpoolctl, _c_environment("OPENBLAS_NUM_THREADS", "1"):
        if threadpoolctl is None:
            yield
            return
        with threadpoolctl.threadpool_limits(limits=1):
            yield


def key_of(env: Mapping[str, str], cpus: Optional[list[int]] = None) -> str:
    """A thread environment, and the CPU set when it is not the zygote's (torch sizes its
    pools by the CPUs it may run on)."""
    return json.dumps([env.get(k) for k in THREAD_ENV] + ([sorted(cpus)] if cpus else []))


def pool_libraries() -> dict[str, int]:
    """The OpenMP/BLAS libraries loaded here and their pools' sizes now; their controllers are
    kept for the steps (``apply_fresh_counts``)."""
    global _pools
    with _threadpoolctl() as threadpoolctl:
        if threadpoolctl is None:
            return {}
        _pools = {lib.filepath: lib for lib in threadpoolctl.ThreadpoolController().lib_controllers}
    return {path: lib.get_num_threads() for path, lib in _pools.items()}


class FreshCounts:
    """What a fresh interpreter's torch and thread-pool libraries report, by thread
    environment: ``[intra, inter, {library path: pool size}]`` (``None, None`` where the zygote
    has no torch, whose ``pin_for_preload`` gives ``defaults``)."""

    def __init__(self, cache_path: str, defaults: Optional[list[int]]) -> None:
        self.path = cache_path
        self.torch = defaults is not None
        self.defaults = list(defaults) if defaults else [None, None]
        self.known = dict(read_json(cache_path) or {})
        self.probes: dict[str, subprocess.Popen] = {}
        self.modules_seen = -1
        self.libraries: list[str] = []
        self.refresh()

    def refresh(self) -> None:
        """Libraries loaded since (learned modules), and what a fresh process without thread
        variables gives them: torch's counts are the zygote's own from before it pinned them;
        the pools' sizes come from a fresh interpreter that loads just those libraries (a
        tenth of a second: the zygote's OpenBLAS loaded at one thread, its OpenMP is pinned)."""
        if len(sys.modules) != self.modules_seen:
            self.modules_seen = len(sys.modules)
            self.libraries = sorted(pool_libraries())
            counts = self.known.get(key_of({}))
            if counts is None or not set(self.libraries) <= set(counts[2]):
                pools = {}
                if self.libraries:
                    probe = _start_probe(_without_thread_env(os.environ), None, False,
                                         self.libraries)
                    pools = (_answer(probe) or [None, None, {}])[2]  # none: left as they are
                self.known[key_of({})] = [*self.defaults, pools]

    def _complete(self, key: str) -> bool:
        counts = self.known.get(key)
        return (counts is not None and len(counts) == 3 and (counts[0] is not None or not self.torch)
                and set(self.libraries) <= set(counts[2]))

    def ask_ahead(self, env: Mapping[str, str], cpus: Optional[list[int]] = None) -> None:
        """Start asking a fresh interpreter now (in the background), unless known already."""
        key = key_of(env, cpus)
        if (self.torch or self.libraries) and not self._complete(key) and key not in self.probes:
            probe_env = {**_without_thread_env(os.environ),
                         **{k: env[k] for k in THREAD_ENV if k in env}}
            self.probes[key] = _start_probe(probe_env, cpus, self.torch, self.libraries)

    def for_env(self, env: Mapping[str, str], cpus: Optional[list[int]] = None) -> Optional[list]:
        """The counts for ``env``; None where the probe gave no answer (nothing is kept: the
        step asks a fresh interpreter itself, ``_counts_here``)."""
        key = key_of(env, cpus)
        if not self.torch and not self.libraries:
            return [None, None, {}]  # nothing here sizes a pool from the environment
        if not self._complete(key):
            self.ask_ahead(env, cpus)
            counts = _answer(self.probes.pop(key))
            if counts is None:
                return None
            self.known[key] = counts
            save_json(self.path, {k: v for k, v in self.known.items() if k != key_of({})})
        return self.known[key]

    def table_for(self, env: Mapping[str, str], multi_rank: bool,
                  cpus: Optional[list[int]] = None) -> dict[str, list]:
        """What a step with ``env`` needs: its own counts and, for a torchrun step, those of
        ranks given ``OMP_NUM_THREADS=1`` (torchrun's default for several ranks)."""
        self.refresh()
        envs = [env] + ([{**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}]
                        if multi_rank else [])
        counts = {key_of(e, cpus): self.for_env(e, cpus) for e in envs}
        return {key: value for key, value in counts.items() if value is not None}


def _without_thread_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in THREAD_ENV}


def _start_probe(env: Mapping[str, str], cpus: Optional[list[int]], torch: bool,
                 libraries: list[str]) -> subprocess.Popen:
    """A fresh interpreter that reports its counts under ``env`` (on ``cpus``, where given)."""
    pin = f"import os; os.sched_setaffinity(0, {sorted(cpus)})\n" if cpus else ""
    return subprocess.Popen([sys.executable, "-c", pin + PROBE, "torch" if torch else "-",
                             *libraries], env=dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _counts_here(table: dict[str, list], cpus: Optional[list[int]]) -> Optional[list]:
    """The counts for this process's thread variables and CPU set: the table's entry, or, for a
    combination the zygote could not foresee (a launcher in the step chose the variables:
    accelerate's ``--num_cpu_threads_per_process``; a launcher's program on the caller's CPU
    set), a fresh interpreter's answer now, asked from here (it inherits this CPU set)."""
    here = sorted(os.sched_getaffinity(0))
    for key in (key_of(os.environ, cpus), key_of(os.environ, here)):
        if key in table:
            return table[key]
    torch = "torch" in sys.modules
    if not torch and not _pools:
        return None
    # no answer (this interpreter cannot import torch: neither could the program): the
    # program's own start then fails or decides as it would have
    return _answer(_start_probe(os.environ, None, torch, sorted(_pools)))


def _answer(probe: subprocess.Popen) -> Optional[list]:
    """A probe's counts; None (the probe ended) where it gives none within two minutes."""
    try:
        out, _ = probe.communicate(timeout=120)
        return json.loads(out.splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, ValueError):
        probe.kill()
        probe.wait()
        return None


def apply_fresh_counts(table: dict[str, list], cpus: Optional[list[int]] = None,
                       pools_too: bool = True) -> None:
    """In a forked step or rank: the thread pools as a fresh interpreter would have them
    (``cpus``: the caller's CPU set, where it is not the zygote's), each set when the step
    takes the package the pool belongs to (``take_counts``). ``pools_too=False``: a
    launcher that forks its programs (torchrun's agent, accelerate) leaves the pools to them:
    OpenBLAS's workers, once started here, would set how many each restarts (see the top of
    the module)."""
    counts = _counts_here(table, cpus)
    if counts is None:
        return
    intra, inter, pools = counts
    _due.clear()
    for path, size in pools.items() if pools_too else ():
        lib = _pools.get(path)
        if lib is not None and lib.get_num_threads() != size:
            _due.setdefault(_package_of(path), []).append((lib, size))
    if "torch" in sys.modules and intra is not None:
        _due.setdefault("torch", []).append(("torch", (intra, inter)))
    take_counts({None})  # a library outside any package (the system's): now


def take_counts(names) -> None:
    """The counts of the pools of the packages among ``names`` (modules the step takes, as
    ``module_table`` hands them back), set now: sizing a pool starts its worker threads, which
    a fresh process that never imports the package does not have (and python 3.12 warns at a
    fork with threads). Torch's intra-op count goes last: it sizes torch's own OpenMP pool as
    torch decides."""
    taking = sorted((top for top in _due if top in names), key=lambda top: top == "torch")
    for top in taking:
        for lib, size in _due.pop(top):
            if lib == "torch":
                torch = sys.modules["torch"]
                torch.set_num_threads(size[0])
                if torch.get_num_interop_threads() != size[1]:
                    torch.set_num_interop_threads(size[1])
            else:
                lib.set_num_threads(size)


def _package_of(path: str) -> Optional[str]:
    """The top-level package whose wheel holds a library (``torch/lib/libgomp.so.1``: torch;
    ``numpy.libs/libopenblas….so``: numpy); None for one outside ``sys.path`` (the system's)."""
    folders = [os.path.join(os.path.realpath(entry), "") for entry in sys.path if entry]
    holding = [folder for folder in folders if path.startswith(folder)]
    if not holding:
        return None
    folder = max(holding, key=len)  # site-packages, not the standard library's folder above it
    first = path[len(folder):].split(os.sep)[0]
    return first[:-len(".libs")] if first.endswith(".libs") else first


def describe(threads: dict[str, int]) -> list[dict]:
    """What each native thread of the zygote is, and why a fork is safe with it."""
    with _threadpoolctl() as threadpoolctl:
        pools = threadpoolctl.threadpool_info() if threadpoolctl else []
    rows = []
    left = dict(threads)
    main = os.path.basename(sys.executable)[:15]
    left[main] = left.get(main, 0) - 1
    rows.append({"what": "the zygote's main thread", "count": 1, "fork_safe": "the one a fork copies"})
    for pool in pools:
        if pool["internal_api"] == "openblas" and pool["num_threads"] > 1:
            n = min(pool["num_threads"] - 1, left.get(main, 0))
            if n > 0:
                left[main] -= n
                rows.append({"what": f"OpenBLAS workers ({os.path.basename(pool['filepath'])})",
                             "count": n, "fork_safe": "yes: OpenBLAS's atfork handlers park "
                             "them and a child starts its own"})
    for name, count in sorted(left.items()):
        if count <= 0:
            continue
        if name.startswith("jemalloc"):
            what, safe = "jemalloc's background purge thread", "yes: jemalloc's atfork handlers"
        elif name.startswith("cuda"):
            what, safe = ("an NVIDIA driver/NVML helper thread",
                          "yes while the driver probe says uninitialised: it holds no context, "
                          "and a child does not inherit threads")
        else:
            what, safe = (f"threads named {name!r}, not a pool this launcher knows",
                          "a child does not inherit them; the risk is a lock one holds at "
                          "fork time")
        rows.append({"what": what, "count": count, "fork_safe": safe})
    return rows
