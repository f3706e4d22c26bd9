#!/usr/bin/env bash
# GPU offload (--gpu-layers) end to end on a GPU machine; docs/backends.md, "GPU offload".
#
#   benchmarks/device_check.sh                     (a GPU machine with network: builds its own venv)
#   KIT=.device-kit benchmarks/device_check.sh     (the device machine: no network, 64 MiB per call)
#
# 1. the software: with KIT, benchmarks/device_kit.py unpack checks and installs the kit's parts (made
#    here by `python -m benchmarks.device_kit pack`: a CUDA build of llama-cpp-python, the wheels the
#    machine's Python lacks, the converter, the bundled model in pieces) for the machine's own python3,
#    and exits 3 while a part is missing (each call carries one part; a warm machine keeps the others);
#    without KIT it builds llama-cpp-python with CUDA into a venv of its own (make install
#    LLAMA_BACKEND=cuda VENV=...; needs nvcc, and network access for pip once),
# 2. lists the GPUs (nvidia-smi -L),
# 3. benchmarks/device_check.py: the bundled model whole (as meshnet serve runs it) and as a 2-shard
#    route, both --gpu-layers all: greedy tokens identical (route == serve), decode tok/s of each,
# 4. certifies the llama family on the GPU: tests/backends/test_certification.py with every shard and
#    the whole model offloaded (MESHNET_TEST_GPU_LAYERS; needs transformers and the certification
#    converter: in the kit, or fetched once into ~/.cache/meshnet/certify),
# 5. benchmarks/device_check.py --wan: bench wan's goal cell (3 seams x 20 ms) with every node offloaded,
# 6. the benchmarks named in BENCHES (default batch: 8 concurrent sessions on one route with a core per
#    node) into benchmarks/device_results.md, the format of benchmarks/RESULTS.md.
#
# Everything printed also goes to benchmarks/device_check.out (for benchmarks/RESULTS.md). Each step is
# timed and bounded with timeout; a failed step is reported and the others still run; the exit status is
# 1 if any failed, 3 if the kit is not all there yet.
#
# Settings (environment):
#   KIT=DIR             the kit's folder (its parts DIR/p1 ... DIR/pN); unpacked into UNPACK_DIR
#                       (default /tmp/meshnet-device) for PY (default python3)
#   VENV=DIR            without KIT: the venv to build into / run from (default ~/.cache/meshnet/venv-cuda:
#                       outside the checkout, which git would list and the device tool would copy)
#   SKIP_BUILD=1        use VENV as it is (no build)
#   GPU_LAYERS=all      what steps 3 to 5 offload; GPU_LAYERS=0 runs them on the CPU, which is how this
#                       script is checked on a machine without a GPU:
#                       SKIP_BUILD=1 VENV=.venv GPU_LAYERS=0 STEPS="check certify" benchmarks/device_check.sh
#   CUDA_ARCHS=90       the GPUs' compute capability to build for (default: nvidia-smi's, e.g. 90 for
#                       H100/H200); one architecture builds in minutes, all of them in most of an hour
#   BENCHES="batch"     benchmarks/run.py --only names for step 6 (empty: none)
#   OUT=benchmarks/device_check.out
#   STEPS="gpus check certify wan bench"   the steps 2 to 6 to run (a rerun on a warm machine can
#                       name one: STEPS=bench BENCHES=route)
#   BUILD_TIMEOUT=3600 CHECK_TIMEOUT=600 CERTIFY_TIMEOUT=1200 WAN_TIMEOUT=600 BENCH_TIMEOUT=900 (s)
set -euo pipefail
cd "$(dirname "$0")/.."

KIT=${KIT:-}
UNPACK_DIR=${UNPACK_DIR:-/tmp/meshnet-device}
VENV=${VENV:-$HOME/.cache/meshnet/venv-cuda}
SKIP_BUILD=${SKIP_BUILD:-0}
BENCHES=${BENCHES-batch}
GPU_LAYERS=${GPU_LAYERS:-all}
OUT=${OUT:-benchmarks/device_check.out}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-3600}
CHECK_TIMEOUT=${CHECK_TIMEOUT:-600}
CERTIFY_TIMEOUT=${CERTIFY_TIMEOUT:-1200}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-900}
WAN_TIMEOUT=${WAN_TIMEOUT:-600}
STEPS=${STEPS:-gpus check certify wan bench}

if [[ -n $KIT ]]; then  # before the log: a call that only brings a part prints one line
    PY=${PY:-python3}
    rc=0
    $PY -m benchmarks.device_kit unpack --kit "$KIT" --into "$UNPACK_DIR" || rc=$?
    [[ $rc -eq 0 ]] || exit "$rc"
    # the machine's CUDA libraries (cuBLAS, the runtime) for the kit's llama.cpp, wherever its Python keeps them
    cuda_libs=$($PY -c 'import glob, os, site
dirs = {os.path.dirname(p) for base in site.getsitepackages() + ["/usr/local/cuda"]
        for name in ("libcublas.so.*", "libcudart.so.*") for p in glob.glob(f"{base}/**/{name}", recursive=True)}
print(":".join(sorted(dirs)))')
    export LD_LIBRARY_PATH=$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PYTHONPATH=$UNPACK_DIR/site:$PWD/src:$PWD XDG_CACHE_HOME=$UNPACK_DIR/cache
    SKIP_BUILD=1
    # another image's torch and transformers may warn where ours do not: printed, not failures
    warnings=(-W default)
    # Meshnet's own extension (optional: without it shards run the same callback in Python)
    $PY setup.py -q build_ext --inplace >/dev/null || echo "device check: meshnet's C extension did not build"
else
    PY=$VENV/bin/python
    warnings=()
fi

exec > >(tee "$OUT") 2>&1
echo "device check, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null || echo '?'): KIT=$KIT" \
    "PY=$PY SKIP_BUILD=$SKIP_BUILD GPU_LAYERS=$GPU_LAYERS STEPS='$STEPS' BENCHES='$BENCHES'"
[[ -z $KIT ]] || echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

failed=()
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
# step NAME SECONDS COMMAND...: run it under timeout, say how long it took and how it ended.
step() {
    local name=$1 limit=$2 began=$SECONDS rc=0
    shift 2
    echo "== $name (at most ${limit}s): $*"
    timeout --kill-after=30 "$limit" "$@" || rc=$?
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        echo "== $name: TIMED OUT after $((SECONDS - began))s"
    else
        echo "== $name: exit $rc in $((SECONDS - began))s"
    fi
    [[ $rc -eq 0 ]] || failed+=("$name")
    return 0
}

if [[ $GPU_LAYERS != 0 ]] && wanted gpus; then
    step gpus 30 nvidia-smi -L
fi

if [[ $SKIP_BUILD != 1 ]]; then
    if ! command -v nvcc >/dev/null; then
        echo "device check: nvcc is not on PATH; install the CUDA toolkit (or add /usr/local/cuda/bin to PATH)," \
            "or give SKIP_BUILD=1 VENV=DIR for a venv that already has a CUDA build"
        exit 1
    fi
    CUDA_ARCHS=${CUDA_ARCHS:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d '. ')}
    step build "$BUILD_TIMEOUT" make install LLAMA_BACKEND=cuda CUDA_ARCHS="$CUDA_ARCHS" VENV="$VENV"
fi
if [[ -z $KIT && ! -x $PY ]]; then
    echo "device check: no venv at $VENV (the build failed, or give VENV=DIR)"
    exit 1
fi

if wanted check; then
    step route-vs-serve "$CHECK_TIMEOUT" "$PY" -m benchmarks.device_check --gpu-layers "$GPU_LAYERS"
fi

if wanted certify; then
    layers=$GPU_LAYERS
    [[ $layers == all ]] && layers=-1
    step certify-llama "$CERTIFY_TIMEOUT" env MESHNET_TEST_GPU_LAYERS="$layers" "$PY" -m pytest -q \
        -p no:cacheprovider "${warnings[@]}" \
        "tests/backends/test_certification.py::test_a_certified_family_splits_bit_identically[llama]"
fi

if wanted wan; then
    step wan "$WAN_TIMEOUT" "$PY" -m benchmarks.device_check --wan --gpu-layers "$GPU_LAYERS"
fi

if wanted bench && [[ -n $BENCHES ]]; then
    only=()
    for name in $BENCHES; do only+=(--only "$name"); done
    step benchmarks "$BENCH_TIMEOUT" "$PY" benchmarks/run.py "${only[@]}" --out benchmarks/device_results.md
fi

if ((${#failed[@]})); then
    echo "device check: FAILED: ${failed[*]} (output in $OUT)"
    exit 1
fi
echo "device check: every step passed (output in $OUT)"
