# Sourced by bench/gpu_exl3.sh and bench/gpu_gptq.sh for `--cross-build`: CUDA extensions compiled on a machine
# without a GPU, for the device tool's H200 image (CPython 3.12, torch 2.11.0 built for CUDA 13.0, sm_90), so
# that a GPU call spends its minutes on checks, not on nvcc. Needs a package index and a CPython 3.12 (PY312).
#
# cuda_toolchain DIR: a venv in DIR/venv with that torch, nvcc 13.0 and the CUDA headers and libraries from
# PyPI (cuda-toolkit), ninja; exports CUDA_HOME, TORCH_CUDA_ARCH_LIST (9.0 unless set), MAX_JOBS, PATH and XPY
# (the venv's python).
cuda_toolchain() {
    local dir=$1 py cuda
    py="$dir/venv/bin/python"
    if [[ ! -x "$py" ]]; then
        "${PY312:-python3.12}" -m venv "$dir/venv" || return 1
    fi
    # nvcc 13.0 needs the nvvm and crt of its own release (pip would pick the newest, whose PTX it rejects)
    "$py" -m pip install -q torch==2.11.0 "cuda-toolkit[nvcc,cudart,cublas,cccl,curand]==13.0.2" \
        nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 ninja || return 1
    cuda=$("$py" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13"))') || return 1
    ln -sfn lib "$cuda/lib64" # torch's extension builder links from CUDA_HOME/lib64
    local l # ... with -lcudart (-lcublas ...): the wheels ship only the versioned names
    for l in libcudart libcublas libcublasLt libcurand; do
        [[ -e "$cuda/lib/$l.so" ]] || ln -s "$(cd "$cuda/lib" && ls "$l".so.* | head -1)" "$cuda/lib/$l.so"
    done
    export CUDA_HOME="$cuda" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
    export PATH="$dir/venv/bin:$cuda/bin:$PATH" XPY="$py"
}
