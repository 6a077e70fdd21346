"""``GPTQLinear``: a GPTQ-packed linear layer over the bit-exact reference dequantizer."""

from __future__ import annotations

import torch

from anyquant_runtime.layouts import Int4Groups, Layout
from anyquant_runtime.packing import int4_codes_from_rows
from anyquant_runtime.qlinear import QuantLinearBase

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

    def packed_layouts(self) -> list[Layout] | str:
        """Integer codes with a scale and a zero point per group (``g_idx`` as stored)."""
        if self.qweight is None:
            return "the packed tensors were dropped"
        return [
            Int4Groups(
                self.in_features,
                self.out_features,
                codes=lambda: int4_codes_from_rows(self.qweight)[: self.in_features],
                zeros=lambda: gptq_zero_points(
                    self.qzeros,
                    bits=self.bits,
                    checkpoint_format=self.checkpoint_format,  # type: ignore[arg-type]
                    out_features=self.out_features,
                    sym=self.sym,
                ),
                scales=self.scales,
                bits=self.bits,
                g_idx=self.g_idx,
                bias=self._buffers.get("bias"),
            )
        ]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}, format={self.checkpoint_format}"
