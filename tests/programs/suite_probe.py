"""What a program started by a test sees; one JSON line on stdout. argv[1]: the exit code."""
import json
import os
import shutil
import sys

seen = {
    "executable": sys.executable, "argv": sys.argv, "orig_argv": sys.orig_argv,
    "path0": sys.path[0], "cwd": os.getcwd(), "PATH": os.environ.get("PATH"),
    "which": shutil.which("python3"), "marker": os.environ.get("SUITE_MARKER"),
    "launcher_env": sorted(k for k in os.environ if "PRELOAD_LAUNCHER" in k
                           and k not in ("PRELOAD_LAUNCHER", "PRELOAD_LAUNCHER_MODULES")),
    "stdin": sys.stdin.read() if not sys.stdin.isatty() else None,
    # Forked from the zygote: its module table finder is on sys.meta_path.
    "forked": "module_table" in repr(sys.meta_path),
}
os.write(1, (json.dumps(seen) + "\n").encode())
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
