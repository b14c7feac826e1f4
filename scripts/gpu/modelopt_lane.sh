#!/usr/bin/env bash
# Model-Optimizer's example tests on the GPU machine, as subprocesses and through the launcher, in
# one call (scripts/gpu/modelopt_lane.py; the swap: scripts/gpu/modelopt_lane_swap.py).
#
#   here:  bash scripts/gpu/modelopt_lane.sh prepare [MODELOPT_GIT_DIR] [COMMIT]
#          # a trimmed Model-Optimizer tree in .modelopt/ and the wheels the image lacks in .whl/
#          # (both git-ignored: add /.modelopt/ and /.whl/ to .git/info/exclude)
#   there: bash scripts/gpu/modelopt_lane.sh run [LANES] [modelopt_lane.py options]
#          # device call with carry [".modelopt", ".whl"]; LANES default spec,spec_ptq,onnx
#
# The GPU image (Python 3.12, torch 2.11+cu130, transformers 5.17, accelerate 1.15, peft, onnx,
# onnxruntime) lacks datasets (and its dill, multiprocess), modelopt's own dependencies (omegaconf,
# pydantic, pulp) and modelopt.onnx's (onnx-graphsurgeon, onnxconverter-common, onnxslim, lief,
# cppimport, mako). modelopt itself is imported from the checkout (first on PYTHONPATH); its
# installed 0.47.0 wheel only gives `importlib.metadata.version("nvidia-modelopt")` an answer.
set -euo pipefail
cd "$(dirname "$0")/../.."
PLAT=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
# What the checkout's example tests need: the tests, their helpers, the examples they run, the
# recipes; not examples/diffusers, docs, experimental, tools (most of the repository's size).
KEEP=(pyproject.toml LICENSE modelopt modelopt_recipes tests/conftest.py tests/_test_utils
      tests/examples/conftest.py tests/examples/speculative_decoding tests/examples/torch_onnx
      tests/examples/hf_ptq tests/examples/llm_distill tests/examples/llm_qat
      tests/examples/llm_sparsity tests/examples/megatron_bridge tests/gpu_megatron
      examples/speculative_decoding
      examples/hf_ptq examples/torch_onnx examples/llm_distill examples/llm_qat
      examples/llm_sparsity examples/megatron_bridge examples/dataset
      tests/unit/conftest.py tests/unit/torch/conftest.py
      tests/unit/torch/quantization/test_dist.py tests/unit/torch/quantization/test_autoquant.py)

case "${1:-}" in
prepare)
  src=${2:-/work/.mirror/NVIDIA+Model-Optimizer/repo}   # a clone or the fetch tool's git dir
  commit=${3:-a2fbac7ba}
  rm -rf .modelopt && mkdir .modelopt
  git --git-dir="$src" archive "$commit" "${KEEP[@]}" | tar -x -C .modelopt
  git --git-dir="$src" rev-parse "$commit" > .modelopt/COMMIT
  bash ../shared/gpu/fetch_wheels.sh .whl
  python3 -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d .whl \
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 onnx-graphsurgeon==0.6.1 \
    onnxconverter-common==1.16.0 onnxslim==0.1.98 lief==1.0.0 mako==1.4.3
  # py-spy: the lane's view of a session's Python stacks (at its limit; --sample); a folder of
  # its own, so that the first of lanes.sh's calls stays within a call's 64 MiB
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 -d .whl-tools py-spy==0.4.3
  python3 -m pip wheel -q --no-deps -w .whl cppimport==26.4.17   # an sdist only: pure Python
  du -sh --apparent-size .modelopt .whl ;;
run)
  lanes=${2:-spec,spec_ptq,onnx}
  shift $(( $# >= 2 ? 2 : 1 ))
  out=${OUT:-lane-out}
  mkdir -p "$out"
  # megatron-core/-bridge are for the megatron_bridge lane only: with them, every step's
  # `import modelopt.torch` also imports megatron.core (the HF lanes' CI has none).
  wheels=$(ls .whl/*.whl .whl-tools/*.whl 2>/dev/null | grep -v -E '/megatron_(core|bridge)-')
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels > /tmp/lane-install.log 2>&1 || { tail -n 30 /tmp/lane-install.log; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  nvidia-smi -L || true
  python3 scripts/gpu/modelopt_lane.py --lanes "$lanes" --out "$out" "$@" 2>&1 | tee "$out/lane.log" ;;
*)
  echo "usage: $0 prepare [MODELOPT_GIT_DIR] [COMMIT] | run [LANES] [options]" >&2; exit 2 ;;
esac
