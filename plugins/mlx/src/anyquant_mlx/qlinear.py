"""``MlxLinear``: one mlx-lm quantized linear (or one expert's slice of stacked experts)."""

from __future__ import annotations

import torch

from anyquant_runtime.layouts import Affine4Blocks, Decoded, Layout, Table4
from anyquant_runtime.qlinear import QuantLinearBase

from .dequant import E2M1_SIGNED, dequantize, fp4_scales, unpack
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

    def packed_layouts(self) -> list[Layout]:
        """4-bit affine groups as they are, MXFP4/NVFP4 codes into the E2M1 table with their E8M0/E4M3 scales; each
        else (and any of them where its kernel does not run) a bfloat16 copy of mlx's own dequantized weight."""
        st, n, k = self.settings, self.out_features, self.in_features
        bias = self._buffers.get("bias")
        decoded: list[Layout] = [Decoded(self)]
        if st.mode == "affine" and st.bits == 4:
            assert self.biases is not None
            affine = Affine4Blocks(
                k,
                n,
                st.group_size,
                codes=lambda: unpack(self.qweight, 4, k, torch.uint8),
                scales=self.scales,
                biases=self.biases,
                bias=bias,
            )
            return [affine, *decoded]
        if st.mode in ("mxfp4", "nvfp4"):
            table = Table4(
                k,
                n,
                st.group_size,
                codes=lambda: unpack(self.qweight, 4, k, torch.uint8),
                scales=lambda: fp4_scales(self.scales, st.mode),
                table=torch.tensor(E2M1_SIGNED, dtype=torch.float32),
                round_to=torch.bfloat16,
                bias=bias,
            )
            return [table, *decoded]
        return decoded

    def extra_repr(self) -> str:
        st = self.settings
        return f"{super().extra_repr()}, mlx {st.mode} {st.bits}-bit g{st.group_size}"
