"""A test process under the suite switch whose zygote's preload is held (``held_preload``
waits for the file $HELD_FLAG), as early_launch.py: it starts ``python`` and then ``torchrun``
before the preload is done. The preload is released only once torchrun's stand-in has asked
the zygote (a socket among its fds) or has ended. Prints as JSON what the python launch
printed, each rank's parent (the real torchrun, which the stand-in becomes by ``execve``, is
its ranks' parent; a forked one is not this pid) and what the stand-ins ran without asking."""
import json
import os
import subprocess
import sys
import time

from preload_launcher import Launcher
from preload_launcher.front import suite_wide

PROBE = f"import os; print(os.getppid() != {os.getpid()})"
RANK = "import os; os.write(1, ('%s %d\\n' % (os.environ['RANK'], os.getppid())).encode())"


def asked(pid: int) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                return True
        except OSError:
            pass
    return False


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
    while not asked(ranks.pid) and ranks.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(os.environ["HELD_FLAG"], "w"):
        pass
    out, _ = ranks.communicate(timeout=180)
    parents = sorted(line.split()[0] + (" torchrun" if int(line.split()[1]) == ranks.pid else " other")
                     for line in out.splitlines())
    print(json.dumps({"early": [early.returncode, early.stdout],
                      "ranks": [ranks.returncode, parents],
                      "ran_real": launcher.standin_counts()[1]}))
finally:
    suite_wide.uninstall()
    launcher.close()
