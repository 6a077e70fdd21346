#!/usr/bin/env bash
# GPU check of the gptqmodel backend (GPTQ + AWQ) against anyquant's reference backend on CUDA:
# logits compared, decode tokens/s for both, one summary table. Offline, under 5 minutes.
#
#   bash bench/gpu_gptq.sh [bench/gpu_gptq.py options]   # on the CUDA machine, from the repo root
#   bash bench/gpu_gptq.sh --prepare                     # on a machine WITH network, beforehand
#   bash bench/gpu_gptq.sh --cross-build                 # then, optionally: Marlin prebuilt for the H200 image
#
# Exit: 0 pass, 1 fail, 3 "no CUDA GPU: skipped", 4 environment incomplete.
#
# Python: $PYTHON, else .venv/bin/python when it has CUDA torch (a venv built by `make install` on
# the GPU machine), else python3 (a CUDA image's own torch). anyquant and its GPTQ/AWQ plugins are
# installed from this source tree into a scratch folder when they do not import; GPTQModel and the
# packages it imports that such an image lacks come from the wheel bundle that `--prepare` writes
# to $ANYQUANT_GPU_WHEELS (default .cache/gpu-wheels/gptq, git-ignored: name it in the device tool's
# `carry`). Nothing is downloaded on the GPU machine.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 4
WHEELS=${ANYQUANT_GPU_WHEELS:-.cache/gpu-wheels/gptq}
SITE=${ANYQUANT_GPU_SITE:-/tmp/anyquant-gpu-site}
# tested here with these versions (the Makefile's gptqmodel pin and what it resolved to)
SDISTS="gptqmodel==7.6.0 pypcre==0.6.4 device-smi==0.5.7 tokenicer==0.0.14 logbar==0.4.15 defuser==0.0.28"
BINARIES="datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchao==0.18.0"
PYV=${GPU_PYTHON_VERSION:-3.12}  # the GPU image's Python (KINDS.md: 3.12.3)
DRY=${ANYQUANT_GPU_DRY_RUN:-}    # rehearsal without a GPU: CPU, GPTQModel's torch kernel, tiny models

if [ "${1:-}" = "--prepare" ]; then
    # The GPU image: Python 3.12, torch + triton + transformers + accelerate + safetensors + numpy,
    # no GPTQModel (device README/KINDS.md). pypcre has a C extension: build it with a local 3.12.
    if [ -z "${PY312:-}" ]; then
        for c in "python$PYV" /usr/bin/python"$PYV" "$HOME"/.pyenv/versions/"$PYV"*/bin/python; do
            if "$c" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$PYV'" 2>/dev/null; then PY312=$c; break; fi
        done
    fi
    if [ -z "${PY312:-}" ]; then echo "--prepare needs a python$PYV (set PY312)"; exit 4; fi
    mkdir -p "$WHEELS/lib"
    "$PY312" -m pip wheel -q --no-deps -w "$WHEELS" $SDISTS || exit 4
    "$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" $BINARIES || exit 4
    # pypcre links libpcre2-8.so.0; carry one in case the image has none
    for lib in /lib/x86_64-linux-gnu/libpcre2-8.so.0 /usr/lib/x86_64-linux-gnu/libpcre2-8.so.0; do
        [ -e "$lib" ] && cp -L "$lib" "$WHEELS/lib/" && break
    done
    # fallback copies of anyquant itself (the GPU run installs from the source tree first)
    mkdir -p "$WHEELS/anyquant"
    rm -f "$WHEELS"/anyquant/*.whl
    "$PY312" -m pip wheel -q --no-deps -w "$WHEELS/anyquant" ./core ./plugins/gptq ./plugins/awq || exit 4
    rm -rf core/build plugins/gptq/build plugins/awq/build
    du -sh "$WHEELS"
    ls "$WHEELS" "$WHEELS/anyquant"
    exit 0
fi

if [ "${1:-}" = "--cross-build" ]; then
    # GPTQModel's Marlin fp16 extension compiled here, without a GPU, for the H200 image (bench/cuda_toolchain.sh;
    # after --prepare, whose GPTQModel wheel it installs). The result, .cache/marlin-ext, travels with `carry`
    # and is loaded instead of building Marlin there.
    X=$(pwd)/.cache/cuda-xbuild
    mkdir -p "$X/marlin" .cache/marlin-ext
    source bench/cuda_toolchain.sh
    cuda_toolchain "$X" || exit 4
    [ -d "$WHEELS/lib" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(cd "$WHEELS/lib" && pwd)"
    "$XPY" -m pip install -q --find-links "$WHEELS" "$WHEELS"/gptqmodel-*.whl || exit 4
    exec nice -n 19 "$XPY" bench/gpu_gptq.py --cross-build "$X/marlin" .cache/marlin-ext
fi

export TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

has_torch() { "$1" -c "import torch" 2>/dev/null; }
candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
[ -x .venv/bin/python ] && candidates+=(.venv/bin/python)
for p in python3 python; do command -v "$p" >/dev/null 2>&1 && candidates+=("$(command -v "$p")"); done
PY=""
for p in "${candidates[@]}"; do  # the first with CUDA torch
    if has_cuda_torch "$p"; then PY=$p; break; fi
done
if [ -z "$PY" ]; then
    if [ -n "$DRY" ]; then
        for p in "${candidates[@]}"; do if has_torch "$p"; then PY=$p; break; fi; done
        [ -z "$PY" ] && { echo "environment incomplete: no python with torch"; exit 4; }
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
        echo "environment incomplete: a GPU is visible but no python here has CUDA torch (${candidates[*]})"
        exit 4
    else
        echo "no CUDA GPU: skipped"
        exit 3
    fi
fi
echo "python: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"

# cheap first look (find_spec); the full import (GPTQModel ~10 s) only after an install
imports_ok() {
    "$PY" -c "import importlib.util as u, anyquant, anyquant_gptq, anyquant_awq
assert u.find_spec('gptqmodel') and {p.name for p in anyquant.list_plugins()} >= {'anyquant-gptq', 'anyquant-awq'}
${1:+import gptqmodel}" >/dev/null 2>&1
}

if [ -d "$WHEELS/lib" ]; then export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(cd "$WHEELS/lib" && pwd)"; fi
if ! imports_ok; then
    t0=$(date +%s)
    rm -rf "$SITE"
    mkdir -p "$SITE"
    wheels=$(ls "$WHEELS"/*.whl 2>/dev/null)
    # anyquant from this tree (setuptools from the image; no download), GPTQModel & co. from the bundle
    if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" \
        ./core ./plugins/gptq ./plugins/awq $wheels; then
        echo "installing anyquant from the source tree failed; using the bundle's anyquant wheels"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            "$WHEELS"/anyquant/*.whl $wheels || true
    fi
    rm -rf core/build plugins/gptq/build plugins/awq/build
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed into $SITE in $(($(date +%s) - t0)) s"
    if ! imports_ok full; then
        echo "environment incomplete: anyquant + plugins + gptqmodel do not import with $PY:"
        "$PY" -c "import anyquant, anyquant_gptq, anyquant_awq, gptqmodel; print(sorted(p.name for p in anyquant.list_plugins()))" 2>&1 | tail -5
        echo "(run 'bash bench/gpu_gptq.sh --prepare' on a machine with network and carry $WHEELS)"
        exit 4
    fi
fi

# GPTQModel JIT-compiles Marlin with nvcc and ninja (the ninja of a venv sits beside its python)
PATH="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
fi
[ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda

# a prebuilt Marlin (--cross-build, .cache/marlin-ext carried): loaded in every process, so GPTQModel builds nothing
MARLIN_LIB=$(pwd)/.cache/marlin-ext/gptqmodel_marlin_fp16_ops.so
if [ -f "$MARLIN_LIB" ] && [ -z "$DRY" ]; then
    if err=$("$PY" -c "import sys, torch; torch.ops.load_library(sys.argv[1])
assert hasattr(torch.ops.gptqmodel_marlin_fp16, 'gptq_marlin_gemm_fp16')" "$MARLIN_LIB" 2>&1); then
        export ANYQUANT_MARLIN_PREBUILT="$MARLIN_LIB"
        echo "Marlin: prebuilt ($(head -1 "$(dirname "$MARLIN_LIB")/BUILD-INFO" 2>/dev/null))"
    else
        echo "Marlin: the prebuilt library does not load here, JIT build instead: $(echo "$err" | tail -1)"
    fi
fi

t0=$(date +%s)
timeout 590 "$PY" bench/gpu_gptq.py ${DRY:+--cpu-dry-run} "$@"
rc=$?
echo "bench/gpu_gptq.sh: exit $rc after $(($(date +%s) - t0)) s of checks"
exit $rc
