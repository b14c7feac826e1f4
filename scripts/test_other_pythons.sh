#!/usr/bin/env bash
# The core suite on Python 3.10, 3.12 and 3.13 (pyproject claims >= 3.10). Torch has no CPU
# build here for them, so tests marked needs_torch are skipped; everything else must pass.
# Each Python gets its own venv under .venvs/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
root=${PYENV_ROOT:-$HOME/.pyenv}
status=0
for version in 3.10 3.12 3.13; do
  py=$(ls -d "$root"/versions/"$version".*/bin/python 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -z "$py" ]; then
    echo "test_other_pythons.sh: no Python $version under $root; its core suite was not run" >&2
    continue
  fi
  venv=.venvs/$version
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 \
    | grep -v "^WARNING: Location" || true
  echo "== core suite on $("$venv/bin/python" --version) =="
  "$venv/bin/python" -m pytest -q || status=1
done
exit $status
