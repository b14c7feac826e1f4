"""A modelopt quantize call on a small megatron-core GPT model on the GPU (FP8 on Hopper)."""
import os

import torch
import torch.distributed as dist
import modelopt.torch.quantization as mtq
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
if "MASTER_PORT" not in os.environ:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
dist.init_process_group("nccl", rank=int(os.environ.get("RANK", 0)),
                        world_size=int(os.environ.get("WORLD_SIZE", 1)))
parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
model_parallel_cuda_manual_seed(123)
config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4,
                           use_cpu_initialization=True, pipeline_dtype=torch.float32,
                           tensor_model_parallel_size=dist.get_world_size())
model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=1024,
                 max_sequence_length=64).cuda()
tokens = torch.randint(0, 1024, (2, 64), device="cuda")
position = torch.arange(64, device="cuda").unsqueeze(0).expand(2, -1)
mask = torch.ones(2, 1, 64, 64, dtype=torch.bool, device="cuda")
model = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: m(tokens, position, mask))
out = model(tokens, position, mask)
torch.cuda.synchronize()
quantized = sum(1 for m in model.modules() if type(m).__name__.startswith("Quant"))
print(f"mtq.quantize ok on {torch.cuda.get_device_name()}: {quantized} quantized modules, "
      f"out {tuple(out.shape)}", flush=True)
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
