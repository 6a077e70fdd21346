"""GGML's storage types and GGUF's metadata value types, as llama.cpp numbers them.

The same ids and names as the ``gguf`` package's ``GGMLQuantizationType`` / ``GGUFValueType`` (both
``IntEnum``: a member of either compares and hashes equal to the one here with its value), without importing
that package: its ``constants`` module builds hundreds of enums and tables at import (~0.1 s, a fifth of
loading a 1B model). Block sizes come from :data:`anyquant.headers.GGUF_TYPE_SIZES` (llama.cpp's ``ggml.h``
and ``ggml-common.h``; ``gguf`` 0.19 says 40 bytes for Q8_1 where ggml's ``block_q8_1`` is 36, and no file
stores Q8_1).
"""

from __future__ import annotations

from enum import IntEnum

from anyquant.plugin import GGUF_TYPE_SIZES

__all__ = ["GGML_QUANT_SIZES", "GGMLQuantizationType", "GGUFValueType"]


class GGMLQuantizationType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


#: type -> (elements per block, bytes per block)
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    GGMLQuantizationType(type_id): (block, nbytes) for type_id, (_name, block, nbytes) in GGUF_TYPE_SIZES.items()
}
