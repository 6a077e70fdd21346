"""``GPTQLinear``: a GPTQ-packed linear layer over the bit-exact reference dequantizer."""

from __future__ import annotations

from typing import Any

import torch

from anyquant.runtime.fastcpu import FastInt4Linear, contiguous_group_size, int4_codes_from_rows, unsupported_reason
from anyquant.runtime.qlinear import QuantLinearBase

from .dequant import dequantize_gptq, gptq_zero_points

__all__ = ["GPTQLinear"]


class GPTQLinear(QuantLinearBase):
    packed_names = ("qweight", "qzeros", "scales", "g_idx")
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        qzeros: torch.Tensor,
        scales: torch.Tensor,
        g_idx: torch.Tensor | None,
        bias: torch.Tensor | None,
        *,
        bits: int,
        in_features: int,
        out_features: int,
        checkpoint_format: str,
        sym: bool | None = None,
        mode: str = "reference",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(in_features, out_features, mode=mode, compute_dtype=compute_dtype)
        self.bits = bits
        self.checkpoint_format = checkpoint_format
        self.sym = sym
        self.set_packed(bias, qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)

    def dequantize(self) -> torch.Tensor:
        """The exact weight, ``[out, in]``, in the scales' dtype (as GPTQModel's torch kernel)."""
        if self.qweight is None:
            assert self._weight is not None
            return self._weight
        return dequantize_gptq(
            self.qweight,
            self.qzeros,
            self.scales,
            self.g_idx,
            bits=self.bits,
            sym=self.sym,
            checkpoint_format=self.checkpoint_format,  # type: ignore[arg-type]
            in_features=self.in_features,
        )

    def fast_cpu_unsupported(self) -> str | None:
        """Why :meth:`to_fast_cpu` cannot convert this layer (``None`` when it can)."""
        if self.qweight is None:
            return "the packed tensors were dropped"
        groups = contiguous_group_size(self.g_idx, self.in_features, self.scales.shape[0])
        return unsupported_reason(self.bits, self.in_features, self.out_features, groups)

    def to_fast_cpu(self, *, small_rows: int | None = None, prefill_dtype: torch.dtype | None = None) -> FastInt4Linear:
        """The same layer as a :class:`~anyquant.runtime.fastcpu.FastInt4Linear` (4-bit only)."""
        reason = self.fast_cpu_unsupported()
        if reason is not None:
            raise ValueError(f"GPTQ layer cannot run on the fast CPU path: {reason}")
        codes = int4_codes_from_rows(self.qweight)[: self.in_features]
        zeros = gptq_zero_points(
            self.qzeros,
            bits=self.bits,
            checkpoint_format=self.checkpoint_format,  # type: ignore[arg-type]
            out_features=self.out_features,
            sym=self.sym,
        )
        extra: dict[str, Any] = {} if small_rows is None else {"small_rows": small_rows}
        return FastInt4Linear(
            codes,
            zeros,
            self.scales,
            self.g_idx,
            self._buffers.get("bias"),
            compute_dtype=self.compute_dtype,
            prefill_dtype=prefill_dtype,
            **extra,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}, format={self.checkpoint_format}"
