#!/usr/bin/env bash
# Transformer Engine 2.20.2 on the H200 machine (Python 3.12, torch 2.11+cu130, CUDA 13), which
# cannot download: its 276 MB core wheel travels in parts (a device call carries 64 MiB at most)
# and its torch extension, published as an sdist only, is built there.
#
#   here:      bash scripts/gpu/transformer_engine.sh fetch     # wheels, sdist, parts in .te/ (git-ignored)
#   there:     bash scripts/gpu/transformer_engine.sh receive   # after each call carrying .te/parts/<one part>
#   there:     bash scripts/gpu/transformer_engine.sh install   # join, check, install, build the extension
# Then `export PYTHONPATH=/tmp/te-site:$PYTHONPATH` makes `import transformer_engine.pytorch` work.
set -euo pipefail
cd "$(dirname "$0")/../.."
TE=2.20.2
CORE=transformer_engine_cu13-$TE-py3-none-manylinux_2_28_x86_64.whl
STORE=/tmp/te-parts   # survives between calls while the machine is held
SITE=/tmp/te-site
case "${1:-}" in
fetch)
  mkdir -p .te/parts .te/build
  py=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64)
  pip download -q --no-deps "${py[@]}" -d .te "transformer_engine_cu13==$TE" "transformer_engine==$TE"
  pip download -q --no-deps "${py[@]}" -d .te/build setuptools wheel ninja einops packaging
  # pip cannot download the extension's sdist without building its metadata (needs CUDA torch).
  url=$(curl -s https://pypi.org/simple/transformer-engine-torch/ \
        | grep -o "https://[^\"#]*transformer_engine_torch-$TE.tar.gz" | head -n 1)
  curl -sLo ".te/build/transformer_engine_torch-$TE.tar.gz" "$url"
  cp ".te/transformer_engine-$TE-py3-none-any.whl" .te/build/
  (cd .te && sha256sum "$CORE" > build/core.sha256 && rm -f parts/* && split -b 58000000 -d "$CORE" parts/core.)
  ls -l .te/parts .te/build ;;
receive)
  mkdir -p "$STORE"
  for part in .te/parts/core.* .te/build/*; do [ -e "$part" ] && cp -f "$part" "$STORE/"; done
  ls -l "$STORE" ;;
install)
  cat "$STORE"/core.[0-9]* > "/tmp/$CORE"
  (cd /tmp && sha256sum -c "$STORE/core.sha256")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "/tmp/$CORE" "$STORE/transformer_engine-$TE-py3-none-any.whl" "$STORE"/einops-*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/te-build \
    "$STORE"/setuptools-*.whl "$STORE"/wheel-*.whl "$STORE"/ninja-*.whl "$STORE"/packaging-*.whl
  check() { PYTHONPATH=$SITE:/tmp/site:${PYTHONPATH:-} python3 -c "import transformer_engine.pytorch as te; print('transformer_engine', te.__version__ if hasattr(te, '__version__') else '', 'imports')"; }
  # An extension an earlier call built on this image (its $OUT, carried back in .te/build) saves
  # the two-minute build, if it still imports beside this torch; otherwise it is built here.
  if ls "$STORE"/transformer_engine_torch*.so > /dev/null 2>&1; then
    cp "$STORE"/transformer_engine_torch*.so "$SITE/"
    if check; then echo "transformer_engine_torch: the one built earlier on this image"; exit 0; fi
    rm -f "$SITE"/transformer_engine_torch*.so
  fi
  rm -rf /tmp/te-src && mkdir /tmp/te-src && tar xzf "$STORE/transformer_engine_torch-$TE.tar.gz" -C /tmp/te-src
  cd "/tmp/te-src/transformer_engine_torch-$TE"
  start=$(date +%s)
  # The image's CUDA (/usr/local/cuda, nvcc 13.0), not the nvidia-* wheels' headers: on 2026-12-03
  # the cu13 runtime wheel's cuda_runtime.h included crt/host_config.h, which no wheel there has.
  PATH=/tmp/te-build/bin:$PATH PYTHONPATH=/tmp/te-build:$SITE:${PYTHONPATH:-} \
    NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_BUILD_USE_NVIDIA_WHEELS=${NVTE_BUILD_USE_NVIDIA_WHEELS:-0} \
    MAX_JOBS=$(nproc) python3 setup.py build_ext --inplace > /tmp/te-build.log 2>&1 \
    || { tail -n 40 /tmp/te-build.log; exit 1; }
  cp transformer_engine_torch*.so "$SITE/"
  echo "built transformer_engine_torch in $(( $(date +%s) - start )) s"
  # back with the call's output, to travel in .te/build next time (a file comes back up to 16 MiB)
  if [ -n "${OUT:-}" ] && [ "$(stat -c %s transformer_engine_torch*.so)" -le 16777216 ]; then
    cp transformer_engine_torch*.so "$OUT/"
  fi
  # TE's recipes import pydantic, which travels in .whl (installed into /tmp/site by lanes.sh)
  check ;;
*)
  echo "usage: $0 fetch|receive|install" >&2; exit 2 ;;
esac
