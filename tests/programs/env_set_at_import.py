"""Whether a variable a library sets at import is there before the import (here and in a
process this one starts) and after it."""
import os
import subprocess
import sys

child = [sys.executable, "-c", "import os; print(os.environ.get('SETS_ENV_CACHE'))"]
seen = [os.environ.get("SETS_ENV_CACHE"), subprocess.run(child, capture_output=True, text=True).stdout.strip()]
import sets_env  # noqa: E402,F401

print(seen + [os.environ.get("SETS_ENV_CACHE")])
