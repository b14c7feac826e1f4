#!/usr/bin/env bash
# The first call of a session from an empty launcher cache against a warm first call, on the
# H200 machine (megatron-core and modelopt come as wheels in .whl/: ../shared/gpu/fetch_wheels.sh).
#   device: bash scripts/gpu/first_call.sh [runs]      (carry .whl)
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-.}/first_call.log
{ date -u; nvidia-smi --query-gpu=name --format=csv,noheader; } | tee "$out"
python3 scripts/first_call.py --runs "${1:-2}" \
  --step "import torch; torch.ones(1, device='cuda').sum().item()" 2>&1 | tee -a "$out"
