"""A torch.compile'd training loop's steady state, to run plainly and as a forked step.

spec_compile (EAGLE3 training with torch.compile) ran its 250 iterations at ~2.0 it/s as a
subprocess and ~1.4 it/s as a forked step on the H200 (2026-12-04), while the same training
without torch.compile ran alike both ways. This measures one compiled training loop of a tiny
Llama (transformers) on the GPU (else a torch-only model on the CPU): the first iterations
(compilation), the steady state, and a profile of the steady state, plus what a step could see
differently (threads, inductor's settings, functions torch's device interface and triton's
driver hold).

    python3 scripts/gpu/compile_steady.py [ITERATIONS]
    python3 -m preload_launcher.cli run --no-daemon --preload torch,transformers,accelerate,datasets,modelopt.torch -- python3 scripts/gpu/compile_steady.py [ITERATIONS]
"""

import cProfile
import io
import os
import pstats
import sys
import time

import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def model():
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        layers = [torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True) for _ in range(2)]
        return torch.nn.Sequential(*layers), lambda m, x: m(x).float().pow(2).mean(), \
            torch.randn(4, 16, 64)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    ids = torch.randint(0, 1000, (4, 64))
    return LlamaForCausalLM(config), lambda m, x: m(input_ids=x, labels=x).loss, ids


def origin(fn) -> str:
    """Where a function held by torch or triton is defined: a built-in, or the file of its code
    (a wrapper copies ``__module__`` and ``__name__`` from what it wraps; its code it cannot)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return f"built-in {getattr(fn, '__qualname__', type(fn).__name__)}"
    return f"{os.path.basename(code.co_filename)}:{code.co_name}"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def main():
    steady = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    torch.manual_seed(0)
    net, loss_of, batch = model()
    net, batch = net.to(DEVICE), batch.to(DEVICE)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    compiled = torch.compile(net)

    def iteration():
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=CUDA):
            loss = loss_of(compiled, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for _ in range(3):
        iteration()
    sync()
    warm = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steady):
        iteration()
    sync()
    per = (time.perf_counter() - start) / steady
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(50):
        iteration()
    sync()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(14)

    import torch._inductor.config as inductor
    from torch._dynamo.device_interface import get_interface_for_device
    interface = get_interface_for_device(DEVICE)
    held = {name: origin(getattr(interface, name, None))
            for name in ("current_device", "get_device_properties", "device_count",
                         "is_available", "get_compute_capability")}
    triton_driver = {}
    if CUDA:
        try:
            from triton.runtime import driver
            active = driver.active
            for name in ("get_current_device", "get_device_capability", "get_current_stream"):
                fn = getattr(active, name, None)
                triton_driver[name] = origin(fn)
        except Exception as error:  # what a step would see is the point: say it
            triton_driver = {"error": repr(error)}
    print(f"RESULT pid={os.getpid()} device={DEVICE} warm_s={warm:.2f} "
          f"steady_ms_per_it={per * 1000:.2f} iterations={steady}", flush=True)
    print(f"  threads intra={torch.get_num_threads()} inter={torch.get_num_interop_threads()} "
          f"affinity={len(os.sched_getaffinity(0))} nice={os.getpriority(os.PRIO_PROCESS, 0)} "
          f"compile_threads={inductor.compile_threads} "
          f"matmul={torch.backends.cuda.matmul.fp32_precision} "
          f"float32_matmul={torch.get_float32_matmul_precision()}", flush=True)
    print(f"  device interface functions from: {held}", flush=True)
    print(f"  triton driver functions from: {triton_driver}", flush=True)
    print(f"  cuda alloc conf={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')} "
          f"modules={len(sys.modules)}", flush=True)
    print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main()
