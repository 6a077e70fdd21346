"""Builds anyquant-cpu's kernel with the package: ``pip install`` / ``pip wheel`` compile both sources with torch's
C++ extension (g++, and ninja where installed) into ``anyquant_cpu/kernels/_kernels*.so``; a compiler error fails the
install with the compiler's message. Two libraries: the native one (x86-64's AVX512-VNNI / AVX2 paths chosen at run
time, scalar elsewhere) and the portable one (``-DANYQUANT_PORTABLE``: the scalar paths alone, as any architecture
compiles them; the tests check it and ``ANYQUANT_KERNELS_PORTABLE=1`` loads it)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).resolve().parent
KERNELS = Path("src/anyquant_cpu/kernels")
SOURCES = [str(KERNELS / "ggml_gemv.cpp"), str(KERNELS / "lut_gemv.cpp"), str(KERNELS / "attention.cpp")]
#: the portable library's sources: each of the above with ANYQUANT_PORTABLE defined (own objects, own flags)
PORTABLE = [
    str(KERNELS / "ggml_gemv_portable.cpp"),
    str(KERNELS / "lut_gemv_portable.cpp"),
    str(KERNELS / "attention_portable.cpp"),
]
# -fopenmp: at::parallel_for splits rows over threads only when the extension itself is compiled with OpenMP (the
# library then needs libgomp.so.1, which resolves to the copy torch has loaded: one thread pool)
CFLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
LIBRARIES = {"_kernels": SOURCES, "_kernels_portable": PORTABLE}


def digest() -> str:
    """What the libraries are built from (every source): the package refuses a library whose sources
    changed since (an editable install's sources edited without a rebuild); :mod:`anyquant_cpu.kernels` computes the
    same from the files beside it."""
    files = sorted(Path(s).name for s in [*SOURCES, *PORTABLE])
    return hashlib.sha256(b"".join((HERE / KERNELS / f).read_bytes() for f in files)).hexdigest()[:16]


(HERE / KERNELS / "_build.json").write_text(json.dumps({"torch": torch.__version__, "digest": digest()}) + "\n")

setup(
    install_requires=["anyquant>=0.1,<0.2", "anyquant-runtime>=0.1,<0.2", f"torch=={torch.__version__.split('+')[0]}"],
    ext_modules=[
        CppExtension(f"anyquant_cpu.kernels.{name}", sources, extra_compile_args=CFLAGS, extra_link_args=LDFLAGS)
        for name, sources in LIBRARIES.items()
    ],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)},
)
