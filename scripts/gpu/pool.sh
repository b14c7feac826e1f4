#!/usr/bin/env bash
# A worker pool's start on the GPU machine: 2 spawned ranks importing torch, megatron.core and
# modelopt.torch, three fresh pools per session, launcher on vs suite-wide (scripts/bench_pool.py).
#   device: bash scripts/gpu/pool.sh      (carry .whl: megatron-core and modelopt wheels)
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-pool .whl/*.whl
export PYTHONPATH=/tmp/site-pool:$PWD PYTHONUNBUFFERED=1
out=${OUT:-.}/pool.log
{ date -u; nvidia-smi --query-gpu=name --format=csv,noheader; } | tee "$out"
python3 scripts/bench_pool.py --imports torch,megatron.core,modelopt.torch --ranks 2 2>&1 | tee -a "$out"
