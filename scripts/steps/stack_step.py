"""A step that imports torch + megatron.core + modelopt.torch, as the example scripts do."""
import torch
import megatron.core  # noqa: F401
import modelopt.torch.opt as mto  # noqa: F401

x = torch.ones(64, 64)
print(f"stack step: {float((x @ x).sum()):.0f}")
