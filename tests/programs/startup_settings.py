"""Reports the interpreter start-up settings a program can observe (settings.py's rules)."""
import faulthandler
import json
import sys
import tracemalloc

code = sys._getframe().f_code
print(json.dumps({
    "faulthandler": faulthandler.is_enabled(),
    "tracemalloc": tracemalloc.is_tracing(),
    "flags": [sys.flags.inspect, sys.flags.dont_write_bytecode, sys.flags.optimize],
    "dont_write_bytecode": sys.dont_write_bytecode,
    "pymalloc": sys.getallocatedblocks() > 0,  # PYTHONMALLOC=malloc: python's allocator is off
    "positions": list(code.co_positions())[:2] if hasattr(code, "co_positions") else None,
}))
