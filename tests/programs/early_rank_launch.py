"""A test process under the suite switch whose zygote's preload is held (``held_preload``
waits for the file $HELD_FLAG), as early_launch.py: it starts ``python`` and then ``torchrun``
before the preload is done, and once torchrun's stand-in is in its wait (itself still, asleep
between its looks for the zygote's ready mark), does what argv[1] says: ``release`` the
preload, send the stand-in ``SIGTERM``, or kill the zygote (``zygote_dies``). Prints as JSON
what the python launch printed, how torchrun ended, each rank's parent (the real torchrun, which
the stand-in becomes by ``execve``, is its ranks' parent; a forked one is not) and what the
stand-ins ran without asking."""
import json
import os
import signal
import subprocess
import sys
import time

from preload_launcher import Launcher
from preload_launcher.front import suite_wide

PROBE = f"import os; print(os.getppid() != {os.getpid()})"
RANK = "import os; os.write(1, ('%s %d\\n' % (os.environ['RANK'], os.getppid())).encode())"


def waiting(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        with open(f"/proc/{pid}/wchan") as f:
            asleep = "nanosleep" in f.read()
    except OSError:
        return False
    return asleep and any(arg.endswith(b"/standin") for arg in args)


what = sys.argv[1]
launcher = Launcher(["held_preload"])
suite_wide.install(launcher)
try:
    early = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                           timeout=60)
    with open("rank.py", "w") as f:
        f.write(RANK)
    ranks = subprocess.Popen(["torchrun", "--nproc_per_node=2", "rank.py"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 120  # a start-up, not a measurement
    while not waiting(ranks.pid) and ranks.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if what == "release":
        with open(os.environ["HELD_FLAG"], "w"):
            pass
    elif what == "signal":
        ranks.send_signal(signal.SIGTERM)
    elif what == "zygote_dies":
        os.kill(launcher.zygotes[0].process.pid, signal.SIGKILL)
    out, _ = ranks.communicate(timeout=180)
    parents = sorted(line.split()[0] + (" torchrun" if int(line.split()[1]) == ranks.pid else " other")
                     for line in out.splitlines())
    print(json.dumps({"early": [early.returncode, early.stdout],
                      "ranks": [ranks.returncode, parents],
                      "ran_real": launcher.standin_counts()[1]}))
finally:
    suite_wide.uninstall()
    launcher.close()
