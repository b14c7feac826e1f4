"""A module that sets a variable at import, as torch._inductor sets TORCHINDUCTOR_CACHE_DIR."""
import os

os.environ["SETS_ENV_CACHE"] = "cache-of-sets-env"
