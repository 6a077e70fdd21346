"""``cpu-fast``'s linear over 4-bit codes into a 16-entry float table with a float scale per group: bitsandbytes'
nf4/fp4 (the table is its ``quant_map``, the scale its block's absmax), FP4 E2M1 with E8M0 (MXFP4) or FP8 (NVFP4)
scales, kept packed (half a byte a weight, plus a float32 scale per group) instead of decoded to bfloat16.

- few rows (``<= small_rows``: decode): ``torch.ops.anyquant.lut4_gemv`` (``lut_gemv.cpp``): each weight formed in
  float32 as ``lut[q] * s`` and rounded as the format rounds it (its exact weight), float32 activations, float32
  sums: no activation rounding, only the summation order differs from the exact path;
- many rows (prompts) and :meth:`Lut4Linear.dequantize`: the format's exact weight, ``round_to(dtype, lut[q] * s)``
  (float32 product, one rounding: bitsandbytes' ``dequantize_4bit``, compressed-tensors' and mlx's FP4 decoders),
  and a GEMM in ``prefill_dtype``. A prompt's weight is never whole: it is formed and multiplied in slices of
  output rows (:func:`prompt_slices`, about :data:`PROMPT_SLICE_BYTES` each), each slice written by the kernel's
  ``lut4_dequant_out`` / ``fp8_dequant_out`` straight into one buffer in the GEMM's dtype (no float32 copy), and
  ``y[:, r0:r1] = x @ W[r0:r1].T`` into one output. Each output element is the same dot product over
  ``in_features``, and torch's CPU GEMMs (MKL float32, oneDNN bfloat16 / float16) give it bit for bit as the whole
  weight's GEMM does as long as no call is narrower than :data:`SLICE_ROWS` (MKL's float32 path sums a call of a
  few columns in another order: a last slice that narrow joins the one before); ``tests/test_lut4_prompt_slices.py``
  checks it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .linear import PROMPT_SLICE_BYTES, SLICE_ROWS, cpu_only_apply, kernel_forward, prompt_slices

#: the ops' ``round``: each formed weight rounded to the format's dtype before the multiply-add
ROUND_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

__all__ = [
    "PROMPT_SLICE_BYTES",
    "ROUND_CODES",
    "SLICE_ROWS",
    "E4M3Linear",
    "Lut4Linear",
    "expand_block_scales",
    "fp8_kernel_runs",
    "lut4_codes",
    "prompt_slices",
]


def _dequant_op() -> bool:
    """Whether the compiled exact-weight ops are loaded (the library's ``lut4_dequant`` / ``fp8_dequant``)."""
    from . import has_op, lut_available

    return lut_available() and has_op("fp8_dequant")


def _dequant_out_op() -> bool:
    """Whether the loaded library writes exact weights into a buffer (``lut4_dequant_out`` / ``fp8_dequant_out``)."""
    from . import has_op

    return _dequant_op() and has_op("fp8_dequant_out")


def lut4_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` of codes ``[N, K]`` (0..15) in the op's layout: per block of 32, byte ``j`` holds code ``j``
    (low nibble) and code ``j + 16`` (high nibble)."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class _KernelRows(nn.Module):
    """What the two share: :func:`~anyquant_cpu.kernels.linear.kernel_forward` over ``_few_rows`` and the exact
    weight in slices of rows (:meth:`_many_rows`), CPU-only buffers, their bytes."""

    in_features: int
    out_features: int
    small_rows: int
    prefill_dtype: torch.dtype | None
    round_to: torch.dtype
    bias: torch.Tensor | None
    #: the prompt path's slice budget (:func:`prompt_slices`); an instance may set its own
    prompt_slice_bytes: int = PROMPT_SLICE_BYTES

    def dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:  # pragma: no cover - abstract
        """Rows ``r0:r1`` of :meth:`dequantize` (formed from those rows' codes only)."""
        raise NotImplementedError

    def _dequant_out(self, r0: int, r1: int, code: int, out: torch.Tensor) -> None:  # pragma: no cover - abstract
        """The kernel's ``*_dequant_out`` of rows ``r0:r1``, rounded by ``code`` (:data:`ROUND_CODES`), into ``out``."""
        raise NotImplementedError

    def dequantize_rows_into(self, r0: int, r1: int, out: torch.Tensor) -> None:
        """Rows ``r0:r1`` of :meth:`exact_weight` in ``out``'s dtype, written into ``out`` (contiguous
        ``[r1 - r0, in]``): the kernel's ``*_dequant_out`` where loaded, else a copy of :meth:`dequantize_rows`."""
        if out.dtype in ROUND_CODES and _dequant_out_op():
            self._dequant_out(r0, r1, ROUND_CODES[self.round_to], out)
        else:
            out.copy_(self.dequantize_rows(r0, r1))

    def _few_rows(self, x2: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` in ``round_to``."""
        return self.dequantize_rows(0, self.out_features)

    def exact_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_forward(self, x, self._few_rows, self._many_rows)

    def _many_rows(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 @ exact_weight(x2.dtype).T``, bit for bit, with the weight formed a slice of rows at a time
        (:func:`prompt_slices`) into one buffer (the whole weight at once where autograd records: ``out=`` records
        no gradient)."""
        if x2.requires_grad and torch.is_grad_enabled():
            return torch.mm(x2, self.exact_weight(x2.dtype).t())
        n, k = self.out_features, self.in_features
        slices = prompt_slices(n, k, self.prompt_slice_bytes, x2.element_size())
        y = torch.empty(x2.shape[0], n, dtype=x2.dtype)
        buf = torch.empty(max(r1 - r0 for r0, r1 in slices), k, dtype=x2.dtype)
        for r0, r1 in slices:
            w = buf[: r1 - r0]
            self.dequantize_rows_into(r0, r1, w)
            torch.mm(x2, w.t(), out=y[:, r0:r1])
        return y

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

    def dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0:r1`` of the exact weight ``[out, in]`` in ``round_to`` (``anyquant::lut4_dequant`` where built:
        the same values), from those rows' codes and scales."""
        codes, scales = self.codes[r0:r1], self.scales[r0:r1]
        if _dequant_op():
            w: torch.Tensor = torch.ops.anyquant.lut4_dequant(
                codes, scales, self.lut, self.group, ROUND_CODES[self.round_to]
            )
            return w.to(self.round_to)
        n, k = r1 - r0, self.in_features
        packed = codes.reshape(n, k // 32, 16)
        q = torch.stack((packed & 0x0F, packed >> 4), dim=2).reshape(n, k).to(torch.long)
        s = scales.repeat_interleave(self.group, dim=1)
        return (self.lut[q] * s).to(self.round_to)

    def _dequant_out(self, r0: int, r1: int, code: int, out: torch.Tensor) -> None:
        torch.ops.anyquant.lut4_dequant_out(self.codes[r0:r1], self.scales[r0:r1], self.lut, self.group, code, out)

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
    :meth:`dequantize`: the exact weight (float32 product, one rounding to ``round_to``) and a GEMM (in slices of
    rows, as :class:`Lut4Linear`'s)."""

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

    def dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0:r1`` of the exact weight ``[out, in]`` in ``round_to`` (``anyquant::fp8_dequant`` where built:
        the same values)."""
        bits, scales = self.weight_bits[r0:r1], self.scales[r0:r1]
        if _dequant_op():
            out: torch.Tensor = torch.ops.anyquant.fp8_dequant(bits, scales, self.group, ROUND_CODES[self.round_to])
            return out.to(self.round_to)
        w = bits.view(torch.float8_e4m3fn).to(torch.float32)
        return (w * scales.repeat_interleave(self.group, dim=1)).to(self.round_to)

    def _dequant_out(self, r0: int, r1: int, code: int, out: torch.Tensor) -> None:
        torch.ops.anyquant.fp8_dequant_out(self.weight_bits[r0:r1], self.scales[r0:r1], self.group, code, out)

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
