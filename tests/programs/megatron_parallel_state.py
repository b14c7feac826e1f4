"""A megatron-core step on gloo: parallel state, a tensor-parallel layer, an all-reduce."""
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

dist.init_process_group("gloo")
world = dist.get_world_size()
parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                           use_cpu_initialization=True, tensor_model_parallel_size=world)
layer = ColumnParallelLinear(16, 32, config=config, init_method=torch.nn.init.xavier_normal_,
                             bias=False, gather_output=False)
out = layer.weight  # this rank's partition of the 32 output features
t = torch.ones(1)
dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
print(f"rank {dist.get_rank()} tp={parallel_state.get_tensor_model_parallel_world_size()} "
      f"out={tuple(out.shape)} sum={int(t.item())}", flush=True)
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
