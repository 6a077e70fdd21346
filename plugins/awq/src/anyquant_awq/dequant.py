"""Bit-exact AWQ dequantization (pure torch, CPU reference) for the GEMM and GEMV layouts.

Rule (bit-identical to AutoAWQ 0.2.9 ``awq.utils.packing_utils.dequantize_gemm``)::

    W[k, n] = round_to(scales.dtype, float32(q[k, n] - z[k // g, n]) * float32(scales[k // g, n]))

AutoAWQ computes ``(iweight - izeros) * scales`` with int8 codes and the stored
(fp16) scales: torch promotes to the scale dtype with one rounding of an exact
product, which is what the fp32 multiply above reproduces.  There is no +-1 on
AWQ zero points.  The result is returned as ``[out_features, in_features]``.

GEMM (``WQLinear_GEMM``): ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32
``[K/g, N/8]`` are packed along N with nibble ``i`` of a word holding logical
column ``AWQ_PACK_ORDER[i]``; ``scales`` ``[K/g, N]``.

GEMV (``WQLinear_GEMV``): ``qweight`` int32 ``[N, K/8]`` packed along K in
natural nibble order; ``qzeros`` int32 ``[N, Wz]`` packed along groups in natural
order; ``scales`` ``[N, 8*Wz]``.  ``Wz`` pads the group count (AutoAWQ
``calculate_zeros_width``), so only the first ``K/g`` zero and scale columns
are real.

``zero_point=False`` files: AutoAWQ's GEMM/GEMV packers require zeros, so
AutoAWQ 0.2.9 alone never writes them; GPTQModel (``sym=True``) and anyquant's
``quantizer_backend="autoawq"`` worker write ``qzeros`` filled with ``2**(b-1)``
(8).  Passing ``qzeros=None`` applies that implicit 8.
"""

from __future__ import annotations

import torch

from anyquant_runtime.packing import pack_cols, unpack_cols

__all__ = [
    "AWQ_PACK_ORDER",
    "AWQ_UNPACK_ORDER",
    "awq_gemv_zeros_width",
    "dequantize_awq_gemm",
    "dequantize_awq_gemv",
    "pack_awq_gemm_cols",
    "unpack_awq_gemm_cols",
]

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_BITS = 4
_PER_WORD = 32 // _BITS


def _check_bits(bits: int) -> None:
    if bits != _BITS:
        raise ValueError(f"AWQ GEMM/GEMV layouts are 4-bit only, got bits={bits}")


def _resolve_group_size(group_size: int, in_features: int) -> int:
    size = in_features if group_size == -1 else group_size
    if size <= 0 or in_features % size:
        raise ValueError(f"in_features={in_features} is not a multiple of group_size={group_size}")
    return size


def unpack_awq_gemm_cols(packed: torch.Tensor) -> torch.Tensor:
    """Unpack AWQ-interleaved 4-bit words ``[R, C]`` to logical codes ``[R, 8*C]``."""
    natural = unpack_cols(packed, _BITS)
    order = torch.tensor(AWQ_UNPACK_ORDER, dtype=torch.int64)
    blocks = natural.reshape(natural.shape[0], -1, _PER_WORD)[..., order]
    return blocks.reshape(natural.shape[0], -1).contiguous()


def pack_awq_gemm_cols(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_awq_gemm_cols`: nibble ``i`` gets column ``AWQ_PACK_ORDER[i]``."""
    if codes.shape[-1] % _PER_WORD:
        raise ValueError(f"AWQ packs columns in groups of {_PER_WORD}, got {codes.shape[-1]}")
    order = torch.tensor(AWQ_PACK_ORDER, dtype=torch.int64)
    blocks = codes.reshape(codes.shape[0], -1, _PER_WORD)[..., order]
    return pack_cols(blocks.reshape(codes.shape[0], -1), _BITS)


def _scaled(diff: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (diff.to(torch.float32) * scales.to(torch.float32)).to(scales.dtype)


def dequantize_awq_gemm(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int,
) -> torch.Tensor:
    """Dequantize an AWQ GEMM linear to ``[out_features, in_features]`` in ``scales.dtype``."""
    _check_bits(bits)
    in_features = qweight.shape[0]
    group = _resolve_group_size(group_size, in_features)
    num_groups, out_features = scales.shape
    if num_groups != in_features // group:
        raise ValueError(f"scales has {num_groups} groups, expected {in_features // group}")
    codes = unpack_awq_gemm_cols(qweight)
    if qzeros is None:
        zeros = torch.full((num_groups, out_features), 1 << (bits - 1), dtype=torch.int32)
    else:
        zeros = unpack_awq_gemm_cols(qzeros)
    if codes.shape[1] != out_features or zeros.shape != (num_groups, out_features):
        raise ValueError("qweight / qzeros / scales shapes do not agree")
    index = torch.arange(in_features, dtype=torch.int64) // group
    return _scaled(codes - zeros[index], scales[index]).t().contiguous()


def awq_gemv_zeros_width(in_features: int, group_size: int) -> int:
    """AutoAWQ's ``calculate_zeros_width``: int32 words per row of GEMV ``qzeros``."""
    multiplier = {32: 4, 64: 2}.get(group_size, 1 if group_size >= 128 else 0)
    if multiplier == 0:
        raise ValueError(f"AutoAWQ GEMV does not support group_size={group_size}")
    base = -(-(in_features // group_size) // _PER_WORD)
    return -(-base // multiplier) * multiplier


def dequantize_awq_gemv(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int,
) -> torch.Tensor:
    """Dequantize an AWQ GEMV linear to ``[out_features, in_features]`` in ``scales.dtype``.

    Padded group columns of ``qzeros``/``scales`` beyond ``in_features / group_size``
    are ignored.
    """
    _check_bits(bits)
    out_features = qweight.shape[0]
    in_features = qweight.shape[1] * _PER_WORD
    group = _resolve_group_size(group_size, in_features)
    num_groups = in_features // group
    if scales.shape[0] != out_features or scales.shape[1] < num_groups:
        raise ValueError(f"scales shape {tuple(scales.shape)} does not cover {num_groups} groups")
    codes = unpack_cols(qweight, _BITS)
    if qzeros is None:
        zeros = torch.full((out_features, num_groups), 1 << (bits - 1), dtype=torch.int32)
    else:
        zeros = unpack_cols(qzeros, _BITS, count=num_groups)
    index = torch.arange(in_features, dtype=torch.int64) // group
    return _scaled(codes - zeros[:, index], scales[:, :num_groups][:, index]).contiguous()
