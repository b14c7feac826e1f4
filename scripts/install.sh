#!/usr/bin/env bash
# Installs the project and the CPU stack it preloads (idempotent; quick when already installed).
# Says what it is doing on a terminal; quiet in pipes and CI logs except for errors.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
step() { if [ -t 1 ]; then echo "install.sh: $*"; fi; }
# (As root, as CI runs, pip warns about root on every call: the install is the machine's.)
pip_install() { PIP_ROOT_USER_ACTION=ignore $py -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
# An interpreter its OS manages (PEP 668: Debian's /usr/bin/python3) refuses pip installs.
if $py -c "import os, sys, sysconfig; sys.exit(not (sys.prefix == sys.base_prefix and os.path.exists(
    os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED'))))"; then
  echo "install.sh: $($py -c 'import sys; print(sys.executable)') is managed by the OS (PEP 668);" \
       "make a venv and name it: python3 -m venv .venv, then PYTHON=.venv/bin/python bash" \
       "scripts/test.sh (or demo.sh)" >&2
  exit 1
fi
# torch first, pinned to the local CPU build: an unpinned torch pulls a multi-GB CUDA build.
step "torch 2.13.0 (CPU build)…"
pip_install "torch==2.13.0"
step "megatron-core, nvidia-modelopt, the test tools and preload_launcher (editable)…"
pip_install -e ".[stack,test]"
step "checking the imports…"
# -W ignore: megatron-core warns at import that Transformer Engine and Apex are absent (expected
# on a CPU machine); those warnings are not errors.
$py -W ignore -c "import torch, megatron.core, modelopt.torch, pytest_timeout, preload_launcher" \
  || { echo "install.sh: the stack did not install" >&2; exit 1; }
step "done"
