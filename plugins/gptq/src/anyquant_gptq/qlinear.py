"""``GPTQLinear``: a GPTQ-packed linear layer over the bit-exact reference dequantizer."""

from __future__ import annotations

import torch

from anyquant.runtime.qlinear import QuantLinearBase

from .dequant import dequantize_gptq

__all__ = ["GPTQLinear"]


class GPTQLinear(QuantLinearBase):
    packed_names = ("qweight", "qzeros", "scales", "g_idx")

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
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.register_buffer("g_idx", g_idx)
        self.set_bias(bias)
        self.finalize()

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

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}, format={self.checkpoint_format}"
