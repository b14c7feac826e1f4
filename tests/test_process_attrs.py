"""The process attributes a step inherits from its caller, side by side with ``subprocess``: a
caller changes one after its zygote started (so that the zygote holds another value), then runs
the same program plainly and through the launcher. A forked step takes the caller's value on;
one a forked process cannot take runs the step as a plain subprocess, with the reason."""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import PY, caller_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31)}.get(os.uname().machine)
IOPRIO_CLASS_IDLE = 3 << 13
PR_CAPBSET_DROP, CAP_SYS_NICE, CAP_SYS_RESOURCE = 24, 23, 24
ADDR_NO_RANDOMIZE = 0x0040000



def both_ways(code, change, before="", modules="json", path=()):
    """(plain output, the launcher's output, its ``via …`` line) for a caller that does
    ``before``, starts its zygote, does ``change`` and runs ``python -c code``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, *map(str, path)]), PRELOAD_LAUNCHER_PREWARM="0")
    outs = [caller_runs(how, code, change, env, before, modules)
            for how in ("plain", "launcher")]
    ref, got = outs
    *lines, via = got.splitlines()
    return ref, "".join(line + "\n" for line in lines), via


def skip_unless_allowed(code, why):
    """Skip where this machine refuses ``code`` to an ordinary process (a container's seccomp
    profile, no privilege): tried in a throwaway one."""
    probe = subprocess.run([PY, "-c", "import ctypes, os, resource\n"
                            "libc = ctypes.CDLL(None, use_errno=True)\n" + code],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode:
        pytest.skip(f"{why} ({(probe.stderr.strip().splitlines() or ['?'])[-1]})")


def drop_from_bounding_set(cap):
    """Code for ``before``: a zygote started after it lacks ``cap`` (a root caller keeps it)."""
    return (f"if os.geteuid() == 0 and libc.prctl({PR_CAPBSET_DROP}, {cap}, 0, 0, 0):\n"
            f"    raise OSError(ctypes.get_errno(), 'PR_CAPBSET_DROP')\n")


# ---------------------------------------------------------------- memory limits

HOLDS_MEMORY = ("import mmap\n"
                "# 512 MiB of private address space, never touched (it takes no memory)\n"
                "HELD = mmap.mmap(-1, 512 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n")
ALLOCATES = "x = bytearray(50 << 20); print(len(x))"


def lower_limit(name, size):
    return (f"resource.setrlimit(resource.{name}, "
            f"({size}, resource.getrlimit(resource.{name})[1]))")


@pytest.mark.parametrize("limit", ["RLIMIT_AS", "RLIMIT_DATA"])
def test_a_memory_limit_below_what_the_zygote_maps_runs_the_step_plainly(tmp_path, limit):
    """A caller that limits its address space (data) below what the zygote already maps: a
    fresh interpreter starts far below the limit and allocates; a forked one would start above
    it and fail (in the launcher's own code, or at the program's first allocation)."""
    (tmp_path / "holds_memory.py").write_text(HOLDS_MEMORY)
    ref, got, via = both_ways(ALLOCATES, lower_limit(limit, 256 << 20), modules="holds_memory",
                              path=[tmp_path])
    assert ref == "52428800\n"
    assert got == ref and via.startswith("via subprocess") and limit in via, (got, via)


def test_a_memory_limit_with_room_above_what_the_zygote_maps_keeps_the_step_forked(tmp_path):
    (tmp_path / "holds_memory.py").write_text(HOLDS_MEMORY)
    ref, got, via = both_ways(ALLOCATES, lower_limit("RLIMIT_AS", 4 << 30),
                              modules="holds_memory", path=[tmp_path])
    assert got == ref == "52428800\n" and via.startswith("via zygote"), via


# ---------------------------------------------------------------- OOM score adjustment

READ_OOM_SCORE_ADJ = "print(open('/proc/self/oom_score_adj').read().strip())"


def set_oom_score_adj(value):
    return (f"with open('/proc/self/oom_score_adj', 'w') as f:\n    f.write('{value}')\n"
            f"assert open('/proc/self/oom_score_adj').read() == '{value}\\n'\n")


def test_the_callers_oom_score_adj_is_the_steps():
    """Raising it needs no privilege: the caller marks what it runs as the OOM killer's first
    choice (500), a forked step too."""
    skip_unless_allowed(set_oom_score_adj(500), "cannot raise oom_score_adj here")
    ref, got, via = both_ways(READ_OOM_SCORE_ADJ, set_oom_score_adj(500))
    assert got == ref == "500\n" and via.startswith("via zygote"), (got, via)


def test_an_oom_score_adj_the_zygote_may_not_lower_to_runs_the_step_plainly():
    """Lowering it below the floor the zygote inherited needs CAP_SYS_RESOURCE, which the
    zygote lacks here (a daemon started by another process, another service)."""
    before = drop_from_bounding_set(CAP_SYS_RESOURCE)
    skip_unless_allowed(before + set_oom_score_adj(-100),
                        "needs CAP_SYS_RESOURCE, to lower oom_score_adj in the caller")
    ref, got, via = both_ways(READ_OOM_SCORE_ADJ, set_oom_score_adj(-100), before=before)
    assert ref == "-100\n"
    assert got == ref and via.startswith("via subprocess") and "oom_score_adj" in via, (got, via)


def test_an_oom_score_adj_a_process_may_not_lower_to_is_unforkable():
    """The refusal above, asked of a throwaway process directly (where no privilege is at hand
    to set up the caller): -1000, the lowest, needs CAP_SYS_RESOURCE or a floor that low."""
    code = textwrap.dedent("""\
        from preload_launcher import process_attrs
        try:
            process_attrs.apply(dict(process_attrs.capture(), oom_score_adj=-1000))
            print("took", open("/proc/self/oom_score_adj").read().strip())
        except process_attrs.Unforkable as why:
            print(why)
        """)
    out = subprocess.run([PY, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), timeout=60,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if out.stdout == "took -1000\n":
        pytest.skip("this process may lower oom_score_adj to -1000 (CAP_SYS_RESOURCE)")
    assert "may not take its caller's oom_score_adj (-1000)" in out.stdout, out.stdout


# ---------------------------------------------------------------- scheduling

READ_POLICY = "import os; print(os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)"


@pytest.mark.parametrize("policy", ["SCHED_BATCH", "SCHED_IDLE"])
def test_the_callers_scheduling_policy_is_the_steps(policy):
    change = f"os.sched_setscheduler(0, os.{policy}, os.sched_param(0))"
    skip_unless_allowed(change, f"{policy} refused here")
    ref, got, via = both_ways(READ_POLICY, change)
    assert ref == f"{getattr(os, policy)} 0\n"
    assert got == ref and via.startswith("via zygote"), (got, via)


def test_a_policy_the_zygote_may_not_leave_runs_the_step_plainly():
    """A zygote in SCHED_IDLE (a daemon started under ``chrt --idle``): leaving it needs
    CAP_SYS_NICE or an RLIMIT_NICE this caller has not got, so a forked step would stay idle
    where the caller's fresh child is SCHED_OTHER."""
    before = (drop_from_bounding_set(CAP_SYS_NICE)
              + "resource.setrlimit(resource.RLIMIT_NICE, (0, 0))\n")
    change = ("if how == 'launcher':  # the zygote, ready: idle from here on\n"
              "    zygote = launcher.zygotes[0].pid\n"
              "    os.sched_setscheduler(zygote, os.SCHED_IDLE, os.sched_param(0))\n")
    skip_unless_allowed(before + "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))",
                        "SCHED_IDLE refused here")
    ref, got, via = both_ways(READ_POLICY, change, before=before)
    assert ref == f"{os.SCHED_OTHER} 0\n"
    assert got == ref and via.startswith("via subprocess") and "scheduling" in via, (got, via)


# ---------------------------------------------------------------- nice value, resource limits

READ_NICE = "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"
READ_NOFILE = "import resource; print(*resource.getrlimit(resource.RLIMIT_NOFILE))"


def test_a_nice_value_the_zygote_may_not_lower_to_runs_the_step_plainly():
    """A zygote niced after it started (a daemon under ``renice``): going back to the caller's
    value needs CAP_SYS_NICE or an RLIMIT_NICE it has not got. A forked step kept the zygote's
    nice value, silently, where the caller's fresh child has the caller's."""
    before = (drop_from_bounding_set(CAP_SYS_NICE)
              + "resource.setrlimit(resource.RLIMIT_NICE, (0, 0))\n")
    change = ("if how == 'launcher':  # the zygote, ready: niced from here on\n"
              "    os.setpriority(os.PRIO_PROCESS, launcher.zygotes[0].pid,\n"
              "                   os.getpriority(os.PRIO_PROCESS, 0) + 5)\n")
    skip_unless_allowed(before, "cannot drop CAP_SYS_NICE here")
    ref, got, via = both_ways(READ_NICE, change, before=before)
    assert ref == f"{os.getpriority(os.PRIO_PROCESS, 0)}\n"
    assert got == ref and via.startswith("via subprocess") and "nice value" in via, (got, via)


def test_a_hard_limit_above_the_zygotes_runs_the_step_plainly():
    """A zygote whose hard limit on open files was lowered after it started (``prlimit`` on a
    daemon): raising it needs CAP_SYS_RESOURCE, so a forked step kept the zygote's limits,
    silently, where the caller's fresh child has the caller's."""
    import resource
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] <= 256:
        pytest.skip("this process's hard limit on open files is 256 or less already")
    before = drop_from_bounding_set(CAP_SYS_RESOURCE)
    change = ("if how == 'launcher':\n"
              "    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
              "    resource.prlimit(launcher.zygotes[0].pid, resource.RLIMIT_NOFILE,\n"
              "                     (min(soft, 256), 256))\n")
    skip_unless_allowed(before, "cannot drop CAP_SYS_RESOURCE here")
    ref, got, via = both_ways(READ_NOFILE, change, before=before)
    assert ref == "%d %d\n" % resource.getrlimit(resource.RLIMIT_NOFILE)
    assert got == ref and via.startswith("via subprocess") and "RLIMIT_NOFILE" in via, (got, via)


def test_a_hard_limit_the_caller_lowered_is_the_steps():
    """Lowering a hard limit needs no privilege: a forked step takes the caller's."""
    change = ("soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 200), 200))\n")
    ref, got, via = both_ways(READ_NOFILE, change)
    assert ref == "200 200\n"
    assert got == ref and via.startswith("via zygote"), (got, via)


# ---------------------------------------------------------------- I/O priority, timer slack

def test_the_callers_io_priority_is_the_steps():
    if IOPRIO_SYSCALLS is None:
        pytest.skip(f"no ioprio syscall numbers known for {os.uname().machine}")
    change = f"assert libc.syscall({IOPRIO_SYSCALLS[0]}, 1, 0, {IOPRIO_CLASS_IDLE}) == 0"
    skip_unless_allowed(change, "ioprio_set refused here")
    read = f"import ctypes; print(ctypes.CDLL(None).syscall({IOPRIO_SYSCALLS[1]}, 1, 0))"
    ref, got, via = both_ways(read, change)
    assert got == ref == f"{IOPRIO_CLASS_IDLE}\n" and via.startswith("via zygote"), (got, via)


def test_the_callers_timer_slack_is_the_steps():
    change = "assert libc.prctl(29, ctypes.c_ulong(1000000), 0, 0, 0) == 0"  # PR_SET_TIMERSLACK
    read = "import ctypes; print(ctypes.CDLL(None).prctl(30, 0, 0, 0, 0))"  # PR_GET_TIMERSLACK
    ref, got, via = both_ways(read, change)
    assert got == ref == "1000000\n" and via.startswith("via zygote"), (got, via)


# ---------------------------------------------------------------- personality

def test_a_callers_personality_runs_the_step_plainly():
    """``setarch -R`` (no address-space randomisation) takes effect as a program starts: a
    fresh child of the caller has it, a forked process cannot take it on."""
    change = f"assert libc.personality({ADDR_NO_RANDOMIZE}) != -1"
    skip_unless_allowed(change + f"\nassert libc.personality(0xffffffff) == {ADDR_NO_RANDOMIZE}",
                        "personality(ADDR_NO_RANDOMIZE) refused here")
    read = "import ctypes; print(hex(ctypes.CDLL(None).personality(0xffffffff)))"
    ref, got, via = both_ways(read, change)
    assert ref == f"{ADDR_NO_RANDOMIZE:#x}\n"
    assert got == ref and via.startswith("via subprocess") and "personality" in via, (got, via)
