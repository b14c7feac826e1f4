"""One step of a six-step suite shaped like Megatron/ModelOpt example tests, run under torchrun:

    torchrun --nproc_per_node=N scripts/steps/gpt_suite.py PHASE --dir DIR

PHASE is build (build a small megatron-core GPT, one forward), train (a few Adam iterations),
save (train, then save a distributed checkpoint to DIR), load (load it, check the loss matches
what save recorded), quantize (modelopt ``mtq.quantize``, FP8 on Hopper GPUs, INT8 elsewhere)
or generate (load the checkpoint, greedy-decode a few tokens). Tensor parallel = N ranks; NCCL
on GPUs, gloo on CPU. Prints ``PHASES {...}``: wall-clock stamps of the step's own stages.
"""
import time

STAMPS = {"start": time.time()}

import argparse  # noqa: E402
import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.tensor_parallel import random as tp_random  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

PHASES = ("build", "train", "save", "load", "quantize", "generate")
VOCAB, SEQ, BATCH = 1024, 64, 2


def init_distributed(cuda: bool) -> torch.device:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    if cuda:
        tp_random.model_parallel_cuda_manual_seed(1234)
    else:
        # megatron-core's GPT and checkpoint code call torch.cuda.current_device() and
        # synchronize() unconditionally; on a CPU-only machine they point at the CPU, and
        # megatron's own no-op RNG tracker stands in for the CUDA one. Nothing is patched on GPUs.
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda device=None: None
        tp_random.initialize_rng_tracker(inference_rng_tracker=True)
    return device


class Suite:
    """A 2-layer GPT at TP=world and one fixed batch (the same on every rank and phase)."""

    def __init__(self, device: torch.device, ckpt_root: str) -> None:
        self.world = dist.get_world_size()
        torch.manual_seed(1234)
        config = TransformerConfig(num_layers=2, hidden_size=128,
                                   num_attention_heads=8 if self.world > 4 else 4,
                                   use_cpu_initialization=True, pipeline_dtype=torch.float32,
                                   hidden_dropout=0.0, attention_dropout=0.0,
                                   tensor_model_parallel_size=self.world)
        self.model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                              vocab_size=VOCAB, max_sequence_length=SEQ).to(device)
        generator = torch.Generator().manual_seed(42)
        self.tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device)
        self.position = torch.arange(SEQ, device=device).unsqueeze(0).expand(BATCH, -1)
        self.mask = torch.tril(torch.ones(SEQ, SEQ, device=device)).view(1, 1, SEQ, SEQ) < 0.5
        self.device = device
        self.ckpt = os.path.join(ckpt_root, f"gpt_tp{self.world}")

    def loss(self) -> float:
        return self.model(self.tokens, self.position, self.mask, labels=self.tokens).float().mean()

    def eval_loss(self) -> float:
        self.model.eval()
        with torch.no_grad():
            return self.loss().item()

    def train_iterations(self, iterations: int) -> float:
        optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        for _ in range(iterations):
            optimizer.zero_grad()
            loss = self.loss()
            loss.backward()
            optimizer.step()
        return loss.item()

    def train(self) -> str:
        first = self.loss().item()
        return f"loss {first:.4f} -> {self.train_iterations(5):.4f} after 5 Adam iterations"

    def build(self) -> str:
        params = sum(p.numel() for p in self.model.parameters())
        return f"{params} parameters per rank, loss {self.eval_loss():.4f}"

    def save(self) -> str:
        self.train_iterations(2)
        loss = self.eval_loss()
        if dist.get_rank() == 0:
            if os.path.isdir(self.ckpt):
                import shutil
                shutil.rmtree(self.ckpt)
            os.makedirs(self.ckpt)
        dist.barrier()
        dist_checkpointing.save(self.model.sharded_state_dict(), self.ckpt)
        if dist.get_rank() == 0:
            with open(os.path.join(self.ckpt, "suite.json"), "w") as f:
                json.dump({"loss": loss}, f)
        return f"saved {self.ckpt}, loss {loss:.4f}"

    def load_checkpoint(self) -> float:
        state = dist_checkpointing.load(self.model.sharded_state_dict(), self.ckpt)
        self.model.load_state_dict(state)
        with open(os.path.join(self.ckpt, "suite.json")) as f:
            return json.load(f)["loss"]

    def load(self) -> str:
        saved, loss = self.load_checkpoint(), self.eval_loss()
        if abs(loss - saved) > 1e-4:
            raise SystemExit(f"the loaded checkpoint gives loss {loss:.6f}; it was saved at {saved:.6f}")
        return f"loaded {self.ckpt}, loss {loss:.4f} as saved"

    def quantize(self) -> str:
        import modelopt.torch.quantization as mtq
        cuda = self.device.type == "cuda"
        fp8 = cuda and torch.cuda.get_device_capability(self.device) >= (8, 9)
        self.model = mtq.quantize(self.model, mtq.FP8_DEFAULT_CFG if fp8 else mtq.INT8_DEFAULT_CFG,
                                  lambda m: m(self.tokens, self.position, self.mask))
        quantized = sum(1 for m in self.model.modules() if type(m).__name__.startswith("Quant"))
        return f"{'FP8' if fp8 else 'INT8'}: {quantized} quantized modules, loss {self.eval_loss():.4f}"

    def generate(self) -> str:
        self.load_checkpoint()
        self.model.eval()
        prompt = self.tokens[:1, :8]
        with torch.no_grad():
            for _ in range(8):
                n = prompt.shape[1]
                logits = self.model(prompt, self.position[:1, :n], self.mask[..., :n, :n])
                prompt = torch.cat([prompt, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return f"greedy tokens {prompt[0, 8:].tolist()}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=PHASES)
    parser.add_argument("--dir", required=True, help="checkpoint directory (shared by the phases)")
    args = parser.parse_args()
    if args.phase == "quantize":
        import modelopt.torch.quantization  # noqa: F401  (timed with the imports)
    STAMPS["imports"] = time.time()
    cuda = torch.cuda.is_available()
    device = init_distributed(cuda)
    STAMPS["dist_init"] = time.time()
    suite = Suite(device, args.dir)
    STAMPS["model"] = time.time()
    result = getattr(suite, args.phase)()
    if cuda:
        torch.cuda.synchronize()
    STAMPS["work"] = time.time()
    if dist.get_rank() == 0:
        print(f"gpt suite {args.phase} (TP={suite.world}): {result}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    STAMPS["end"] = time.time()
    if int(os.environ.get("RANK", 0)) == 0:
        print("PHASES " + json.dumps(STAMPS), flush=True)
        # Registered last, so it runs first at exit: after main's objects are freed and
        # threads are joined, before the other atexit handlers (scripts/bench.py).
        atexit.register(lambda: print(f"ATEXIT {time.time()!r}", flush=True))


if __name__ == "__main__":  # dist_checkpointing's writer spawns processes that import this file
    main()
