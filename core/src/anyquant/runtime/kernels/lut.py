"""``cpu-fast``'s linear over 4-bit codes into a 16-entry float table with a float scale per group: bitsandbytes'
nf4/fp4 (the table is its ``quant_map``, the scale its block's absmax), FP4 E2M1 with E8M0 (MXFP4) or FP8 (NVFP4)
scales, kept packed (half a byte a weight, plus a float32 scale per group) instead of decoded to bfloat16.

- few rows (``<= small_rows``: decode): ``torch.ops.anyquant.lut4_gemv`` (``lut_gemv.cpp``): each weight formed in
  float32 as ``lut[q] * s``, float32 activations, float32 sums; no activation rounding;
- many rows (prompts) and :meth:`Lut4Linear.dequantize`: the format's exact weight, ``round_to(dtype, lut[q] * s)``
  (float32 product, one rounding: bitsandbytes' ``dequantize_4bit``, compressed-tensors' and mlx's FP4 decoders),
  and a GEMM in ``prefill_dtype``.

The decode path leaves out that rounding of each weight to ``round_to`` (bfloat16: a relative 2**-9 at most, like
GQ4's float16 rounding on the block kernel): inside cpu-fast's tolerance.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["Lut4Linear", "lut4_codes"]


def lut4_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` of codes ``[N, K]`` (0..15) in the op's layout: per block of 32, byte ``j`` holds code ``j``
    (low nibble) and code ``j + 16`` (high nibble)."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class Lut4Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W[n, k] = round_to(lut[q[n, k]] * scales[n, k // group])`` (see the module
    docstring for the two paths)."""

    codes: torch.Tensor
    scales: torch.Tensor
    lut: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        lut: torch.Tensor,
        *,
        group: int,
        round_to: torch.dtype,
        bias: torch.Tensor | None = None,
        small_rows: int = 64,
        prefill_dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``codes``: ``[out, in]`` in 0..15; ``scales``: ``[out, in / group]`` (any float dtype: kept as float32);
        ``lut``: the 16 values."""
        super().__init__()
        out_features, in_features = codes.shape
        if in_features % 32 or group < 16 or group % 16 or in_features % group:
            raise ValueError(f"Lut4Linear needs in_features a multiple of 32 and of group {group}, not {in_features}")
        if tuple(scales.shape) != (out_features, in_features // group) or lut.numel() != 16:
            raise ValueError(
                f"scales {tuple(scales.shape)} / lut {tuple(lut.shape)} do not fit [{out_features}, {in_features}]"
            )
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.round_to, self.small_rows, self.prefill_dtype = round_to, small_rows, prefill_dtype
        self.register_buffer("codes", lut4_codes(codes))
        self.register_buffer("scales", scales.to(torch.float32).contiguous())
        self.register_buffer("lut", lut.to(torch.float32).reshape(16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` in ``round_to``."""
        n, k = self.out_features, self.in_features
        packed = self.codes.reshape(n, k // 32, 16)
        q = torch.stack((packed & 0x0F, packed >> 4), dim=2).reshape(n, k).to(torch.long)
        s = self.scales.repeat_interleave(self.group, dim=1)
        return (self.lut[q] * s).to(self.round_to)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        y: torch.Tensor
        if x2.shape[0] <= self.small_rows:
            y = torch.ops.anyquant.lut4_gemv(
                x2.to(torch.float32).contiguous(), self.codes, self.scales, self.lut, self.group
            )
            y = y.to(x.dtype)
        else:
            dtype = self.prefill_dtype or x.dtype
            y = torch.mm(x2.to(dtype), self.dequantize().to(dtype).t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _apply(self, fn: Any, recurse: bool = True) -> Lut4Linear:
        """The codes stay on the CPU as they are: device moves are refused, dtype casts reach the bias only."""
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            moved = fn(buf)
            if moved.device != buf.device:
                raise RuntimeError("Lut4Linear (cpu-fast backend) runs on the CPU only; load with another backend")
            if name == "bias":
                self._buffers[name] = moved
        return self

    def packed_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values() if b is not None)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, 4-bit table, group={self.group}, "
            f"exact={str(self.round_to).replace('torch.', '')}, small_rows={self.small_rows}"
        )
