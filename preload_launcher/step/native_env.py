"""Configuration the stack's native code read from the environment while the zygote preloaded,
read again in each forked step through the library's own API, so that the step runs with its
own values as a fresh interpreter would:

- the local time zone: the C library and ``time`` (``tzname``, ``timezone``) took ``TZ`` when
  the zygote started; ``time.tzset()`` reads the step's (``time.localtime``, ``datetime`` and
  ``strftime`` follow);
- torch.distributed's debug level: read from ``TORCH_DISTRIBUTED_DEBUG`` when
  ``torch.distributed`` is imported; ``set_debug_level_from_env()`` reads the step's. A value
  torch refuses makes a fresh interpreter's ``import torch`` fail: such a step runs as one.

Thread-pool sizes are the business of ``threads``; what a library offers no API for is part of
the zygote's import-relevant environment (``settings.NATIVE_ENV``).
"""

from __future__ import annotations

import sys
import time

__all__ = ["REREAD", "reapply", "refusal"]

REREAD = ("TZ", "TORCH_DISTRIBUTED_DEBUG")  # the variables ``reapply`` reads again

_refusal = ""


def reapply() -> None:
    """In a forked step or rank, once its environment is in place."""
    global _refusal
    _refusal = ""
    time.tzset()
    distributed = sys.modules.get("torch.distributed")
    set_level = getattr(distributed, "set_debug_level_from_env", None)
    if set_level is not None:
        try:
            set_level()
        except (ValueError, RuntimeError) as err:
            _refusal = f"torch refuses its TORCH_DISTRIBUTED_DEBUG at import ({err})"


def refusal() -> str:
    """Why this step must run in a fresh interpreter ('' when it need not)."""
    return _refusal
