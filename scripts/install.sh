#!/usr/bin/env bash
# Installs the project and the CPU stack it preloads (idempotent; quick when already installed).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
# torch first, pinned to the local CPU build: an unpinned torch pulls a multi-GB CUDA build.
$py -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
$py -m pip install -q --disable-pip-version-check -e ".[stack,test]" 2>&1 | grep -v "^WARNING: Location" || true
$py -c "import torch, megatron.core, modelopt.torch, pytest_timeout, preload_launcher" \
  || { echo "install.sh: the stack did not install" >&2; exit 1; }
