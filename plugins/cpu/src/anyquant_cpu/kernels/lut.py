"""``cpu-fast``'s linear over 4-bit codes into a 16-entry float table with a float scale per group: bitsandbytes'
nf4/fp4 (the table is its ``quant_map``, the scale its block's absmax), FP4 E2M1 with E8M0 (MXFP4) or FP8 (NVFP4)
scales, kept packed (half a byte a weight, plus a float32 scale per group) instead of decoded to bfloat16.

- few rows (``<= small_rows``: decode): ``torch.ops.anyquant.lut4_gemv`` (``lut_gemv.cpp``): each weight formed in
  float32 as ``lut[q] * s`` and rounded as the format rounds it (its exact weight), float32 activations, float32
  sums: no activation rounding, only the summation order differs from the exact path;
- many rows (prompts) and :meth:`Lut4Linear.dequantize`: the format's exact weight, ``round_to(dtype, lut[q] * s)``
  (float32 product, one rounding: bitsandbytes' ``dequantize_4bit``, compressed-tensors' and mlx's FP4 decoders),
  and a GEMM in ``prefill_dtype``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .linear import cpu_only_apply, kernel_forward

#: the ops' ``round``: each formed weight rounded to the format's dtype before the multiply-add
ROUND_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

__all__ = ["ROUND_CODES", "E4M3Linear", "Lut4Linear", "expand_block_scales", "fp8_kernel_runs", "lut4_codes"]


def _dequant_op() -> bool:
    """Whether the compiled exact-weight ops are loaded (the library's ``lut4_dequant`` / ``fp8_dequant``)."""
    from . import has_op, lut_available

    return lut_available() and has_op("fp8_dequant")


def lut4_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` of codes ``[N, K]`` (0..15) in the op's layout: per block of 32, byte ``j`` holds code ``j``
    (low nibble) and code ``j + 16`` (high nibble)."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class _KernelRows(nn.Module):
    """What the two share: :func:`~anyquant_cpu.kernels.linear.kernel_forward` over ``_few_rows`` and
    :meth:`exact_weight`, CPU-only buffers, their bytes."""

    in_features: int
    out_features: int
    small_rows: int
    prefill_dtype: torch.dtype | None
    bias: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _few_rows(self, x2: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def exact_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_forward(self, x, self._few_rows)

    def _apply(self, fn: Any, recurse: bool = True) -> _KernelRows:
        out: _KernelRows = cpu_only_apply(self, fn)
        return out

    def packed_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values() if b is not None)


class Lut4Linear(_KernelRows):
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
        # one storage: the 16 values, then the scales (the compiled decode step passes it as one tensor)
        table = torch.cat((lut.to(torch.float32).reshape(16), scales.to(torch.float32).reshape(-1)))
        self.register_buffer("lut", table[:16])
        self.register_buffer("scales", table[16:].view(out_features, in_features // group))
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))

    def table(self) -> torch.Tensor | None:
        """The values and the scales as the one tensor they are views of (``None`` where they no longer are)."""
        lut, scales = self.lut, self.scales
        if lut.dtype != torch.float32 or scales.dtype != torch.float32 or not scales.is_contiguous():
            return None
        if lut.untyped_storage().data_ptr() != scales.untyped_storage().data_ptr():
            return None
        if scales.storage_offset() != lut.storage_offset() + 16 or not lut.is_contiguous():
            return None
        return torch.as_strided(lut, (16 + scales.numel(),), (1,), lut.storage_offset())

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` in ``round_to`` (``anyquant::lut4_dequant`` where built: the same values)."""
        if _dequant_op():
            w: torch.Tensor = torch.ops.anyquant.lut4_dequant(
                self.codes, self.scales, self.lut, self.group, ROUND_CODES[self.round_to]
            )
            return w.to(self.round_to)
        n, k = self.out_features, self.in_features
        packed = self.codes.reshape(n, k // 32, 16)
        q = torch.stack((packed & 0x0F, packed >> 4), dim=2).reshape(n, k).to(torch.long)
        s = self.scales.repeat_interleave(self.group, dim=1)
        return (self.lut[q] * s).to(self.round_to)

    def _few_rows(self, x2: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.anyquant.lut4_gemv(
            x2.to(torch.float32).contiguous(), self.codes, self.scales, self.lut, self.group, ROUND_CODES[self.round_to]
        )
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, 4-bit table, group={self.group}, "
            f"exact={str(self.round_to).replace('torch.', '')}, small_rows={self.small_rows}"
        )


def fp8_kernel_runs() -> bool:
    """Whether ``anyquant::fp8_gemv`` has its vector path here (AVX512F; elsewhere its scalar loop is slower than a
    bfloat16 or float32 copy, so formats keep those)."""
    from . import lut_available, lut_isa

    return lut_available() and lut_isa() == 2


def expand_block_scales(scales: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """``[ceil(rows/bh), ceil(cols/bw)]`` block scales as the op's per-row groups: ``([rows, cols/bw], bw)``."""
    bh, bw = block
    return scales.to(torch.float32).repeat_interleave(bh, dim=0)[:rows].contiguous(), bw


class E4M3Linear(_KernelRows):
    """``y = x @ W.T + b`` with ``W[n, k] = round_to(e4m3(q[n, k]) * scales[n, k // group])``: FP8 weights kept as their
    bytes (``quant_method: fp8``, compressed-tensors' float-quantized). Few rows: ``torch.ops.anyquant.fp8_gemv``
    (each weight formed in float32 and rounded to ``round_to``: the exact weight; float32 activations); many rows and
    :meth:`dequantize`: the exact weight (float32 product, one rounding to ``round_to``) and a GEMM."""

    weight_bits: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        *,
        group: int,
        round_to: torch.dtype,
        bias: torch.Tensor | None = None,
        small_rows: int = 64,
        prefill_dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % 16 or group < 16 or group % 16 or in_features % group:
            raise ValueError(f"E4M3Linear needs in_features a multiple of 16 and of group {group}, not {in_features}")
        if tuple(scales.shape) != (out_features, in_features // group):
            raise ValueError(
                f"scales {tuple(scales.shape)} do not fit [{out_features}, {in_features}] in groups of {group}"
            )
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.round_to, self.small_rows, self.prefill_dtype = round_to, small_rows, prefill_dtype
        self.register_buffer("weight_bits", weight.contiguous().view(torch.uint8))
        self.register_buffer("scales", scales.to(torch.float32).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` in ``round_to`` (``anyquant::fp8_dequant`` where built: the same values)."""
        if _dequant_op():
            out: torch.Tensor = torch.ops.anyquant.fp8_dequant(
                self.weight_bits, self.scales, self.group, ROUND_CODES[self.round_to]
            )
            return out.to(self.round_to)
        w = self.weight_bits.view(torch.float8_e4m3fn).to(torch.float32)
        return (w * self.scales.repeat_interleave(self.group, dim=1)).to(self.round_to)

    def _few_rows(self, x2: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.anyquant.fp8_gemv(
            x2.to(torch.float32).contiguous(), self.weight_bits, self.scales, self.group, ROUND_CODES[self.round_to]
        )
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, group={self.group}, "
            f"exact={str(self.round_to).replace('torch.', '')}, small_rows={self.small_rows}"
        )
