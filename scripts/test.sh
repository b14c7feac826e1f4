#!/usr/bin/env bash
# The test command: installs what it needs, runs the whole suite, then the core suite (every
# test that needs no torch) on the other Pythons the project supports, where pyenv has them,
# then checks the built package installs and works outside the source tree. Every stage runs
# (a failed suite does not hide the package check); the last line says which failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  # Its python, torchrun and accelerate come first on PATH, as in an activated virtualenv.
  PYTHON=$(command -v "$PYTHON") || { echo "test.sh: no interpreter at PYTHON" >&2; exit 1; }
  export PYTHON PATH="$(dirname "$PYTHON"):$PATH"
fi
failed=()
stage() {  # stage NAME COMMAND…: runs it, and remembers NAME when it fails
  local name=$1
  shift
  "$@" || { echo "test.sh: $name failed (exit $?)" >&2; failed+=("$name"); }
}
stage "install (scripts/install.sh)" bash scripts/install.sh
if [ ${#failed[@]} -eq 0 ]; then  # nothing else can run without it
  stage "the suite (pytest)" "${PYTHON:-python3}" -m pytest -q "$@"
  stage "the other Pythons (scripts/test_other_pythons.sh)" bash scripts/test_other_pythons.sh
  stage "the package check (scripts/package_check.sh)" bash scripts/package_check.sh
fi
if [ ${#failed[@]} -ne 0 ]; then
  for name in "${failed[@]}"; do echo "test.sh: FAILED: $name" >&2; done
  exit 1
fi
echo "test.sh: passed: install, the suite, the other Pythons, the package check"
