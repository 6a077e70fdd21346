"""``AWQLinear``: an AWQ-packed linear layer (GEMM or GEMV layout) over the reference dequantizer."""

from __future__ import annotations

import torch

from anyquant_runtime.layouts import Int4Groups, Layout
from anyquant_runtime.packing import int4_codes_from_cols, unpack_cols
from anyquant_runtime.qlinear import QuantLinearBase

from .dequant import AWQ_UNPACK_ORDER, dequantize_awq_gemm, dequantize_awq_gemv, unpack_awq_gemm_cols

__all__ = ["AWQLinear", "ScaledActivation"]


class AWQLinear(QuantLinearBase):
    packed_names = ("qweight", "qzeros", "scales")
    qweight: torch.Tensor
    qzeros: torch.Tensor | None
    scales: torch.Tensor

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
        self.set_packed(bias, qweight=qweight, qzeros=qzeros, scales=scales)

    def dequantize(self) -> torch.Tensor:
        """The exact weight, ``[out, in]``, in the scales' dtype (as AutoAWQ's ``dequantize_gemm``)."""
        if self.qweight is None:
            assert self._weight is not None
            return self._weight
        fn = dequantize_awq_gemm if self.layout == "gemm" else dequantize_awq_gemv
        return fn(self.qweight, self.qzeros, self.scales, bits=self.bits, group_size=self.group_size)

    def _group(self) -> int:
        return self.in_features if self.group_size == -1 else self.group_size

    def packed_layouts(self) -> list[Layout] | str:
        """Integer codes with a scale and a zero point per contiguous group (GEMM and GEMV layouts alike)."""
        if self.qweight is None:
            return "the packed tensors were dropped"
        return [
            Int4Groups(
                self.in_features,
                self.out_features,
                codes=self._codes,
                zeros=self._zeros,
                scales=self._scales,
                bits=self.bits,
                group_size=self._group(),
                bias=self._buffers.get("bias"),
            )
        ]

    def _groups(self) -> int:
        return self.in_features // self._group()

    def _codes(self) -> torch.Tensor:
        """The codes ``[in, out]`` in the natural column order."""
        if self.layout == "gemm":
            natural = int4_codes_from_cols(self.qweight)  # [K, N] in AWQ's interleaved column order
            order = torch.tensor(AWQ_UNPACK_ORDER, dtype=torch.int64)
            return natural.view(self.in_features, -1, 8)[..., order].reshape(self.in_features, self.out_features)
        return int4_codes_from_cols(self.qweight).t()  # [N, K] -> [K, N]

    def _scales(self) -> torch.Tensor:
        """The scales ``[G, out]``."""
        if self.layout == "gemm":
            return self.scales
        return self.scales[:, : self._groups()].t().contiguous()

    def _zeros(self) -> torch.Tensor:
        """The zero points ``[G, out]`` (``zero_point=False``: the implicit ``2 ** (bits - 1)``, as the reference)."""
        groups = self._groups()
        if self.qzeros is None:
            return torch.full((groups, self.out_features), 1 << (self.bits - 1), dtype=torch.int32)
        if self.layout == "gemm":
            return unpack_awq_gemm_cols(self.qzeros)
        return unpack_cols(self.qzeros, self.bits, count=groups).t()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layout={self.layout}, bits={self.bits}, group_size={self.group_size}"


class ScaledActivation(torch.nn.Module):
    """AutoAWQ's scaled activation: ``act(x) / scales`` (GELU models store ``P.act.scales``)."""

    def __init__(self, act: torch.nn.Module, scales: torch.Tensor) -> None:
        super().__init__()
        self.act = act
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.act(x) / self.scales.to(x.dtype)
        return y
