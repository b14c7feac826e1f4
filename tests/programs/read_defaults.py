"""Sets the variables given as KEY=VALUE arguments, then imports a module that reads them at
import (tests/programs/site_defaults) and prints what it read, and the variable it set."""
import os
import sys

for key, _, value in (arg.partition("=") for arg in sys.argv[1:]):
    os.environ[key] = value
import reads_defaults  # noqa: E402

print(reads_defaults.FLASH, reads_defaults.STRICT, reads_defaults.STRICT_SET,
      reads_defaults.OVERRIDDEN, os.environ["DEFAULTS_OVERRIDDEN"])
