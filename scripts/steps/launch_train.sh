#!/usr/bin/env bash
# What a training example ships: a launch script that sets variables and calls accelerate.
set -euo pipefail
cd "$(dirname "$0")"
export TOKENIZERS_PARALLELISM=false
accelerate launch --num_processes "${NPROC:-1}" --mixed_precision "${PRECISION:-no}" \
  accelerate_train.py
