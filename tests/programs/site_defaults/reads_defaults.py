"""Reads its settings at import as Transformer Engine reads ``NVTE_FLASH_ATTN``: with a default.
``DEFAULTS_STRICT`` is also tested for being set, which a default cannot stand for, and
``DEFAULTS_OVERRIDDEN`` is set after it is read: a step that held the default ends up with it
set to "0", as a fresh interpreter does."""
import os

FLASH = int(os.getenv("DEFAULTS_FLASH", "1"))
STRICT = os.environ.get("DEFAULTS_STRICT", "1")
STRICT_SET = "DEFAULTS_STRICT" in os.environ
OVERRIDDEN = os.getenv("DEFAULTS_OVERRIDDEN", "1")
os.environ["DEFAULTS_OVERRIDDEN"] = "0"
