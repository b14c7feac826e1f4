"""Which of torch's compiler packages `import torch` brings, and what reaching one as an
attribute does (torch's module __getattr__ imports it)."""
import sys

import torch

loaded = [name in sys.modules for name in ("torch._dynamo", "torch._inductor")]
torch._dynamo  # noqa: B018
print(loaded + ["torch._dynamo" in sys.modules])
