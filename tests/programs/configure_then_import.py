"""Sets a library's variable, then imports the module that reads it, as huggingface_hub's
users do with HF_HUB_OFFLINE."""
import os

os.environ["LAZY_PKG_OFFLINE"] = "1"
import lazy_pkg  # noqa: E402

before = hasattr(lazy_pkg, "constants")
from lazy_pkg import constants  # noqa: E402

print("before", before, "offline", constants.OFFLINE)
