#!/usr/bin/env bash
# device: bash scripts/gpu/env_after_imports.sh [modules]     (carry .whl)
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-pool .whl/*.whl
export PYTHONPATH=/tmp/site-pool:$PWD PYTHONUNBUFFERED=1 PRELOAD_LAUNCHER_CACHE_DIR=/tmp/pl-cache-env
python3 scripts/gpu/env_after_imports.py "$@" 2>&1 | grep -v -i "warn" | tee "${OUT:-.}/env_after_imports.log"
