"""A training step whose signal handler saves a checkpoint: every signal a program may catch
(job control and faults aside) writes which one arrived to argv[1], a while later (a save takes
time: a second signal or a kill meanwhile would cut it off), and exits 3."""
import os
import signal
import sys
import time

UNHANDLED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGCONT, signal.SIGTSTP,
             signal.SIGTTIN, signal.SIGTTOU, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE,
             signal.SIGILL, signal.SIGTRAP, signal.SIGSYS}


def save(signum, _frame):
    time.sleep(0.5)
    with open(sys.argv[1], "a") as f:
        f.write(f"saved on {signum}\n")
    sys.exit(3)


if sys.argv[2:] != ["default"]:
    for signum in signal.valid_signals() - UNHANDLED:
        signal.signal(signum, save)
if os.environ.get("CHECKPOINT_SESSION"):  # whether this program leads a session
    os.write(1, f"ready {os.getpid()} {os.getsid(0) == os.getpid()}\n".encode())
else:
    os.write(1, f"ready {os.getpid()}\n".encode())
if os.environ.get("CHECKPOINT_STOP_ITSELF"):  # a program stopping itself, as a shell's `suspend`
    os.kill(os.getpid(), signal.SIGTSTP)
    os.write(1, b"went on\n")
deadline = time.monotonic() + float(os.environ.get("CHECKPOINT_RUN_S", "60"))
while time.monotonic() < deadline:
    time.sleep(0.01)
os.write(1, b"done\n")
