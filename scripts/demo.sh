#!/usr/bin/env bash
# The demo command: installs what it needs, then runs scripts/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec ${PYTHON:-python3} scripts/demo.py "$@"
