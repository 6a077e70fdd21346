"""``AWQLinear``: an AWQ-packed linear layer (GEMM or GEMV layout) over the reference dequantizer."""

from __future__ import annotations

import torch

from anyquant.runtime.qlinear import QuantLinearBase

from .dequant import dequantize_awq_gemm, dequantize_awq_gemv

__all__ = ["AWQLinear", "ScaledActivation"]


class AWQLinear(QuantLinearBase):
    packed_names = ("qweight", "qzeros", "scales")

    def __init__(
        self,
        qweight: torch.Tensor,
        qzeros: torch.Tensor | None,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        layout: str,
        bits: int,
        group_size: int,
        in_features: int,
        out_features: int,
        mode: str = "reference",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(in_features, out_features, mode=mode, compute_dtype=compute_dtype)
        if layout not in ("gemm", "gemv"):
            raise ValueError(f"AWQ layout {layout!r} has no CPU dequantizer")
        self.layout, self.bits, self.group_size = layout, bits, group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.set_bias(bias)
        self.finalize()

    def dequantize(self) -> torch.Tensor:
        """The exact weight, ``[out, in]``, in the scales' dtype (as AutoAWQ's ``dequantize_gemm``)."""
        if self.qweight is None:
            assert self._weight is not None
            return self._weight
        fn = dequantize_awq_gemm if self.layout == "gemm" else dequantize_awq_gemv
        return fn(self.qweight, self.qzeros, self.scales, bits=self.bits, group_size=self.group_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layout={self.layout}, bits={self.bits}, group_size={self.group_size}"


class ScaledActivation(torch.nn.Module):
    """AutoAWQ's scaled activation: ``act(x) / scales`` (GELU models store ``P.act.scales``)."""

    def __init__(self, act: torch.nn.Module, scales: torch.Tensor) -> None:
        super().__init__()
        self.act = act
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) / self.scales.to(x.dtype)
