"""``mx.dequantize`` in torch, bit for bit (mlx 0.32).

Packing: a row's uint32 words are one little-endian bit string; value ``i`` is bits ``[i * bits, (i + 1) * bits)``
(3-, 5- and 6-bit values straddle words). ``affine``: ``w = scale * q + bias`` per group, in the scales' dtype with a
rounding after the product and after the sum (no fused multiply-add). ``mxfp4``/``nvfp4``: E2M1 codes times an E8M0
(``2 ** (e - 127)``) or E4M3 scale per group; ``mxfp8``: E4M3 values times an E8M0 scale; those three in bfloat16.
"""

from __future__ import annotations

import torch

from anyquant_runtime.tensors import PackedRows

__all__ = ["E2M1_SIGNED", "MlxRows", "dequantize", "fp4_scales", "unpack"]

#: FP4 E2M1 values by their 4-bit code (bit 3 the sign)
E2M1_SIGNED = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack(words: torch.Tensor, bits: int, count: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The ``count`` unsigned ``bits``-bit values of each row of uint32 ``words`` ``[..., cols]`` (int64, or ``dtype``
    for widths of 2, 4 and 8 bits: a fast backend's codes in uint8 are an eighth of int64's, 100 MB rather than 800
    for a 49152x2048 head)."""
    lead = words.shape[:-1]
    raw = words.contiguous().view(torch.uint8).reshape(*lead, -1)
    if bits in (2, 4, 8):
        per, mask = 8 // bits, (1 << bits) - 1
        parts = [(raw >> (bits * j)) & mask for j in range(per)]
        return torch.stack(parts, -1).reshape(*lead, -1)[..., :count].to(dtype)
    b = raw.to(torch.int64)
    w = b[..., 0::4] | (b[..., 1::4] << 8) | (b[..., 2::4] << 16) | (b[..., 3::4] << 24)
    w = torch.nn.functional.pad(w, (0, 1))
    start = torch.arange(count, dtype=torch.int64) * bits
    idx, shift = start // 32, start % 32
    return ((w[..., idx] >> shift) | (w[..., idx + 1] << (32 - shift))) & ((1 << bits) - 1)


def fp4_scales(scales: torch.Tensor, mode: str) -> torch.Tensor:
    """The MX modes' scales in float32: E4M3 (``nvfp4``) or E8M0, ``2 ** (e - 127)`` (``mxfp4``, ``mxfp8``)."""
    if mode == "nvfp4":
        return scales.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    return torch.exp2(scales.contiguous().view(torch.uint8).to(torch.float32) - 127)


def _per_group(scale: torch.Tensor, group: int) -> torch.Tensor:
    return scale.unsqueeze(-1).expand(*scale.shape, group)


def dequantize(
    weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None, bits: int, group_size: int, mode: str
) -> torch.Tensor:
    """The weight ``[..., out, in]`` as ``mx.dequantize(weight, scales, biases, group_size, bits, mode)`` gives it."""
    groups = scales.shape[-1]
    n = groups * group_size
    q = unpack(weight, bits, n).reshape(*weight.shape[:-1], groups, group_size)
    if mode == "affine":
        assert biases is not None
        s = _per_group(scales, group_size)
        out = s * q.to(scales.dtype) + _per_group(biases, group_size)  # two roundings in the scales' dtype
        return out.reshape(*weight.shape[:-1], n)
    s32 = fp4_scales(scales, mode)
    if mode == "mxfp8":
        v = q.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    else:
        v = torch.tensor(E2M1_SIGNED, dtype=torch.float32)[q]
    return (v * _per_group(s32, group_size)).to(torch.bfloat16).reshape(*weight.shape[:-1], n)


class MlxRows(PackedRows):
    """An mlx-quantized ``[rows, dim]`` table (an embedding, a tied head) kept packed and decoded a few rows at a
    time, each row as :func:`dequantize` gives it for the whole table (the groups are a row's own: bit for bit): the
    table a fast backend's head and embedding read instead of a decoded copy of it."""

    def __init__(
        self, weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None, bits: int, group: int, mode: str
    ) -> None:
        self.weight, self.scales, self.biases = weight, scales, biases
        self.bits, self.group, self.mode = bits, group, mode
        self.shape = (int(weight.shape[0]), int(scales.shape[-1]) * group)
        self.dtype = scales.dtype if mode == "affine" else torch.bfloat16

    @property
    def nbytes(self) -> int:
        """The packed bytes held."""
        held = (self.weight, self.scales) if self.biases is None else (self.weight, self.scales, self.biases)
        return sum(t.numel() * t.element_size() for t in held)

    def decode(self, index: slice | torch.Tensor) -> torch.Tensor:
        biases = None if self.biases is None else self.biases[index]
        return dequantize(self.weight[index], self.scales[index], biases, self.bits, self.group, self.mode)
