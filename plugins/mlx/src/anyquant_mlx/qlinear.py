"""``MlxLinear``: one mlx-lm quantized linear (or one expert's slice of stacked experts)."""

from __future__ import annotations

import torch

from anyquant.runtime.qlinear import QuantLinearBase

from .dequant import dequantize
from .scheme import Settings

__all__ = ["MlxLinear"]


class MlxLinear(QuantLinearBase):
    packed_names = ("qweight", "scales", "biases")
    qweight: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        biases: torch.Tensor | None,
        bias: torch.Tensor | None,
        settings: Settings,
        *,
        mode: str = "reference",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        out_features, in_features = qweight.shape[0], scales.shape[-1] * settings.group_size
        super().__init__(in_features, out_features, mode=mode, compute_dtype=compute_dtype)
        self.settings = settings
        self.set_packed(bias, qweight=qweight, scales=scales, biases=biases)

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` as ``mx.dequantize`` gives it (the scales' dtype; bfloat16 for MX modes)."""
        if self._weight is not None:
            return self._weight
        st = self.settings
        return dequantize(self.qweight, self.scales, self.biases, st.bits, st.group_size, st.mode)

    def fast_cpu_unsupported(self) -> str | None:
        from anyquant.runtime.fastcpu import bf16_head_status

        ok, reason = bf16_head_status()
        return None if ok else reason

    def to_fast_cpu(
        self, *, small_rows: int | None = None, prefill_dtype: torch.dtype | None = None
    ) -> torch.nn.Module:
        """A bfloat16 copy prepacked for oneDNN: mlx's own dequantized weight where its scales are bfloat16."""
        from anyquant.runtime.fastcpu import PrepackedBf16Linear

        return PrepackedBf16Linear(self)

    def extra_repr(self) -> str:
        st = self.settings
        return f"{super().extra_repr()}, mlx {st.mode} {st.bits}-bit g{st.group_size}"
