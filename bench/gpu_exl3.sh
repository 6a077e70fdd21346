#!/usr/bin/env bash
# GPU checks of anyquant's EXL3 plugin against exllamav3 (run once, 2026-12-04: the extension build did not finish;
# it is prebuilt since: --cross-build).
#
#   bench/gpu_exl3.sh [--quick] [--deadline SECONDS] [other bench/gpu_exl3.py options]
#   bench/gpu_exl3.sh --fetch-wheels     (on a machine with a package index: wheels for a GPU box without one)
#   bench/gpu_exl3.sh --cross-build      (then, no GPU needed: exllamav3's CUDA extension prebuilt for the H200)
#
# Runs from the repository root, offline. Python: .venv/bin/python when it sees a CUDA GPU, else python3 (a
# GPU image's own torch). anyquant and the EXL3 plugin come from the source tree (PYTHONPATH); exllamav3 and
# its missing dependencies are installed from .cache/gpu-wheels into a scratch folder when the interpreter
# lacks them. exllamav3's CUDA extension: the prebuilt one in .cache/exl3-ext (--cross-build) when it imports
# here, else exllamav3 JIT-compiles it on first import into .cache/torch_extensions (TORCH_EXTENSIONS_DIR),
# resuming there when a run is cut short.
#
# Exit status: 0 all checks passed, 1 a check failed, 2 the extension build did not finish in time (run again:
# it resumes), 3 no CUDA GPU ("no CUDA GPU: skipped"). Five minutes or less once the extension is built.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
WHEELS="$REPO/.cache/gpu-wheels"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    # exllamav3's wheel (pure Python: the CUDA extension is built on the GPU machine) and the dependencies a
    # CUDA PyTorch image usually lacks, for CPython 3.12 on x86-64 Linux (PY_VERSION to change)
    mkdir -p "$WHEELS"
    exec "${PYTHON:-.venv/bin/python}" -m pip download --no-deps --only-binary=:all: \
        --python-version "${PY_VERSION:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
        exllamav3==1.6.5 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
        typing-inspection==0.4.5 typing-extensions==4.16.0 marisa-trie==1.4.1
fi

if [[ "${1:-}" == "--cross-build" ]]; then
    # exllamav3's CUDA extension compiled here, without a GPU, for the H200 image (bench/cuda_toolchain.sh).
    # The toolchain and the objects go to .cache/cuda-xbuild; the result, .cache/exl3-ext/exllamav3_ext.so,
    # travels with `carry: [".cache/exl3-ext", ...]`. The build resumes where it stopped when run again.
    X="$REPO/.cache/cuda-xbuild"
    mkdir -p "$X/exl3" "$REPO/.cache/exl3-ext"
    source "$REPO/bench/cuda_toolchain.sh"
    cuda_toolchain "$X" || exit 1
    "$XPY" -m pip install -q --no-deps "$WHEELS"/exllamav3-*.whl || exit 1
    exec nice -n 19 "$XPY" "$REPO/bench/gpu_exl3.py" --cross-build "$X/exl3" "$REPO/.cache/exl3-ext"
fi

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3; do
    if [[ -n "$cand" ]] && command -v "$cand" >/dev/null 2>&1 && has_cuda "$cand"; then PY="$cand"; break; fi
done
if [[ -z "$PY" ]]; then
    echo "no CUDA GPU: skipped"
    exit 3
fi

# exllamav3 (and pydantic, marisa-trie, ...) from the carried wheels when this interpreter lacks them
SITE="${ANYQUANT_GPU_SITE:-/tmp/anyquant-gpu-site-exl3}" # not gpu_gptq.sh's, which it wipes and rebuilds
if [[ -d "$SITE" ]]; then export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi # installed by an earlier run
missing=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("exllamav3", "pydantic", "marisa_trie") if importlib.util.find_spec(m) is None))
EOF
)
if [[ -n "$missing" ]]; then
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "missing Python packages: $missing; no wheels in $WHEELS (bench/gpu_exl3.sh --fetch-wheels)"
        exit 1
    fi
    echo "installing $(ls "$WHEELS" | wc -l) wheels from $WHEELS into $SITE (missing: $missing)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl || exit 1
    [[ ":${PYTHONPATH:-}:" == *":$SITE:"* ]] || export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO/core/src:$REPO/plugins/exl3/src${PYTHONPATH:+:$PYTHONPATH}"

# GPTQModel (for its EXL3 quantizer, a second peer's checkpoint) from gpu_gptq.sh's bundle, in a folder of its
# own that only that child process puts on its path (its dependencies stay out of exllamav3's processes)
if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("gptqmodel") else 1)' 2>/dev/null \
    && compgen -G "$WHEELS/gptq/gptqmodel-*.whl" >/dev/null; then
    GM_SITE=/tmp/anyquant-gpu-site-exl3-gptqmodel
    if [[ -d "$GM_SITE/gptqmodel" ]] || "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$GM_SITE" "$WHEELS"/gptq/*.whl; then
        export ANYQUANT_GPTQMODEL_SITE="$GM_SITE"
        [[ -d "$WHEELS/gptq/lib" ]] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$WHEELS/gptq/lib"
    fi
fi

# a prebuilt extension (bench/gpu_exl3.sh --cross-build made it on a machine without a GPU, and the call carried
# .cache/exl3-ext): exllamav3 imports a compiled exllamav3_ext module found on the path instead of building one.
# Used only when it imports next to this interpreter's torch; otherwise the JIT build below, as before.
PREBUILT="$REPO/.cache/exl3-ext"
export ANYQUANT_EXL3_EXT=jit
if [[ -f "$PREBUILT/exllamav3_ext.so" ]]; then
    if err=$(PYTHONPATH="$PREBUILT" "$PY" -c 'import torch, exllamav3_ext' 2>&1); then
        export PYTHONPATH="$PREBUILT:$PYTHONPATH" ANYQUANT_EXL3_EXT=prebuilt
        echo "exllamav3 extension: prebuilt, $PREBUILT ($(cat "$PREBUILT/BUILD-INFO" 2>/dev/null | head -1))"
    else
        echo "exllamav3 extension: the prebuilt one does not import here, JIT build instead: $(echo "$err" | tail -1)"
    fi
fi

# the extension build: cached in the repo's ignored .cache, for this GPU's architecture only, all cores
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}"
mkdir -p "$TORCH_EXTENSIONS_DIR"
rm -f "$TORCH_EXTENSIONS_DIR"/exllamav3_ext/lock # a run killed mid-build leaves it; torch would wait forever
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
    TORCH_CUDA_ARCH_LIST=$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(0); print(f"{m}.{n}")')
    export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export EXLLAMA_EXT_COMPRESS="${EXLLAMA_EXT_COMPRESS:-0}" # packed kernel images only save disk; skip the step
# torch's JIT build runs `ninja` and nvcc: the ninja of the interpreter's package, CUDA_HOME from nvcc
ninja_bin=$("$PY" -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null) && export PATH="$ninja_bin:$PATH"
# CUDA_HOME: a folder with bin/nvcc and include/cuda_runtime.h (an nvcc on PATH may be a wrapper script,
# which would make torch's own guess, dirname(dirname(nvcc)), wrong)
find_cuda_home() {
    local nv top c
    nv=$(command -v nvcc 2>/dev/null)
    top=""
    [[ -n "$nv" ]] && top=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
    [[ -n "$top" ]] && top=$(cd "$top" 2>/dev/null && pwd -P)
    for c in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "$top" "${nv:+$(dirname "$(dirname "$(readlink -f "$nv")")")}" \
        /usr/local/cuda /usr/local/cuda-[0-9]* /opt/cuda; do
        if [[ -n "$c" && -x "$c/bin/nvcc" && -f "$c/include/cuda_runtime.h" ]]; then
            echo "$c"
            return 0
        fi
    done
    return 1
}
if cuda_home=$(find_cuda_home); then
    export CUDA_HOME="$cuda_home" PATH="$cuda_home/bin:$PATH"
else
    echo "warning: no CUDA toolkit (nvcc + headers) found: exllamav3's JIT build will fail unless it is prebuilt"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1

echo "python: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"
echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS CUDA_HOME=${CUDA_HOME:-} TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR"
json=()
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then json=(--json "$OUT/gpu_exl3.json"); fi
"$PY" bench/gpu_exl3.py ${json[@]+"${json[@]}"} "$@"
