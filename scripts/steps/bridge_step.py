"""A megatron-bridge step: AutoBridge builds a tiny Llama-shaped Megatron model from a locally made
HF config (no downloads), random weights, one forward pass. Run under torchrun (1 rank)."""
import os

import torch
import torch.distributed as dist
from megatron.bridge import AutoBridge
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from transformers import LlamaConfig

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(123)
config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                     max_position_embeddings=128, torch_dtype="bfloat16",
                     architectures=["LlamaForCausalLM"])
provider = AutoBridge.from_hf_config(config).to_megatron_provider(load_weights=False)
if hasattr(provider, "finalize"):
    provider.finalize()
model = provider.provide_distributed_model(wrap_with_ddp=False)[0]
tokens = torch.randint(0, 1024, (1, 64), device="cuda")
position = torch.arange(64, device="cuda").unsqueeze(0)
with torch.no_grad():
    logits = model(tokens, position, None)
print(f"bridge step: {type(model).__name__} from AutoBridge, logits {tuple(logits.shape)}", flush=True)
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
