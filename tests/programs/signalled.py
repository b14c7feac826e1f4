"""Starts a command as a caller would, sends it a signal once it is ready, and prints how it
ended as JSON: ``signalled.py WAY SIGNAL TARGET -- COMMAND…``.

WAY: ``plain``, or ``switch`` (this process's launches go through the suite switch, as in a
test of a ``PRELOAD_LAUNCHER=suite`` session, once its zygote serves). TARGET: ``pid``
(``kill``), ``group`` (``killpg``, as a terminal signals its foreground job; the command then
leads a group of its own, in this session), ``session`` (``killpg`` to a command started with
``start_new_session``: its group is orphaned, so the kernel discards a stop at its default).
SIGNAL ``none``: nothing sent. SIGNAL ``stop``: SIGTSTP to TARGET, then, once this process saw the command stop, SIGCONT;
recorded: the stop seen (None where the command ended without one) and whether the program
itself was stopped. The output's first line is ``ready PID``, or ``ready PID LEADS_SESSION``.
"""
import json
import os
import signal
import subprocess
import sys

way, sig, target = sys.argv[1:4]
command = sys.argv[5:]
if way == "switch":
    from preload_launcher import Launcher
    from preload_launcher.front import suite_wide
    launcher = Launcher(["json"])
    suite_wide.install(launcher)
    launcher.zygote_for_standins(dict(os.environ)).wait_ready()  # else the real program runs
# A shell without job control starts background commands with SIGINT and SIGQUIT ignored
# (`nohup pytest … &`), and an ignored signal stays ignored across exec: the caller a test
# stands for is a terminal's job, which has them at their defaults.
for default in (signal.SIGINT, signal.SIGQUIT):
    signal.signal(default, signal.SIG_DFL)
place = {"start_new_session": True} if target == "session" else {"preexec_fn": os.setpgrp}
proc = subprocess.Popen(command, stdout=subprocess.PIPE, **place)
ready = proc.stdout.readline().split()
program = int(ready[1])
send = os.kill if target == "pid" else os.killpg
seen = {"leads_session": ready[2] == b"True"} if len(ready) > 2 else {}
if sig == "stop":
    send(proc.pid, signal.SIGTSTP)
    stopped = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
    seen["stopped_by"] = stopped.si_status if stopped.si_code == os.CLD_STOPPED else None
    if seen["stopped_by"] is not None:
        with open(f"/proc/{program}/stat") as f:
            seen["program_state"] = f.read().rsplit(")", 1)[1].split()[0]
        os.waitid(os.P_PID, proc.pid, os.WSTOPPED)  # consumed, as a shell's wait would
        send(proc.pid, signal.SIGCONT)
elif sig != "none":
    send(proc.pid, int(sig))
seen["returncode"] = proc.wait(timeout=60)
seen["output"] = proc.stdout.read().decode()
if way == "switch":
    # Served, the program is not the process the stand-in started as (it becomes the real
    # program by execve, same pid).
    seen["forked"] = suite_wide.counts()["interpreters"] == 1 and program != proc.pid
    suite_wide.uninstall()
    launcher.close()
print(json.dumps(seen))
