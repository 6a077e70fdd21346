"""Pure-torch dequantization of GGUF block types, and the error for the types it does not handle.

:func:`dequantize_blocks_torch` reproduces ``gguf.quants.dequantize`` bit for bit: it
performs the same float32 operations in the same order (no fused multiply-add), so
``torch.equal`` holds against the numpy reference.

Block layouts (bytes, little endian; ``d``/``m``/``dmin`` are float16):

* Q4_0 (32 w, 18 B): d, 16 B nibbles (low nibbles = weights 0-15, high = 16-31); w = d*(q-8)
* Q4_1 (32 w, 20 B): d, m, 16 B nibbles; w = d*q + m
* Q5_0 (32 w, 22 B): d, 4 B high bits (bit i -> weight i), 16 B nibbles; w = d*(q-16)
* Q5_1 (32 w, 24 B): d, m, 4 B high bits, 16 B nibbles; w = d*q + m
* Q8_0 (32 w, 34 B): d, 32 int8; w = q*d
* Q2_K .. Q6_K (256 w super-blocks): see the per-type functions below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from anyquant.plugin import CheckpointError

from .ggml import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["PACKED_TYPES", "UnsupportedGGUFType", "dequantize_blocks_torch", "packed_nbytes"]

Q = GGMLQuantizationType
_QK_K = 256


class UnsupportedGGUFType(CheckpointError, ValueError):
    """A tensor uses a GGML storage type this package cannot dequantize."""


_NIBBLE = (0, 4)
_CRUMB = (0, 2, 4, 6)
_BITS = (0, 1, 2, 3, 4, 5, 6, 7)


def _f16(b: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes ``start:start+2`` of each block (``[n, type_size]`` uint8) -> ``[n, 1]`` float32.

    Read through a float16 view of the whole block matrix (no gather copy) when its layout
    allows one; the float16 -> float32 conversion is exact.
    """
    try:
        halves = b.view(torch.float16)
    except RuntimeError:  # odd storage offset or strided rows
        return b[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)
    return halves[:, start // 2 : start // 2 + 1].to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` uint8 -> ``[n, 32]`` float32: low nibbles (weights 0-15), then high ones.

    Each half is converted straight into its columns of the output (no stacked uint8 copy).
    """
    out = torch.empty(qs.shape[0], 2 * qs.shape[1], dtype=torch.float32)
    out[:, : qs.shape[1]].copy_(qs & 0x0F)
    out[:, qs.shape[1] :].copy_(qs >> 4)
    return out


def _unpack(x: torch.Tensor, chunk: int, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """Split each ``chunk``-byte group into ``len(shifts)`` bit fields, field-major.

    ``[n, k*chunk]`` uint8 -> ``[n, k, len(shifts), chunk]`` uint8 (numpy's reference
    order). One contiguous op per field: much faster than a broadcast shift.
    """
    groups = x.reshape(x.shape[0], -1, chunk)
    fields = []
    for shift in shifts:
        field = groups >> shift if shift else groups
        fields.append(field if shift + mask.bit_length() >= 8 else field & mask)
    return torch.stack(fields, dim=2)


def _float(q: torch.Tensor, *shape: int) -> torch.Tensor:
    return q.reshape(*shape).to(torch.float32)


# The float ops below run in place on a fresh float32 tensor (fewer large
# allocations); ``q.mul_(d)`` is the same IEEE product as numpy's ``d * q``.


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 2:]).sub_(8).mul_(_f16(b, 0))  # q - 8 is exact in float32


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:]).mul_(_f16(b, 0)).add_(_f16(b, 2))


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """4 bytes of a little-endian uint32 (bit i -> weight i) + 16 nibble bytes."""
    low = _unpack(qs, 16, _NIBBLE, 0x0F).reshape(qs.shape[0], -1)
    high = _unpack(qh, 1, _BITS, 1).reshape(qh.shape[0], -1)
    return low | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _five_bit(b[:, 2:6], b[:, 6:]).view(torch.int8) - 16
    return _float(q, b.shape[0], -1).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _float(_five_bit(b[:, 4:8], b[:, 8:]), b.shape[0], -1)
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).to(torch.float32).mul_(_f16(b, 0))


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """scales[16] (low nibble scale, high nibble min), qs[64] 2-bit, d, dmin."""
    n = b.shape[0]
    scales = b[:, :16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _float(_unpack(b[:, 16:80], 32, _CRUMB, 3), n, 16, 16)
    return q.mul_(dl).sub_(ml).reshape(n, _QK_K)


def _q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """12 bytes -> 16 signed 6-bit scales, as float32."""
    n = scales.shape[0]
    low = _unpack(scales[:, :8], 8, _NIBBLE, 0x0F).reshape(n, 16)
    high = _unpack(scales[:, 8:], 4, _CRUMB, 3).reshape(n, 16)
    return _float((low | (high << 4)).view(torch.int8) - 32, n, 16)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """hmask[32], qs[64] 2-bit, scales[12] 6-bit, d."""
    n = b.shape[0]
    dl = (_f16(b, 108) * _q3_k_scales(b[:, 96:108])).reshape(n, 16, 1)
    low = _unpack(b[:, 32:96], 32, _CRUMB, 3).reshape(n, 16, 16)
    high = _unpack(b[:, :32], 32, _BITS, 1).reshape(n, 16, 16) ^ 1  # clear bit -> minus 4
    q = low.view(torch.int8) - (high << 2).view(torch.int8)
    return _float(q, n, 16, 16).mul_(dl).reshape(n, _QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins."""
    s = scales.reshape(scales.shape[0], 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d, dmin, scales[12] -> per-32-weight scale and min, ``[n, 8, 1]`` each."""
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = (d * sc.to(torch.float32)).reshape(n, -1, 1)
    offset = (dmin * mn.to(torch.float32)).reshape(n, -1, 1)
    return scale, offset


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin, scales[12], qs[128] nibbles (per 32 bytes: 32 low, then 32 high)."""
    n = b.shape[0]
    scale, offset = _k_scales(b)
    q = _float(_unpack(b[:, 16:], 32, _NIBBLE, 0x0F), n, -1, 32)
    return q.mul_(scale).sub_(offset).reshape(n, _QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin, scales[12], qh[32] (bit j of byte i -> weight 32*j + i), qs[128]."""
    n = b.shape[0]
    scale, offset = _k_scales(b)
    low = _unpack(b[:, 48:], 32, _NIBBLE, 0x0F).reshape(n, -1, 32)
    high = _unpack(b[:, 16:48], 32, _BITS, 1).reshape(n, -1, 32)
    q = _float(low | (high << 4), n, -1, 32)
    return q.mul_(scale).sub_(offset).reshape(n, _QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """ql[128] low nibbles, qh[64] 2-bit highs, scales[16] int8, d; w = d*s*(q-32)."""
    n = b.shape[0]
    scales = b[:, 192:208].view(torch.int8).to(torch.float32)
    dl = (_f16(b, 208) * scales).reshape(n, 16, 1)
    low = _unpack(b[:, :128], 64, _NIBBLE, 0x0F).reshape(n, -1, 32)
    high = _unpack(b[:, 128:192], 32, _CRUMB, 3).reshape(n, -1, 32)
    q = (low | (high << 4)).view(torch.int8) - 32
    return _float(q, n, 16, 16).mul_(dl).reshape(n, _QK_K)


_BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}
_DENSE: dict[GGMLQuantizationType, torch.dtype] = {
    Q.F32: torch.float32,
    Q.F16: torch.float16,
    Q.BF16: torch.bfloat16,
}
#: Block-quantized types :class:`GGUFLinear` keeps packed.
PACKED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_BLOCK_DEQUANT)


def _unsupported(qtype: GGMLQuantizationType) -> UnsupportedGGUFType:
    names = ", ".join(sorted(t.name for t in (*_BLOCK_DEQUANT, *_DENSE)))
    return UnsupportedGGUFType(f"GGML type {qtype.name} is not supported by the torch dequantizer (supported: {names})")


def packed_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of logical ``shape`` occupies in GGML type ``qtype``."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = 1
    for dim in shape:
        numel *= dim
    if shape and shape[-1] % block_size:
        raise ValueError(f"row size {shape[-1]} is not a multiple of the {qtype.name} block size {block_size}")
    return numel // block_size * type_size


def dequantize_blocks_torch(
    raw: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, ...] | torch.Size
) -> torch.Tensor:
    """Dequantize raw GGUF bytes (``uint8``, any shape) to a float32 tensor of ``shape``."""
    qtype = GGMLQuantizationType(qtype)
    shape = tuple(shape)
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw GGUF data must be uint8, got {raw.dtype}")
    if qtype not in _BLOCK_DEQUANT and qtype not in _DENSE:
        raise _unsupported(qtype)
    expected = packed_nbytes(qtype, shape)
    if raw.numel() != expected:
        raise ValueError(f"{qtype.name} {list(shape)} needs {expected} bytes, got {raw.numel()}")
    flat = raw.reshape(-1)
    if qtype in _DENSE:
        return flat.view(_DENSE[qtype]).to(torch.float32).reshape(shape)
    type_size = GGML_QUANT_SIZES[qtype][1]
    return _BLOCK_DEQUANT[qtype](flat.reshape(-1, type_size)).reshape(shape)
