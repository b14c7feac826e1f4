"""Reads its settings at import as Transformer Engine reads ``NVTE_FLASH_ATTN``: with a default.
``DEFAULTS_STRICT`` is also tested for being set, which a default cannot stand for."""
import os

FLASH = int(os.getenv("DEFAULTS_FLASH", "1"))
STRICT = os.environ.get("DEFAULTS_STRICT", "1")
STRICT_SET = "DEFAULTS_STRICT" in os.environ
