"""A step that imports torch and does a little work (on the GPU when there is one)."""
import torch

device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.ones(256, 256, device=device)
print(f"torch step on {device}: {float((x @ x).sum()):.0f}")
