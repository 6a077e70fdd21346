"""``AWQLinear``: an AWQ-packed linear layer (GEMM or GEMV layout) over the reference dequantizer."""

from __future__ import annotations

from typing import Any

import torch

from anyquant.runtime.fastcpu import FastInt4Linear, int4_codes_from_cols, unsupported_reason
from anyquant.runtime.packing import unpack_cols
from anyquant.runtime.qlinear import QuantLinearBase

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

    def fast_cpu_unsupported(self) -> str | None:
        """Why :meth:`to_fast_cpu` cannot convert this layer (``None`` when it can)."""
        if self.qweight is None:
            return "the packed tensors were dropped"
        group = self._group()
        return unsupported_reason(
            self.bits, self.in_features, self.out_features, group if self.in_features % group == 0 else None
        )

    def to_fast_cpu(self, *, small_rows: int | None = None, prefill_dtype: torch.dtype | None = None) -> FastInt4Linear:
        """The same layer as a :class:`~anyquant.runtime.fastcpu.FastInt4Linear`."""
        reason = self.fast_cpu_unsupported()
        if reason is not None:
            raise ValueError(f"AWQ layer cannot run on the fast CPU path: {reason}")
        groups = self.in_features // self._group()
        if self.layout == "gemm":
            natural = int4_codes_from_cols(self.qweight)  # [K, N] in AWQ's interleaved column order
            order = torch.tensor(AWQ_UNPACK_ORDER, dtype=torch.int64)
            codes = natural.view(self.in_features, -1, 8)[..., order].reshape(self.in_features, self.out_features)
            scales = self.scales
            zeros = None if self.qzeros is None else unpack_awq_gemm_cols(self.qzeros)
        else:
            codes = int4_codes_from_cols(self.qweight).t()  # [N, K] -> [K, N]
            scales = self.scales[:, :groups].t().contiguous()
            zeros = None if self.qzeros is None else unpack_cols(self.qzeros, self.bits, count=groups).t()
        if zeros is None:  # zero_point=False: the implicit 2**(b-1), as the reference dequantizer
            zeros = torch.full((groups, self.out_features), 1 << (self.bits - 1), dtype=torch.int32)
        extra: dict[str, Any] = {} if small_rows is None else {"small_rows": small_rows}
        return FastInt4Linear(
            codes,
            zeros,
            scales,
            None,
            self._buffers.get("bias"),
            compute_dtype=self.compute_dtype,
            prefill_dtype=prefill_dtype,
            **extra,
        )

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
