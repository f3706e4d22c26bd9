#!/usr/bin/env bash
# GPU offload (--gpu-layers) end to end on a GPU machine; docs/backends.md, "GPU offload".
#
#   benchmarks/device_check.sh
#
# 1. builds llama-cpp-python with CUDA into a venv of its own (make install LLAMA_BACKEND=cuda VENV=...;
#    needs nvcc, and network access for pip once: the wheel is kept in ~/.cache/meshnet/llama-wheels),
# 2. lists the GPUs (nvidia-smi -L),
# 3. benchmarks/device_check.py: the bundled model whole (as meshnet serve runs it) and as a 2-shard
#    route, both --gpu-layers all: greedy tokens identical (route == serve), decode tok/s of each,
# 4. certifies the llama family on the GPU: tests/backends/test_certification.py with every shard and
#    the whole model offloaded (MESHNET_TEST_GPU_LAYERS; needs transformers in the venv and the
#    certification converter, fetched once into ~/.cache/meshnet/certify).
#
# Everything printed also goes to benchmarks/device_check.out (for benchmarks/RESULTS.md). Each step is
# timed and bounded with timeout; a failed step is reported and the others still run; the exit status is
# 1 if any failed.
#
# Settings (environment):
#   VENV=DIR            the venv to build into / run from (default ~/.cache/meshnet/venv-cuda: outside
#                       the checkout, which git would list and the device tool would copy)
#   SKIP_BUILD=1        use VENV as it is (no build)
#   GPU_LAYERS=all      what steps 3 and 4 offload; GPU_LAYERS=0 runs them on the CPU, which is how this
#                       script is checked on a machine without a GPU:
#                       SKIP_BUILD=1 VENV=.venv GPU_LAYERS=0 benchmarks/device_check.sh
#   CUDA_ARCHS=90       the GPUs' compute capability to build for (default: nvidia-smi's, e.g. 90 for
#                       H100/H200); one architecture builds in minutes, all of them in most of an hour
#   OUT=benchmarks/device_check.out
#   BUILD_TIMEOUT=3600 CHECK_TIMEOUT=600 CERTIFY_TIMEOUT=1200 (seconds)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-$HOME/.cache/meshnet/venv-cuda}
SKIP_BUILD=${SKIP_BUILD:-0}
GPU_LAYERS=${GPU_LAYERS:-all}
OUT=${OUT:-benchmarks/device_check.out}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-3600}
CHECK_TIMEOUT=${CHECK_TIMEOUT:-600}
CERTIFY_TIMEOUT=${CERTIFY_TIMEOUT:-1200}

exec > >(tee "$OUT") 2>&1
echo "device check, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null || echo '?'): VENV=$VENV" \
    "SKIP_BUILD=$SKIP_BUILD GPU_LAYERS=$GPU_LAYERS"

failed=()
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

if [[ $GPU_LAYERS != 0 ]]; then
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
if [[ ! -x $VENV/bin/python ]]; then
    echo "device check: no venv at $VENV (the build failed, or give VENV=DIR)"
    exit 1
fi

step route-vs-serve "$CHECK_TIMEOUT" "$VENV/bin/python" -m benchmarks.device_check --gpu-layers "$GPU_LAYERS"

layers=$GPU_LAYERS
[[ $layers == all ]] && layers=-1
step certify-llama "$CERTIFY_TIMEOUT" env MESHNET_TEST_GPU_LAYERS="$layers" "$VENV/bin/python" -m pytest -q \
    -p no:cacheprovider "tests/backends/test_certification.py::test_a_certified_family_splits_bit_identically[llama]"

if ((${#failed[@]})); then
    echo "device check: FAILED: ${failed[*]} (output in $OUT)"
    exit 1
fi
echo "device check: every step passed (output in $OUT)"
