#!/usr/bin/env bash
# Model-Optimizer's megatron lanes and the HF lanes on the GPU machine, spread over back-to-back
# device calls while the machine is held (its /tmp survives between them): Transformer Engine's
# core wheel travels one part a call beside the call's own work.
#
#   here:  bash scripts/gpu/modelopt_lane.sh prepare; bash scripts/gpu/transformer_engine.sh fetch
#          bash scripts/gpu/lanes.sh split-te 17000000 59000000   # .te/parts: a small first part, 4 large, a fifth small
#          bash scripts/gpu/lanes.sh prepare-bridge      # .whl-bridge: megatron-bridge's runtime
#          bash scripts/gpu/lanes.sh prepare-nvrx NVRX_GIT_DIR   # + nvidia-resiliency-ext 0.6.0
#          bash scripts/gpu/lanes.sh prepare-apex APEX_GIT_DIR 25.09   # .apex: apex's wgrad extension's sources
#   there: bash scripts/gpu/lanes.sh setup [ext] [te] [apex] [captured] [native-env] [nodes] [lane NAME LANES ARGS...] ...
#          the first call carries .whl .modelopt .te/parts/core.00, each later call one more part,
#          the sixth core.05, .whl-bridge, .te/build, .apex and .whl-tools (py-spy) (a call
#          carries 64 MiB with the checkout); `te` (once every part is there) joins, installs and
#          builds Transformer Engine. (.whl, .whl-tools, .whl-bridge, .te, .modelopt: in .git/info/exclude.)
#
# Each `lane NAME LANES ARGS...` runs scripts/gpu/modelopt_lane.py on the copied checkout (/tmp/mo)
# with the PYTHONPATH its lanes need and packs its output folder into $OUT/NAME.tgz (report.txt
# also as $OUT/NAME-report.txt). modelopt's CUDA extensions are built once into /tmp/torch-ext by
# `ext` (three at once) and shared by every way (--torch-extensions /tmp/torch-ext).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${OUT:-lanes-out}
MO=/tmp/mo
EXT=/tmp/torch-ext
PIP=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
HF=/tmp/site                       # the image's missing wheels, megatron left out
MCORE=/tmp/site-mcore:/tmp/te-site:/tmp/site   # + megatron-core, TE (the pools' models need TE)
APEX=/tmp/apex-ext                 # apex's fused_weight_gradient_mlp_cuda, built by `apex`
BRIDGE=$APEX:/tmp/site-energon:/tmp/site-bridge:/tmp/site-mcore:/tmp/te-site:/tmp/site   # + megatron-bridge, TE, apex's extension
export PATH=/tmp/site-tools/bin:$PATH   # py-spy, for the lane's stacks (lane_processes.py)

stamp() { echo "[lanes $(date -u +%T)] $*"; }

setup() {
  [ -d /tmp/site ] || "${PIP[@]}" --target /tmp/site $(ls .whl/*.whl | grep -v -E '/megatron_(core|bridge)-')
  if [ ! -d /tmp/site-mcore ]; then
    "${PIP[@]}" --target /tmp/site-mcore .whl/megatron_core-*.whl
    # megatron-bridge's initialize_megatron runs `make -C megatron/core/datasets` (the source
    # tree's Makefile, building helpers_cpp); the wheel ships helpers_cpp built and no Makefile.
    printf 'default:\n\t@ls helpers_cpp*.so > /dev/null\n' > /tmp/site-mcore/megatron/core/datasets/Makefile
  fi
  [ -d /tmp/site-bridge ] || "${PIP[@]}" --target /tmp/site-bridge .whl/megatron_bridge-*.whl
  # megatron-bridge's runtime (energon, puzzletron's and nvidia-resiliency-ext's needs, diffusers)
  # in a folder of its own: energon's wheel has a `megatron/` too, and pip --target --upgrade
  # replaces a top-level folder whole (it removed megatron/bridge once).
  if [ -d .whl-bridge ] && [ ! -d /tmp/site-energon ]; then
    "${PIP[@]}" --target /tmp/site-energon .whl-bridge/*.whl
  fi
  if [ -d .whl-tools ] && [ ! -d /tmp/site-tools ]; then
    "${PIP[@]}" --target /tmp/site-tools .whl-tools/*.whl
  fi
  [ -d $MO ] || cp -a .modelopt $MO
  if [ -d .te ]; then bash scripts/gpu/transformer_engine.sh receive | tail -n 12; fi
  stamp "setup done; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
}

ext() {  # each extension in its own process: torch locks per name, so they build side by side
  mkdir -p $EXT
  local start=$SECONDS
  for fn in get_cuda_ext get_cuda_ext_fp8 get_cuda_ext_mx; do
    PYTHONPATH=$MO:$HF TORCH_EXTENSIONS_DIR=$EXT python3 -c \
      "import modelopt.torch.quantization.extensions as e; print(e.$fn(raise_if_failed=True))" \
      > /tmp/ext-$fn.log 2>&1 &
  done
  wait || true
  tail -n 2 /tmp/ext-*.log
  stamp "extensions in $EXT after $((SECONDS - start)) s: $(ls $EXT | tr '\n' ' ')"
}

te() {
  if ! ls /tmp/te-site/transformer_engine_torch*.so > /dev/null 2>&1; then
    bash scripts/gpu/transformer_engine.sh install 2>&1 | grep -v -i warning
  fi
  stamp "Transformer Engine ready"
}

apex() {  # apex's gradient-accumulation extension, from .apex (prepare-apex), once a machine:
  # megatron-bridge's models ask for gradient_accumulation_fusion, and megatron-core's
  # ColumnParallelLinear then needs fused_weight_gradient_mlp_cuda (NeMo's container has apex;
  # this image has not: without it every distill.py step fails, 2026-12-04). One an earlier call
  # built on this image (its $OUT, put into .apex) is used if it imports beside this torch.
  local check="import torch, fused_weight_gradient_mlp_cuda as m; print(m.__file__)"
  if [ -f .apex/fused_weight_gradient_mlp_cuda.so ] && [ ! -d $APEX ]; then
    mkdir -p $APEX && cp .apex/fused_weight_gradient_mlp_cuda.so $APEX/
    PYTHONPATH=$APEX python3 -c "$check" > /dev/null 2>&1 || rm -f $APEX/*.so
  fi
  if ! ls $APEX/fused_weight_gradient_mlp_cuda*.so > /dev/null 2>&1; then
    local start=$SECONDS
    mkdir -p $APEX "$OUTDIR"
    TORCH_CUDA_ARCH_LIST=9.0 python3 - <<'EOF' > "$OUTDIR/apex-build.log" 2>&1 || { tail -n 30 "$OUTDIR/apex-build.log"; return 1; }
import torch.utils.cpp_extension as ext
megatron = ".apex/csrc/megatron/fused_weight_gradient_dense"
ext.load("fused_weight_gradient_mlp_cuda", build_directory="/tmp/apex-ext",
         sources=[megatron + ".cpp", megatron + "_cuda.cu", megatron + "_16bit_prec_cuda.cu"],
         extra_include_paths=[".apex/csrc"], extra_cflags=["-O3"],
         extra_cuda_cflags=["-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                            "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math"])
EOF
    stamp "apex's extension built in $((SECONDS - start)) s (apex $(cat .apex/COMMIT))"
    cp $APEX/fused_weight_gradient_mlp_cuda.so "$OUTDIR/"   # to travel in .apex next time
  fi
  PYTHONPATH=$APEX python3 -c "$check"
}

lane() {  # NAME LANES [modelopt_lane.py options]
  local name=$1 lanes=$2 path=$HF
  shift 2
  case $lanes in bridge*) path=$BRIDGE ;; pools*) path=$MCORE ;; esac
  local out=/tmp/lane-$name
  rm -rf $out && mkdir -p $out "$OUTDIR"
  stamp "lane $name: $lanes $*"
  PYTHONPATH=$path PYTHONUNBUFFERED=1 timeout 590 python3 scripts/gpu/modelopt_lane.py \
    --checkout $MO --lanes "$lanes" --out $out "$@" > $out/lane.log 2>&1 || echo "lane $name: exit $?"
  grep -E '^(== |   [a-z]+: )' $out/lane.log || true
  [ -f $out/report.txt ] && cp $out/report.txt "$OUTDIR/$name-report.txt" && sed -n '1,60p' $out/report.txt
  tar czf "$OUTDIR/$name.tgz" -C /tmp "lane-$name"
}

probe() {  # NAME PYTHONPATH COMMAND...: a probe's output to $OUT/NAME.log (and its tail here)
  local name=$1 path=$2
  shift 2
  mkdir -p "$OUTDIR"
  stamp "probe $name: $*"
  PYTHONPATH=$path PYTHONUNBUFFERED=1 timeout 400 "$@" > "$OUTDIR/$name.log" 2>&1 || echo "probe $name: exit $?"
  tail -n 25 "$OUTDIR/$name.log"
}

prepare_bridge() {  # here: what megatron-bridge 0.6.2's distill steps import that the image lacks
  local plat=(--python-version 3.12 --implementation cp --platform any --platform manylinux_2_17_x86_64
              --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
              --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d .whl-bridge \
    typeguard immutabledict lru-dict termcolor megatron-energon braceexpand filetype mfusepy \
    multi-storage-client rapidyaml webdataset jmespath jsonschema jsonschema-specifications \
    referencing rpds-py opentelemetry-api importlib-metadata xattr cffi pycparser wcmatch bracex \
    lark prettytable wcwidth pyroute2 "tzdata<2026" deprecation diffusers nvidia-resiliency-ext defusedxml
  python3 -m pip wheel -q --no-deps -w .whl-bridge fire   # an sdist only: pure Python
  du -sh --apparent-size .whl-bridge
}

prepare_nvrx() {  # here: nvidia-resiliency-ext 0.6.0, which megatron-core 0.19.2 requires
  # (PyPI's newest wheel is 0.4.1), built from its release tag for Python 3.12 without its
  # optional CUPTI straggler extension (STRAGGLER_DET_SKIP_CUPTI_EXT_BUILD), into .whl-bridge.
  local src=$1 py=${PY312:-python3.12} work
  work=$(mktemp -d)
  git clone -q "$src" "$work/src" && git -C "$work/src" checkout -q v0.6.0
  (cd "$work/src" && STRAGGLER_DET_SKIP_CUPTI_EXT_BUILD=1 POETRY_DYNAMIC_VERSIONING_BYPASS=0.6.0 \
     "$py" -m pip wheel -q --no-deps -w "$work/wheel" .)
  rm -f .whl-bridge/nvidia_resiliency_ext-*.whl
  cp "$work"/wheel/nvidia_resiliency_ext-0.6.0-*.whl .whl-bridge/
  rm -rf "$work"
  ls -l .whl-bridge/nvidia_resiliency_ext-*
}

prepare_apex() {  # here: the sources of apex's fused_weight_gradient_mlp_cuda (apex's setup.py
  # builds it from these three files) from a clone or mirror of NVIDIA/apex, into .apex
  local src=$1 tag=$2
  rm -rf .apex && mkdir .apex
  # (csrc/compat.h: the headers' own include, in releases up to 25.09)
  git --git-dir="$src" archive "$tag" $(git --git-dir="$src" ls-tree -r --name-only "$tag" -- \
    LICENSE csrc/type_shim.h csrc/compat.h csrc/megatron/fused_weight_gradient_dense.cpp \
    csrc/megatron/fused_weight_gradient_dense_cuda.cu \
    csrc/megatron/fused_weight_gradient_dense_16bit_prec_cuda.cu) | tar -x -C .apex
  echo "$tag $(git --git-dir="$src" rev-parse "$tag^{commit}")" > .apex/COMMIT
  du -sh --apparent-size .apex
}

split_te() {  # FIRST_BYTES PART_BYTES: .te/parts as a first part of FIRST_BYTES, the rest in PART_BYTES
  # pieces (the last one smaller: room beside it for .whl-bridge)
  local core=(.te/transformer_engine_cu13-*.whl) first=$1 part=$2
  rm -f .te/parts/core.*
  head -c "$first" "$core" > .te/parts/core.00
  tail -c +$(( first + 1 )) "$core" | split -b "$part" -d --numeric-suffixes=1 - .te/parts/core.
  ls -l .te/parts
}

[ $# -gt 0 ] || { echo "usage: $0 setup|ext|te|lane NAME LANES ARGS...|split-te BYTES ..." >&2; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
  setup) setup; shift ;;
  ext) ext; shift ;;
  te) te; shift ;;
  apex) apex; shift ;;
  # the product's own H200 probes: kept device queries + torch.compile in forked steps; which
  # variables the stack's native code reads at import; a 2-node torchrun job plain vs forked
  captured) probe captured_cuda "" python3 scripts/gpu/captured_cuda.py; shift ;;
  alloc-conf) probe alloc_conf "" python3 scripts/gpu/alloc_conf.py; shift ;;
  captured-mcore) probe captured_cuda_mcore $MCORE python3 scripts/gpu/captured_cuda.py \
                    --modules torch,torch._dynamo,megatron.core; shift ;;
  native-env) probe native_env_reads $MO:$MCORE bash scripts/native_env_reads.sh \
                torch,transformer_engine.pytorch,megatron.core,modelopt.torch,transformers; shift ;;
  nodes) probe nodes_nccl $MCORE python3 scripts/bench_nodes.py 3 --nproc 1 --backend nccl \
           --modules torch,megatron.core
         probe nodes_gloo $MCORE python3 scripts/bench_nodes.py 3 --nproc 1 --backend gloo \
           --modules torch,megatron.core; shift ;;
  # who sets TF_* in a megatron_bridge test's process (its imports, as pytest makes them)
  who-sets) probe who_sets_tf $MO/tests:$MO:$BRIDGE python3 scripts/gpu/who_reads.py 'TF_*' \
              torch,transformers,transformer_engine.pytorch,megatron.core,megatron.bridge,modelopt.torch,_test_utils.torch.transformers_models,_test_utils.torch.puzzletron.utils,modelopt.torch.puzzletron.anymodel
            env | grep '^TF_' || echo "no TF_* in the call's environment"; shift ;;
  # a torch.compile'd training loop's steady state, plainly and forked (each an empty inductor
  # and triton cache): spec_compile's forked step trained ~30% slower (2026-12-04)
  compile-steady)
    for way in plain forked; do
      run=(python3 scripts/gpu/compile_steady.py 300)
      [ $way = forked ] && run=(python3 -m preload_launcher.cli run -v --no-daemon
        --preload torch,transformers,accelerate,datasets,modelopt.torch -- "${run[@]}")
      rm -rf /tmp/cs-$way && mkdir -p /tmp/cs-$way
      probe compile_steady_$way $MO:$HF env TORCHINDUCTOR_CACHE_DIR=/tmp/cs-$way/inductor \
        TRITON_CACHE_DIR=/tmp/cs-$way/triton "${run[@]}"
    done; shift ;;
  # where the HF lanes' preload time goes (2026-12-05: 33.5 s, against 20.1 s on 2026-12-03): the
  # same imports plainly, then a zygote's preload from an empty launcher cache with each module's
  # time (doctor), then both again on a warm page cache
  preload-time)
    mods=torch,transformers,accelerate,datasets,modelopt.torch
    for pass in 1 2; do
      probe import_plain_$pass $MO:$HF python3 -c "import time; t = time.perf_counter()
import ${mods//,/, }
print(f'plain import of $mods: {time.perf_counter() - t:.1f} s')"
      rm -rf /tmp/pl-cache-$pass
      probe preload_doctor_$pass $MO:$HF env PRELOAD_LAUNCHER_CACHE_DIR=/tmp/pl-cache-$pass \
        python3 -m preload_launcher.cli doctor --preload $mods
    done; shift ;;
  # the same preload sampled (the zygote and its scouts: an empty cache scouts every entry),
  # then again on the cache it filled (no entry scouted); what one driver probe costs (the
  # zygote runs one after every import statement while it preloads)
  preload-profile)
    mods=torch,transformers,accelerate,datasets,modelopt.torch
    rm -rf /tmp/pl-cache-p && mkdir -p "$OUTDIR"
    probe preload_sampled $MO:$HF env PRELOAD_LAUNCHER_CACHE_DIR=/tmp/pl-cache-p \
      py-spy record --subprocesses --idle --format raw --rate 100 -o "$OUTDIR/preload_samples.txt" \
      -- python3 -m preload_launcher.cli doctor --preload $mods
    gzip -9f "$OUTDIR/preload_samples.txt"
    probe preload_known $MO:$HF env PRELOAD_LAUNCHER_CACHE_DIR=/tmp/pl-cache-p \
      python3 -m preload_launcher.cli doctor --preload $mods
    probe driver_probe_cost "" python3 -c "import time
from preload_launcher.cuda import DriverProbe
probe, n = DriverProbe(), 100000
t = time.perf_counter()
for _ in range(n): probe.initialized()
print(f'DriverProbe.initialized: {(time.perf_counter() - t) / n * 1e6:.2f} us a call ({probe._lib})')"
    shift ;;
  split-te) split_te "$2" "$3"; shift 3 ;;
  prepare-bridge) prepare_bridge; shift ;;
  prepare-nvrx) prepare_nvrx "$2"; shift 2 ;;  # a clone or mirror of NVIDIA/nvidia-resiliency-ext
  prepare-apex) prepare_apex "$2" "$3"; shift 3 ;;  # a clone or mirror of NVIDIA/apex, its tag
  lane)  # everything up to the next `--` belongs to this lane
    shift; args=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    lane "${args[@]}" ;;
  *) echo "unknown part: $1" >&2; exit 2 ;;
  esac
done
