"""The Model-Optimizer lanes' tests (scripts/gpu/modelopt_lane.py): which example tests each lane
runs, in the suite's file order, and which were dropped and why."""

SPEC = "tests/examples/speculative_decoding/test_eagle.py::"
SPEC_PTQ = "tests/examples/speculative_decoding/test_eagle_offline_ptq.py::"
ONNX = "tests/examples/torch_onnx/test_hf_embedding_quant_to_onnx.py"
BRIDGE = "tests/examples/megatron_bridge/"
GPU_MEGATRON = "tests/gpu_megatron/torch/"
POISON = GPU_MEGATRON + "test_pool_poison.py"  # scripts/gpu/pool_poison.py, copied in by --poison

# Each lane: the example tests that run on one GPU without the hub, in the suite's file order
# (later tests use earlier tests' outputs).
LANES = {
    "spec": [SPEC + "test_calibrate_draft_vocab",
             SPEC + "test_llama_eagle3[1-False]",
             SPEC + "test_llama_eagle3[1-True]",
             SPEC + "test_resume_training",
             SPEC + "test_ar_validate",
             SPEC + "test_export_hf_checkpoint",
             SPEC + "test_convert_to_vllm_ckpt",
             SPEC + "test_offline_eagle3_training[tinyllama]",
             SPEC + "test_eagle3_dry_run"],
    # hf_ptq on a tiny model: hidden states -> offline EAGLE training -> hf_ptq.py fp8 + export
    "spec_ptq": [SPEC_PTQ + "test_collect_hidden_states",
                 SPEC_PTQ + "test_offline_eagle_training",
                 SPEC_PTQ + "test_offline_ptq"],
    "onnx": [ONNX],
    # Disjoint parts of the above that each fit one device call (600 s) both ways on one H200:
    # short,onnx, then spec_train, then spec_compile (torch.compile's warm-up, ~2 min a way).
    # short: the shortest chain with every kind of step (python, bash -> accelerate launch, hf_ptq).
    "short": [SPEC + "test_calibrate_draft_vocab",
              SPEC + "test_eagle3_dry_run",
              SPEC_PTQ + "test_collect_hidden_states",
              SPEC_PTQ + "test_offline_eagle_training",
              SPEC_PTQ + "test_offline_ptq"],
    "spec_train": [SPEC + "test_llama_eagle3[1-True]",
                   SPEC + "test_resume_training",
                   SPEC + "test_ar_validate",
                   SPEC + "test_export_hf_checkpoint",
                   SPEC + "test_convert_to_vllm_ckpt",
                   SPEC + "test_offline_eagle3_training[tinyllama]"],
    "spec_compile": [SPEC + "test_llama_eagle3[1-False]"],
    # megatron_bridge (needs Transformer Engine, megatron-bridge and its runtime: lanes.sh's
    # .whl-bridge): every test that runs without the hub, on mock data or local tiny models; each
    # torchrun step is one rank on one GPU.
    "bridge": [BRIDGE + "test_distill.py::test_distill_llm",
               BRIDGE + "test_distill.py::test_distill_llm_sft",
               BRIDGE + "test_distill.py::test_distill_validate_only",
               BRIDGE + "test_export_distilled_megatron_to_hf.py"],
    # gpu_megatron: module-scoped DistributedWorkerPools (world size = GPUs), one per module; the
    # poison module (--poison) sits between them: a poisoned pool must not reach later modules.
    "pools": [GPU_MEGATRON + "sparsity/weight_sparsity/plugins/test_megatron_sparsity.py",
              GPU_MEGATRON + "export/test_vllm_fakequant_megatron_export.py",
              POISON,
              GPU_MEGATRON + "speculative/plugins/test_speculative_megatron_modules.py",
              GPU_MEGATRON + "nas/plugins/test_megatron_gpt_dynamic_modules.py",
              GPU_MEGATRON + "export/test_megatron_importer.py"],
}

DROPPED = [
    ("speculative_decoding test_llama_eagle3[2-*]", "multi-GPU only (cp_size=2; skips on one GPU)"),
    ("speculative_decoding test_offline_eagle3_training[kimi-k2.5, kimi-k2-thinking, minimax-m2.5], "
     "test_offline_resume_training_kimi", "needs the hub (remote model configs); two are manual"),
    ("speculative_decoding test_server_generate_vlm_sglang", "needs sglang and a server"),
    ("torch_onnx test_torch_onnx[*] (20), test_torch_onnx_recipe_flag",
     "needs the hub (zh-plus/tiny-imagenet); test_torch_onnx also needs TensorRT (--trt_build)"),
    ("hf_ptq test_llm_ptq, test_deploy, test_vlm_ptq",
     "needs the hub (TinyLlama-1.1B, BART, T5, ... and cnn_dailymail); offline hf_ptq runs in spec_ptq"),
    ("llm_distill test_llama_distill", "needs the hub (ReactiveAI/smol-smoltalk-Interaction-SFT)"),
    ("llm_qat test_*", "needs the hub (abisee/cnn_dailymail); the deepspeed cases need deepspeed"),
    ("llm_sparsity test_llama_sparsity*, test_attention_sparsity",
     "needs the hub (cnn_dailymail calibration; RULER data for attention calibration)"),
    ("megatron_bridge test_distill_puzzletron_anymodel", "needs the hub (Qwen/Qwen3-0.6B's config)"),
    ("megatron_bridge test_distill_vlm", "needs the hub (the tiny Qwen3.5-VL's processor; seen "
     "on the H200, 2026-12-03)"),
    ("megatron_bridge test_quantize_and_export, test_qad[*], test_prune_minitron*[*]",
     "need the hub (cnn_dailymail calibration; pruning also scores on MMLU)"),
    ("gpu_megatron other modules", "the hub (test_utils_megatron's Qwen tokenizer), 2+ GPUs, or "
     "more than one device call; the pools lane is a sample of pool-starting modules"),
]
