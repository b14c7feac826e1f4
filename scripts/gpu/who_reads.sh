#!/usr/bin/env bash
# device: bash scripts/gpu/who_reads.sh KEY [modules]     (carry .whl)
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-pool .whl/*.whl
export PYTHONPATH=/tmp/site-pool:$PWD PYTHONUNBUFFERED=1
python3 scripts/gpu/who_reads.py "$@" 2>&1 | grep -v -i "warn" | tee "${OUT:-.}/who_reads.log"
