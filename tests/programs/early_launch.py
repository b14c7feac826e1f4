"""A test process under the suite switch whose zygote's preload is held (``held_preload``
waits for the file $HELD_FLAG): it launches an interpreter before the preload is done, then
releases the preload, waits for it, and launches again. Prints what each launch printed and
whether a forked child ran it as JSON: the real program's parent is this process (a stand-in
becomes it by ``execve``), a forked child's is not. ``sys.modules`` cannot say: a forked step's
module table starts as a fresh interpreter's."""
import json
import os
import subprocess
import sys

from preload_launcher import Launcher
from preload_launcher.front import suite_wide

PROBE = f"import os; print(os.getppid() != {os.getpid()})"
launcher = Launcher(["held_preload"])
suite_wide.install(launcher)
try:
    early = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                           timeout=60)
    with open(os.environ["HELD_FLAG"], "w"):
        pass
    launcher.zygote_for(dict(os.environ))  # waits for the preload
    late = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=60)
    print(json.dumps({"early": [early.returncode, early.stdout],
                      "late": [late.returncode, late.stdout]}))
finally:
    suite_wide.uninstall()
    launcher.close()
