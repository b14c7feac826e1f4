"""A small transformers training loop under `accelerate launch` (what a training example's
launch script runs): a GPT-2-shaped model built from a local config (no downloads), 20 AdamW
steps on random tokens, mixed precision where the GPU has it, loss printed by the main process."""
import time

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

started = time.time()
accelerator = Accelerator()
torch.manual_seed(0)
config = GPT2Config(n_layer=4, n_head=8, n_embd=512, vocab_size=8192, n_positions=256)
model = GPT2LMHeadModel(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, optimizer = accelerator.prepare(model, optimizer)
tokens = torch.randint(0, config.vocab_size, (8, 256), device=accelerator.device)
for step in range(20):
    loss = model(input_ids=tokens, labels=tokens).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    print(f"trained 20 steps on {accelerator.device} x{accelerator.num_processes}: "
          f"loss {loss.item():.3f}; {time.time() - started:.2f} s after the imports", flush=True)
