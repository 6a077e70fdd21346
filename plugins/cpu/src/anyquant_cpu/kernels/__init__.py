"""An optional compiled kernel: GEMV on raw GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL / MXFP4 blocks,
super-blocks of 256 (the K-quants Q4_K / Q5_K / Q6_K, IQ4_XS) and GQ4 blocks, with int8 activations.

``torch.ops.anyquant.ggml_gemv(x, blocks, type, rows, cols, isa=-1, passes=2)`` computes ``x @ W.T``
(float32, returned in ``x``'s dtype) for ``W`` ``[rows, cols]`` stored as GGUF blocks (``blocks``: a
contiguous uint8 tensor of ``rows * cols/32`` blocks, e.g. a zero-copy view of the mmapped file; for the K-quants
``rows * cols/256`` super-blocks of 256 weights, llama.cpp's ``block_q4_K`` / ``block_q5_K`` / ``block_q6_K`` as
stored: ``cols`` a multiple of 256), or as
GQ4 blocks (type 100, not a GGUF type): GPTQ / AWQ group-quantized int4 ``w = s (q - z)`` repacked once at
load, 20 bytes per block of 32: ``s`` as float16, the zero point ``z`` as float16, then the 16 bytes of
nibbles in Q4_1's order (byte ``j``: element ``j`` low, ``j + 16`` high). Float16 holds the checkpoints'
float16 scales and every integer zero point up to 2048 exactly, and the kernel's offset ``-s z`` is exact
in float32, so the blocks hold exactly the weight ``s (q - z)`` (a float32 pair of ``s`` and ``-s z``
would take 24 bytes for nothing more). Each row
of ``x`` is quantized per block of 32 inside the op, each weight block is dotted with it in integers, then
scaled: llama.cpp's CPU approach. A K-quant super-block is 8 sub-blocks of 32, each on one activation block: Q4_K /
Q5_K sub-block ``j`` as Q4_1 with scale ``d sc_j`` and offset ``-dmin m_j`` (both exact in float32: a float16 times a
6-bit integer), Q6_K with two integer sums per sub-block (its int8 scales ``d sc`` are per 16 weights). The table
types (IQ4_NL, IQ4_XS's sub-blocks, MXFP4) as Q8_0: their 4-bit codes' int8 values (llama.cpp's ``kvalues_iq4nl`` /
``kvalues_mxfp4``, a byte shuffle) dotted with the codes, scaled by ``d``, ``d (ls - 32)`` or MXFP4's
``2^(e - 128)``; Q5_0 / Q5_1 as Q4_0 / Q4_1 with the fifth bit of each code. ``passes=1``: int8 codes ``round(x / d)``, ``d = max|x| / 127`` (round half
to even), llama.cpp's Q8_0 activations; ``passes=2`` (the default): the residual's int8 code as well,
``c = 256 round(x / d) + round((x - d round(x / d)) * 256 / d)`` with scale ``d / 256`` (about 15 bits per
activation, one more integer dot product per block): int8 activations alone flip near-tied greedy tokens
(SmolLM2's "capital of France" answer, as llama.cpp's own), two passes follow the exact weights' path.
``isa``: -1 the best path this CPU has (:func:`isa_names`: AVX512-VNNI, AVX2, scalar), or a lower one.
``torch.ops.anyquant.ggml_gemv_cat(x, blocks, types, rows, isa=-1, passes=2)``: several weights on the same ``x``
(lists of blocks, types and row counts), ``x`` quantized once, their outputs side by side, each as ``ggml_gemv``
computes it (the decode step's q/k/v and gate/up).
``torch.ops.anyquant.ggml_experts(x, index, weights, blocks, types, intermediate, isa=-1, passes=2)``: a mixture-of-experts
layer's chosen experts on rows ``x`` in one call (``blocks``/``types``: each expert's gate, up and down; per row its
``index`` experts in ascending order, ``weights`` their routing weights): bit for bit
:class:`~anyquant_runtime.experts.Experts`' arithmetic on these linears (the decode step's MoE layers).
``torch.ops.anyquant.ggml_interleave(blocks, type, rows, cols, forward=True, qk_heads=0)``: the blocks' interleaved
form (``qk_heads``: of the rows as they are before llama.cpp's converter permuted Q/K rows in that many heads, read
from the permuted rows without an un-permuted copy first; a new
tensor of the same size), which the op reads with ``type + INTERLEAVED``: per group of 8 rows and block, the 8 rows'
float16 scales side by side, then the rest of their bytes (codes; a K-quant's packed sub-block scales too) in the
32-byte chunks its vector path reads, in the order it reads them (the file's layout makes it gather and transpose
them per block: ~1.3x slower where memory is not the limit, ~2-2.5x for the K-quants), in column tiles of 2,048
(every group's pieces of one tile before the next tile's, so that a wide row's activation codes stay in L1 while the
op runs a tile over all its rows); ``forward=False`` gives the blocks back. Rows past the last whole group of 8 stay
as they are.

The kernel is compiled when anyquant-cpu is installed (``setup.py``: ``pip install`` and ``pip wheel`` build it, and
a compiler error fails the install); nothing compiles at run time. :func:`available` loads the built library once per
process, and refuses (with a warning, :func:`stale`) one built from other sources or for another torch; callers then
take the pure-torch paths.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path

__all__ = [
    "GGML_TYPES",
    "INTERLEAVED",
    "ISA_NAMES",
    "available",
    "block_nbytes",
    "library",
    "gemv",
    "gemv_cat",
    "interleave",
    "isa",
    "lut_available",
    "lut_isa",
    "portable",
    "stale",
    "threads",
]

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
#: block types the op takes, by name: (type id, bytes per block, weights per block: 32, or a K-quant's super-block of
#: 256, which a row's columns are a multiple of); GGUF's ids, and GQ4
GGML_TYPES = {
    "Q4_0": (2, 18, 32),
    "Q4_1": (3, 20, 32),
    "Q5_0": (6, 22, 32),
    "Q5_1": (7, 24, 32),
    "Q8_0": (8, 34, 32),
    "Q4_K": (12, 144, 256),
    "Q5_K": (13, 176, 256),
    "Q6_K": (14, 210, 256),
    "IQ4_NL": (20, 18, 32),
    "IQ4_XS": (23, 136, 256),
    "MXFP4": (39, 17, 32),
    "GQ4": (100, 20, 32),
}
#: added to a type id: the op reads the blocks in their interleaved form (:func:`interleave`)
INTERLEAVED = 1000
ISA_NAMES = ("scalar", "avx2", "avx512-vnni")


def portable() -> bool:
    """``ANYQUANT_KERNELS_PORTABLE=1``: the portable library is loaded (its scalar paths alone, ``-DANYQUANT_PORTABLE``,
    as any architecture other than x86-64 compiles it; built with the package beside the native one): how the tests
    check the portable kernel on an x86 machine."""
    return os.environ.get("ANYQUANT_KERNELS_PORTABLE", "0") == "1"


def library() -> Path | None:
    """The built library this process loads (``_kernels.so``, or ``_kernels_portable.so`` when :func:`portable`),
    compiled when the package was installed; ``None`` where it is missing."""
    path = _HERE / ("_kernels_portable.so" if portable() else "_kernels.so")
    return path if path.is_file() else None


def _digest() -> str:
    """The sources' digest as ``setup.py`` computes it at build time (every ``*.cpp`` beside this file)."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(_HERE.glob("*.cpp")))).hexdigest()[:16]


def stale() -> str | None:
    """Why the built library does not match this package (its sources changed since the build, or another torch
    than it was compiled against): ``None`` when it matches or nothing was built."""
    built = _HERE / "_build.json"
    if library() is None or not built.is_file():
        return None
    import torch

    info = json.loads(built.read_text(encoding="utf-8"))
    if info.get("torch") != torch.__version__:
        return f"it was compiled against torch {info.get('torch')}, this is torch {torch.__version__}"
    if info.get("digest") != _digest():
        return "its sources changed since it was built"
    return None


REBUILD = "reinstall anyquant-cpu to rebuild it (in the repository: make install)"


def _reset() -> None:
    available.cache_clear()


@functools.cache
def available() -> bool:
    """Whether the op is loaded (loading the built library once per process); never compiles.
    ``ANYQUANT_KERNELS=0`` turns it off (the pure-torch paths run)."""
    if os.environ.get("ANYQUANT_KERNELS", "1") == "0":
        return False
    import torch

    if hasattr(torch.ops.anyquant, "ggml_gemv") and _registered():
        return True
    lib = library()
    if lib is None:
        return False
    why = stale()
    if why is not None:
        log.warning("anyquant kernels at %s are not loaded: %s; %s", lib, why, REBUILD)
        return False
    try:
        torch.ops.load_library(str(lib))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError) as exc:
        log.warning("anyquant kernels at %s do not load: %s", lib, str(exc).splitlines()[0])
        return False
    return _registered()


def has_op(name: str) -> bool:
    """Whether ``anyquant::<name>`` is registered (by the loaded library); loads nothing."""
    import torch

    try:
        getattr(torch.ops.anyquant, name).default  # noqa: B018 - raises when the op is not registered
    except (AttributeError, RuntimeError):
        return False
    return True


def _registered() -> bool:
    return has_op("ggml_gemv")


def lut_available() -> bool:
    """Whether ``anyquant::lut4_gemv`` (4-bit codes into a 16-entry float table) is loaded with the library."""
    return available() and has_op("lut4_gemv")


def attention_available() -> bool:
    """Whether ``anyquant::decode_attention`` (a decode step's attention, every row over its own cache) is loaded
    with the library."""
    return available() and has_op("decode_attention")


def lut_isa() -> int:
    """The vector path ``lut4_gemv`` takes here: 0 scalar, 1 AVX2+FMA, 2 AVX512F; -1 when not available."""
    import torch

    return int(torch.ops.anyquant.lut_isa()) if lut_available() else -1


def isa() -> int:
    """The vector path the op takes on this CPU (an index into :data:`ISA_NAMES`); -1 when not available."""
    import torch

    return int(torch.ops.anyquant.kernel_isa()) if available() else -1


def threads() -> int:
    """How many threads the op splits its rows over (torch's intra-op thread count); 0 when not available."""
    import torch

    return int(torch.ops.anyquant.kernel_threads()) if available() else 0


def block_nbytes(type_name: str, rows: int, cols: int) -> int:
    """How many bytes ``[rows, cols]`` weights take as blocks of ``type_name`` (``cols`` a multiple of its block)."""
    _, size, weights = GGML_TYPES[type_name]
    return rows * (cols // weights) * size


def gemv(x: object, blocks: object, type_name: str, rows: int, cols: int, isa: int = -1, passes: int = 2) -> object:
    """``torch.ops.anyquant.ggml_gemv`` with the type by name (``"Q4_0"``, ``"Q4_K"``, ...: :data:`GGML_TYPES`)."""
    import torch

    return torch.ops.anyquant.ggml_gemv(x, blocks, GGML_TYPES[type_name][0], rows, cols, isa, passes)


def gemv_cat(x: object, parts: list[tuple[object, str, int]], isa: int = -1, passes: int = 2) -> object:
    """``torch.ops.anyquant.ggml_gemv_cat`` with ``parts`` as ``(blocks, type name, rows)``."""
    import torch

    return torch.ops.anyquant.ggml_gemv_cat(
        x, [p[0] for p in parts], [GGML_TYPES[p[1]][0] for p in parts], [p[2] for p in parts], isa, passes
    )


def interleave(blocks: object, type_name: str, rows: int, cols: int, forward: bool = True, qk_heads: int = 0) -> object:
    """``torch.ops.anyquant.ggml_interleave`` with the type by name."""
    import torch

    return torch.ops.anyquant.ggml_interleave(blocks, GGML_TYPES[type_name][0], rows, cols, forward, qk_heads)
