#!/usr/bin/env bash
# Builds the sdist and the wheel, installs the wheel into a fresh virtualenv outside the source
# tree, and checks it works there: the CLI's --version, one step through run(), the pytest
# plugin registered (its fixture runs a step). Leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
work=$(mktemp -d -t pl-package-XXXXXX)
# Sockets need a short path whatever TMPDIR is (107 bytes at most): the runtime folder sits in /tmp.
run=$(mktemp -d /tmp/pl-run-XXXXXX)
made=("$work" "$run")  # and what the build writes into the source tree, where it was not there before
for own in build preload_launcher.egg-info; do [ -e "$own" ] || made+=("$PWD/$own"); done
trap 'rm -rf "${made[@]}"' EXIT
quiet() { "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

quiet $py -m pip install -q --disable-pip-version-check build
# The sdist, then the wheel built from it (what a user's pip does with the sdist).
$py -m build -q --no-isolation --outdir "$work/dist" . >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/*.tar.gz) wheel=$(ls "$work"/dist/*.whl)
members=$(tar -tzf "$sdist")
for member in LICENSE CHANGELOG.md CONTRIBUTING.md preload_launcher/py.typed pyproject.toml; do
  grep -q "/$member\$" <<<"$members" || { echo "package_check: $member missing from the sdist" >&2; exit 1; }
done

$py -m venv "$work/venv"
quiet "$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel" pytest
cd "$work"  # outside the source tree: only the installed wheel can be imported
export XDG_RUNTIME_DIR="$run" PRELOAD_LAUNCHER_CACHE_DIR="$work/cache" PRELOAD_LAUNCHER_MODULES=json
version=$("$work/venv/bin/python" -c "import preload_launcher; print(preload_launcher.__version__)")
[ "$("$work/venv/bin/preload-launcher" --version)" = "preload-launcher $version" ]
"$work/venv/bin/python" - <<'PY'
import sys, preload_launcher
assert preload_launcher.__file__.startswith(sys.prefix), preload_launcher.__file__
result = preload_launcher.run([sys.executable, "-c", "print(6 * 7)"])
assert (result.via, result.returncode, result.stdout) == ("zygote", 0, "42\n"), result
PY
cat > test_smoke.py <<'PY'
import sys

def test_a_step_through_the_plugin(preload_launcher):
    result = preload_launcher.run([sys.executable, "-c", "print('plugin ok')"])
    assert (result.via, result.stdout) == ("zygote", "plugin ok\n"), result
PY
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider test_smoke.py >"$work/pytest.log" 2>&1 \
  || { cat "$work/pytest.log"; exit 1; }
grep -q "preload_launcher" "$work/pytest.log" || { cat "$work/pytest.log"; echo "package_check: no plugin summary" >&2; exit 1; }
# pytest forked from a zygote, which holds the installed package: pytest would rewrite it (a
# pytest11 distribution) and must not warn that it is imported already (an error here).
"$work/venv/bin/preload-launcher" run --no-daemon -- "$work/venv/bin/python" -m pytest -q \
  -p no:cacheprovider -W error::pytest.PytestAssertRewriteWarning test_smoke.py \
  >"$work/forked.log" 2>&1 || { cat "$work/forked.log"; echo "package_check: forked pytest failed" >&2; exit 1; }
echo "package_check: $(basename "$sdist") and $(basename "$wheel") build; the wheel installs and works outside the source tree"
