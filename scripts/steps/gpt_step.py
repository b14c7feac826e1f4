"""A megatron-core GPT step: build a 2-layer model, forward + backward; any number of ranks.

Runs under torchrun (or the launcher's torchrun form). NCCL on GPUs, gloo on CPU.
``GPT_SPEC=te``: layers from Transformer Engine (``get_gpt_layer_with_transformer_engine_spec``).
"""
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if cuda else "gloo")
world = dist.get_world_size()
parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
if cuda:
    model_parallel_cuda_manual_seed(123)
config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=8 if world > 4 else 4,
                           use_cpu_initialization=True, pipeline_dtype=torch.float32,
                           tensor_model_parallel_size=world)
device = "cuda" if cuda else "cpu"
spec = (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec() if os.environ.get("GPT_SPEC") == "te"
        else gpt_layer_specs.get_gpt_layer_local_spec())
model = GPTModel(config=config, transformer_layer_spec=spec,
                 vocab_size=1024, max_sequence_length=64).to(device)
tokens = torch.randint(0, 1024, (2, 64), device=device)
position = torch.arange(64, device=device).unsqueeze(0).expand(2, -1)
mask = torch.ones(2, 1, 64, 64, dtype=torch.bool, device=device)
loss = model(tokens, position, mask, labels=tokens).float().mean()
loss.backward()
if cuda:
    torch.cuda.synchronize()
print(f"rank {dist.get_rank()}/{world} gpt loss {loss.item():.3f} ({type(model.decoder.layers[0].self_attention.linear_qkv).__name__})",
      flush=True)
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
