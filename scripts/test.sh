#!/usr/bin/env bash
# The test command: installs what it needs, runs the whole suite, then the core suite (every
# test that needs no torch) on the other Pythons the project supports, where pyenv has them,
# then checks the built package installs and works outside the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
${PYTHON:-python3} -m pytest -q "$@"
bash scripts/test_other_pythons.sh
bash scripts/package_check.sh
