"""Launches an interpreter with Popen's process arguments that change its identity (``group=``,
``extra_groups=``, ``user=``), plainly or under the suite switch (``switch``), and prints what
each saw of its ids (or how it failed) as JSON."""
import json
import os
import subprocess
import sys

PROBE = "import os; print(os.getuid(), os.getgid(), sorted(os.getgroups()))"
if sys.argv[1] == "switch":
    from preload_launcher import Launcher
    from preload_launcher.front import suite_wide
    launcher = Launcher(["json"])
    suite_wide.install(launcher)
    launcher.zygote_for_standins(dict(os.environ)).wait_ready()
seen = {}
for name, kwargs in {"group": {"group": 65534, "extra_groups": [65534]},
                     "user": {"user": 65534, "group": 65534, "extra_groups": []},
                     "none": {}}.items():
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              cwd="/", timeout=60, **kwargs)
        seen[name] = [done.returncode, done.stdout, done.stderr.splitlines()[-1:]]
    except OSError as err:
        seen[name] = type(err).__name__
if sys.argv[1] == "switch":
    seen["forked"] = suite_wide.counts()["interpreters"]
    suite_wide.uninstall()
    launcher.close()
print(json.dumps(seen))
