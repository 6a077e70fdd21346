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
* IQ4_NL (32 w, 18 B): d, 16 B nibbles (as Q4_0) indexing llama.cpp's 16 non-linear int8 values; w = d*v[q]
* IQ4_XS (256 w, 136 B): d, 8 six-bit sub-block scales, IQ4_NL nibbles; w = d*(s-32)*v[q]
* MXFP4 (32 w, 17 B): e8m0 exponent byte, 16 B e2m1 nibbles (as Q4_0); w = 2^(e-128)*2*fp4[q]
* NVFP4 (64 w, 36 B): 4 ue4m3 scales (one per 16 w), 32 B e2m1 nibbles; w = (ue4m3(s)/2)*(2*fp4[q])
* TQ1_0 / TQ2_0 (256 w): ternary digits (base 3 packed five per byte / 2 bits each), d; w = d*(t-1)
* IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (256 w): codes indexing llama.cpp's lattice
  ("grid") tables with per-group signs and scales. The grids (256 to 2048 rows of 4 or 8 values) are not
  copied here: :func:`_grid` takes them from the installed ``gguf`` package (``gguf.quants``, which the
  GGUF format already requires), on first use of such a type only.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from anyquant.plugin import CheckpointError
from anyquant_runtime.packing import ggml_f16

from .ggml import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = [
    "PACKED_TYPES",
    "UnsupportedGGUFType",
    "check_finite_blocks",
    "check_supported",
    "dequantize_blocks_torch",
    "packed_nbytes",
]

Q = GGMLQuantizationType
_QK_K = 256


class UnsupportedGGUFType(CheckpointError, ValueError):
    """A tensor uses a GGML storage type this package cannot dequantize."""


_NIBBLE = (0, 4)
_CRUMB = (0, 2, 4, 6)
_BITS = (0, 1, 2, 3, 4, 5, 6, 7)


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
    return _nibbles(b[:, 2:]).sub_(8).mul_(ggml_f16(b, 0))  # q - 8 is exact in float32


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:]).mul_(ggml_f16(b, 0)).add_(ggml_f16(b, 2))


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """4 bytes of a little-endian uint32 (bit i -> weight i) + 16 nibble bytes."""
    low = _unpack(qs, 16, _NIBBLE, 0x0F).reshape(qs.shape[0], -1)
    high = _unpack(qh, 1, _BITS, 1).reshape(qh.shape[0], -1)
    return low | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _five_bit(b[:, 2:6], b[:, 6:]).view(torch.int8) - 16
    return _float(q, b.shape[0], -1).mul_(ggml_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _float(_five_bit(b[:, 4:8], b[:, 8:]), b.shape[0], -1)
    return q.mul_(ggml_f16(b, 0)).add_(ggml_f16(b, 2))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).to(torch.float32).mul_(ggml_f16(b, 0))


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """scales[16] (low nibble scale, high nibble min), qs[64] 2-bit, d, dmin."""
    n = b.shape[0]
    scales = b[:, :16]
    d, dmin = ggml_f16(b, 80), ggml_f16(b, 82)
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
    dl = (ggml_f16(b, 108) * _q3_k_scales(b[:, 96:108])).reshape(n, 16, 1)
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
    d, dmin = ggml_f16(b, 0), ggml_f16(b, 2)
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
    dl = (ggml_f16(b, 208) * scales).reshape(n, 16, 1)
    low = _unpack(b[:, :128], 64, _NIBBLE, 0x0F).reshape(n, -1, 32)
    high = _unpack(b[:, 128:192], 32, _CRUMB, 3).reshape(n, -1, 32)
    q = (low | (high << 4)).view(torch.int8) - 32
    return _float(q, n, 16, 16).mul_(dl).reshape(n, _QK_K)


# --------------------------------------------------------------------------- lookup-table types


def _lut(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``table[codes]`` (float32; ``codes`` any integer dtype, any shape; int32 indices: half int64's memory)."""
    return table.index_select(0, codes.reshape(-1).to(torch.int32)).reshape(*codes.shape, *table.shape[1:])


#: llama.cpp's ``kvalues_iq4nl``
_IQ4NL_VALUES = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32
)
#: llama.cpp's ``kvalues_mxfp4``: the e2m1 values doubled (the scale is halved to match)
_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    q = _lut(_IQ4NL_VALUES, _unpack(b[:, 2:], 16, _NIBBLE, 0x0F).reshape(b.shape[0], 32))
    return q.mul_(ggml_f16(b, 0))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """d, scales_h (uint16: 2 bits per sub-block), scales_l[4] (nibbles), qs[128] (per 16 bytes: 16 low, 16 high)."""
    n = b.shape[0]
    low = _unpack(b[:, 4:8], 1, _NIBBLE, 0x0F).reshape(n, 8)
    high = _unpack(b[:, 2:4], 1, _CRUMB, 3).reshape(n, 8)
    scales = _float((low | (high << 4)).view(torch.int8) - 32, n, 8)
    dl = (ggml_f16(b, 0) * scales).reshape(n, 8, 1)
    q = _lut(_IQ4NL_VALUES, _unpack(b[:, 8:], 16, _NIBBLE, 0x0F).reshape(n, 8, 32))
    return q.mul_(dl).reshape(n, _QK_K)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml's ``ggml_e8m0_to_fp32_half``: uint8 exponent ``e`` -> float32 ``2^(e-128)`` (bit pattern built)."""
    x = e.to(torch.int32)
    bits = torch.where(x < 2, torch.bitwise_left_shift(0x00200000, x), (x - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    q = _lut(_MXFP4_VALUES, _unpack(b[:, 1:], 16, _NIBBLE, 0x0F).reshape(b.shape[0], 32))
    return q.mul_(_e8m0_half(b[:, :1]))


def _ue4m3_half(x: int) -> float:
    """ggml's unsigned e4m3 scale of NVFP4 (bias 7; bit 7 ignored; 0 and 0x7F read as 0), halved as MXFP4's."""
    if x in (0, 0x7F):
        return 0.0
    exp, man = (x >> 3) & 0xF, x & 7
    return (man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)) * 0.5  # exact in float32


_UE4M3_HALF = torch.tensor([_ue4m3_half(x) for x in range(256)], dtype=torch.float32)


def _nvfp4(b: torch.Tensor) -> torch.Tensor:
    """4 ue4m3 scales, then 4 x 8 bytes of e2m1 nibbles (per 16 weights: 8 low, 8 high)."""
    n = b.shape[0]
    d = _lut(_UE4M3_HALF, b[:, :4]).reshape(n, 4, 1)
    q = _lut(_MXFP4_VALUES, _unpack(b[:, 4:], 8, _NIBBLE, 0x0F).reshape(n, 4, 16))
    return q.mul_(d).reshape(n, 64)


_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8)


def _tq1_0(b: torch.Tensor) -> torch.Tensor:
    """qs[48] (five base-3 digits a byte, as a fixed-point fraction of 243), qh[4] (four), d at 52."""
    n = b.shape[0]
    qs0 = b[:, :32].unsqueeze(1) * _POW3.view(5, 1)  # uint8 products wrap, as numpy's and ggml's do
    qs1 = b[:, 32:48].unsqueeze(1) * _POW3.view(5, 1)
    qh = b[:, 48:52].unsqueeze(1) * _POW3[:4].view(4, 1)
    q = torch.cat([qs0.reshape(n, -1), qs1.reshape(n, -1), qh.reshape(n, -1)], dim=1)
    t = ((q.to(torch.int16) * 3) >> 8) - 1
    return t.to(torch.float32).mul_(ggml_f16(b, 52))


def _tq2_0(b: torch.Tensor) -> torch.Tensor:
    """qs[64] (2 bits a weight, per 32 bytes: four 32-weight fields), d at 64; w = d*(t-1)."""
    n = b.shape[0]
    q = _unpack(b[:, :64], 32, _CRUMB, 3).view(torch.int8) - 1
    return _float(q, n, _QK_K).mul_(ggml_f16(b, 64))


# --------------------------------------------------------------------------- lattice (grid) types

#: rows and width of the grid each type's codes index (llama.cpp's ``iq2xxs_grid`` ... ``iq1s_grid``)
_GRID_SHAPES: dict[GGMLQuantizationType, tuple[int, int]] = {
    Q.IQ2_XXS: (256, 8),
    Q.IQ2_XS: (512, 8),
    Q.IQ2_S: (1024, 8),
    Q.IQ3_XXS: (256, 4),
    Q.IQ3_S: (512, 4),
    Q.IQ1_S: (2048, 8),
    Q.IQ1_M: (2048, 8),
}
_IQ1S_DELTA = 0.125


@functools.cache
def _grid(qtype: GGMLQuantizationType) -> torch.Tensor:
    """llama.cpp's grid of ``qtype`` as float32 ``[rows, width]``, from ``gguf.quants`` (imported here only)."""
    rows, width = _GRID_SHAPES[qtype]
    try:
        cls = getattr(importlib.import_module("gguf.quants"), qtype.name)
        cls.init_grid()
        grid = torch.as_tensor(cls.grid, dtype=torch.float32).reshape(rows, width).clone()
    except Exception as exc:  # no gguf, or one without this type's grid
        raise UnsupportedGGUFType(
            f"GGML type {qtype.name} needs llama.cpp's {qtype.name} grid table, which anyquant takes from the "
            f"installed `gguf` package (gguf.quants.{qtype.name}.grid; pip install -U gguf): {exc!r}"
        ) from exc
    return grid


def _sign_table(values: torch.Tensor) -> torch.Tensor:
    """Sign bytes -> ``[len(values), 8]`` float32 +1/-1 (bit ``i`` set: weight ``i`` negative)."""
    bits = (values.to(torch.int32).unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1
    return 1.0 - 2.0 * bits.to(torch.float32)


#: llama.cpp's ``ksigns_iq2xs``: 7 stored sign bits, the 8th making the count of minus signs even
_KSIGNS = torch.tensor([i | ((bin(i).count("1") & 1) << 7) for i in range(128)], dtype=torch.uint8)
_KSIGN_VALUES = _sign_table(_KSIGNS)
_SIGN_VALUES = _sign_table(torch.arange(256))


def _u16(x: torch.Tensor) -> torch.Tensor:
    """``[n, 2k]`` uint8 -> ``[n, k]`` int32: little-endian uint16 values."""
    pairs = x.reshape(x.shape[0], -1, 2).to(torch.int32)
    return pairs[..., 0] | (pairs[..., 1] << 8)


def _u32(x: torch.Tensor) -> torch.Tensor:
    """``[n, 4k]`` uint8 -> ``[n, k]`` int64: little-endian uint32 values."""
    quads = x.reshape(x.shape[0], -1, 4).to(torch.int64)
    return quads[..., 0] | (quads[..., 1] << 8) | (quads[..., 2] << 16) | (quads[..., 3] << 24)


def _half_plus(d: torch.Tensor, s: torch.Tensor, factor: float) -> torch.Tensor:
    """``d * (0.5 + s) * factor`` in float32, in numpy's (and ggml's) order."""
    return (d * (s.to(torch.float32) + 0.5)).mul_(factor)


def _signed_grid(
    qtype: GGMLQuantizationType, idx: torch.Tensor, scale: torch.Tensor, signs: torch.Tensor
) -> torch.Tensor:
    """``scale * grid[idx] * signs`` (multiplied in that order), ``[n, 256]``; ``scale``: ``[n, groups, 1]``."""
    w = _lut(_grid(qtype), idx).reshape(*scale.shape[:2], -1)
    return w.mul_(scale).mul_(signs.reshape(w.shape)).reshape(idx.shape[0], _QK_K)


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    """d, then 8 x (4 grid bytes, uint32: four 7-bit sign indices and a 4-bit scale)."""
    n = b.shape[0]
    groups = b[:, 2:].reshape(n, 8, 8)
    aux = _u32(groups[:, :, 4:].reshape(n, 32))  # [n, 8]
    db = _half_plus(ggml_f16(b, 0), aux >> 28, 0.25).reshape(n, 8, 1)
    sign_idx = (aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21])) & 0x7F
    signs = _lut(_KSIGN_VALUES, sign_idx)
    return _signed_grid(Q.IQ2_XXS, groups[:, :, :4].reshape(n, 32), db, signs)


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    """d, qs[32] uint16 (9-bit grid index, 7-bit sign index), scales[8] (nibbles)."""
    n = b.shape[0]
    qs = _u16(b[:, 2:66])
    scales = _unpack(b[:, 66:74], 1, _NIBBLE, 0x0F).reshape(n, 16)
    db = _half_plus(ggml_f16(b, 0), scales, 0.25).reshape(n, 16, 1)
    return _signed_grid(Q.IQ2_XS, qs & 511, db, _lut(_KSIGN_VALUES, qs >> 9))


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    """d, qs[32] (grid index low bytes), signs[32], qh[8] (2 high bits each), scales[8] (nibbles)."""
    n = b.shape[0]
    high = _unpack(b[:, 66:74], 1, _CRUMB, 3).reshape(n, 32)
    idx = b[:, 2:34].to(torch.int32) | (high.to(torch.int32) << 8)
    scales = _unpack(b[:, 74:82], 1, _NIBBLE, 0x0F).reshape(n, 16)
    db = _half_plus(ggml_f16(b, 0), scales, 0.25).reshape(n, 16, 1)
    return _signed_grid(Q.IQ2_S, idx, db, _lut(_SIGN_VALUES, b[:, 34:66]))


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    """d, qs[64] (grid indices), 8 x uint32 (four 7-bit sign indices and a 4-bit scale)."""
    n = b.shape[0]
    aux = _u32(b[:, 66:98])
    db = _half_plus(ggml_f16(b, 0), aux >> 28, 0.5).reshape(n, 8, 1)
    sign_idx = (aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21])) & 0x7F
    return _signed_grid(Q.IQ3_XXS, b[:, 2:66], db, _lut(_KSIGN_VALUES, sign_idx))


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    """d, qs[64] (grid index low bytes), qh[8] (high bits), signs[32], scales[4] (nibbles); scale d*(1+2s)."""
    n = b.shape[0]
    high = _unpack(b[:, 66:74], 1, _BITS, 1).reshape(n, 64)
    idx = b[:, 2:66].to(torch.int32) | (high.to(torch.int32) << 8)
    scales = _unpack(b[:, 106:110], 1, _NIBBLE, 0x0F).reshape(n, 8)
    db = (ggml_f16(b, 0) * (scales.to(torch.float32) * 2 + 1)).reshape(n, 8, 1)
    return _signed_grid(Q.IQ3_S, idx, db, _lut(_SIGN_VALUES, b[:, 74:106]))


def _iq1_grid(qtype: GGMLQuantizationType, idx: torch.Tensor, dl: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """``dl * (grid[idx] + delta)``, delta -0.125 where ``negative`` else 0.125 (one per 8 weights)."""
    n = idx.shape[0]
    delta = torch.where(negative, -_IQ1S_DELTA, _IQ1S_DELTA).to(torch.float32)
    w = _lut(_grid(qtype), idx)  # [n, 32, 8]
    w.add_(delta.reshape(n, 32, 1))
    return w.reshape(*dl.shape[:-1], -1).mul_(dl).reshape(n, _QK_K)


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    """d, qs[32] (grid index low bytes), qh[8] uint16 (4 x 3 high bits, a 3-bit scale, the delta's sign)."""
    n = b.shape[0]
    qh = _u16(b[:, 34:50])  # [n, 8]
    dl = (ggml_f16(b, 0) * (((qh >> 12) & 7) * 2 + 1).to(torch.float32)).reshape(n, 8, 1)
    high = (qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], dtype=torch.int32)) & 7
    idx = b[:, 2:34].to(torch.int32) | (high.reshape(n, 32) << 8)
    negative = (qh & 0x8000).ne(0).unsqueeze(-1).expand(n, 8, 4)
    return _iq1_grid(Q.IQ1_S, idx, dl, negative)


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    """qs[32], qh[16] (per nibble: 3 high index bits and the delta's sign), scales[8]: 4 uint16 holding
    sixteen 3-bit scales and, in their top nibbles, the float16 d."""
    n = b.shape[0]
    sc = b[:, 48:56]
    d_bytes = torch.stack([(sc[:, 1] >> 4) | (sc[:, 3] & 0xF0), (sc[:, 5] >> 4) | (sc[:, 7] & 0xF0)], dim=1)
    d = d_bytes.view(torch.float16).to(torch.float32)  # [n, 1]
    scales = (_u16(sc).unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], dtype=torch.int32)) & 7
    dl = (d * (scales.reshape(n, 16) * 2 + 1).to(torch.float32)).reshape(n, 16, 1)
    nib = _unpack(b[:, 32:48], 1, _NIBBLE, 0x0F).reshape(n, 32)
    idx = b[:, :32].to(torch.int32) | ((nib & 7).to(torch.int32) << 8)
    return _iq1_grid(Q.IQ1_M, idx, dl, (nib & 8).ne(0))


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
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
    Q.MXFP4: _mxfp4,
    Q.NVFP4: _nvfp4,
    Q.TQ1_0: _tq1_0,
    Q.TQ2_0: _tq2_0,
    Q.IQ2_XXS: _iq2_xxs,
    Q.IQ2_XS: _iq2_xs,
    Q.IQ2_S: _iq2_s,
    Q.IQ3_XXS: _iq3_xxs,
    Q.IQ3_S: _iq3_s,
    Q.IQ1_S: _iq1_s,
    Q.IQ1_M: _iq1_m,
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


def check_supported(qtype: GGMLQuantizationType, *, dense: bool = True) -> None:
    """Raise :class:`UnsupportedGGUFType` unless :func:`dequantize_blocks_torch` takes ``qtype`` (``dense``: F32,
    F16 and BF16 count), a lattice type's grid loaded here (from ``gguf``) so that a missing one fails now."""
    if qtype not in _BLOCK_DEQUANT and not (dense and qtype in _DENSE):
        raise _unsupported(qtype)
    if qtype in _GRID_SHAPES:
        _grid(qtype)


def packed_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of logical ``shape`` occupies in GGML type ``qtype``."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = 1
    for dim in shape:
        numel *= dim
    if shape and shape[-1] % block_size:
        raise ValueError(f"row size {shape[-1]} is not a multiple of the {qtype.name} block size {block_size}")
    return numel // block_size * type_size


#: each block type's float16 scales (``d``; ``m``/``dmin``), by the byte offset of their high byte (little
#: endian: the byte holding the sign and the five exponent bits); IQ1_M's ``d`` is spread over four nibbles
_F16_SCALE_HIGH_BYTES: dict[GGMLQuantizationType, tuple[tuple[str, int], ...]] = {
    Q.Q4_0: (("d", 1),),
    Q.Q4_1: (("d", 1), ("m", 3)),
    Q.Q5_0: (("d", 1),),
    Q.Q5_1: (("d", 1), ("m", 3)),
    Q.Q8_0: (("d", 1),),
    Q.Q2_K: (("d", 81), ("dmin", 83)),
    Q.Q3_K: (("d", 109),),
    Q.Q4_K: (("d", 1), ("dmin", 3)),
    Q.Q5_K: (("d", 1), ("dmin", 3)),
    Q.Q6_K: (("d", 209),),
    Q.IQ4_NL: (("d", 1),),
    Q.IQ4_XS: (("d", 1),),
    Q.TQ1_0: (("d", 53),),
    Q.TQ2_0: (("d", 65),),
    Q.IQ2_XXS: (("d", 1),),
    Q.IQ2_XS: (("d", 1),),
    Q.IQ2_S: (("d", 1),),
    Q.IQ3_XXS: (("d", 1),),
    Q.IQ3_S: (("d", 1),),
    Q.IQ1_S: (("d", 1),),
}


def _non_finite_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> tuple[str, torch.Tensor] | None:
    """``(scale name, bool [n] mask)`` of the blocks (``[n, type_size]`` uint8) whose ``qtype`` scale is NaN or
    infinite, for the first scale that has one; ``None`` when every scale is finite.

    A float16 is NaN or +-inf exactly when its five exponent bits are all set: ``hi & 0x7C == 0x7C`` on its
    high byte. One strided byte column per scale, masked and reduced with a max (0x7C is the largest masked
    value): one pass over the blocks, no per-block Python and no float conversion."""
    if qtype == Q.IQ1_M:  # d's high byte: the top nibbles of scale bytes 5 and 7 (at 48 + 5, 48 + 7)
        high = (blocks[:, 53] >> 4) | (blocks[:, 55] & 0xF0)
        columns: tuple[tuple[str, torch.Tensor, int], ...] = (("d", high, 0x7C),)
    elif qtype == Q.MXFP4:  # E8M0 exponent byte: 0xFF is its NaN (the OCP MX spec; the mxfp4 plugin refuses it)
        columns = (("e8m0 scale", blocks[:, 0], 0xFF),)
    else:
        columns = tuple((scale, blocks[:, at], 0x7C) for scale, at in _F16_SCALE_HIGH_BYTES.get(qtype, ()))
    for scale, column, code in columns:
        if blocks.shape[0] and int((column & code).max()) == code:
            return scale, (column & code) == code
    return None


def check_finite_blocks(name: str, raw: torch.Tensor, qtype: GGMLQuantizationType | int) -> None:
    """:class:`~anyquant.errors.NumericalError` naming tensor ``name`` when the raw GGUF bytes ``raw`` (``uint8``,
    ``qtype``) hold a NaN or infinite value: a block's float16 scale (``d``, Q4_1/Q5_1's ``m``, the K-quants'
    ``dmin``; IQ1_M's nibble-spread ``d``; MXFP4's E8M0 ``0xFF``), or an F32/F16/BF16 element. A NaN or inf scale
    makes its 32 (or 256) weights NaN/inf and every logit after them, yet loads; this check reads one byte per
    scale (vectorised over the blocks), once, where the loader takes the bytes (``GGUFSource.raw``). NVFP4's
    unsigned E4M3 scales have no non-finite code as ggml reads them."""
    from anyquant.plugin import NumericalError
    from anyquant_runtime.finite import check_finite

    qtype = GGMLQuantizationType(qtype)
    flat = raw.reshape(-1)
    if qtype in _DENSE:
        check_finite(name, flat.view(_DENSE[qtype]))
        return
    type_size = GGML_QUANT_SIZES[qtype][1]
    if flat.dtype != torch.uint8 or flat.numel() % type_size:
        return  # not whole blocks: the dequantizer's own size checks report it
    blocks = flat.view(-1, type_size) if flat.is_contiguous() else flat.reshape(-1, type_size)
    found = _non_finite_blocks(blocks, qtype)
    if found is None:
        return
    scale, bad = found
    count, first = int(bad.sum()), int(bad.nonzero()[0, 0])
    raise NumericalError(
        f"tensor {name!r} ({qtype.name}) holds {count} block(s) of its {blocks.shape[0]} whose {scale} is NaN or "
        f"infinite (first: block {first}): its weights would be NaN/inf and every output after them NaN. The "
        "checkpoint is damaged or was quantized wrongly: re-download or re-export it"
    )


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
