"""``MlxLinear``: one mlx-lm quantized linear (or one expert's slice of stacked experts)."""

from __future__ import annotations

import functools
from typing import Any

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

    def _q4_1_unsupported(self) -> str | None:
        from anyquant.runtime.fastcpu import block_kernel_is_fast
        from anyquant.runtime.kernels.linear import fp16_exact

        st = self.settings
        if st.mode != "affine" or st.bits != 4 or st.group_size % 32:
            return f"{st.mode} {st.bits}-bit groups of {st.group_size}"
        if not block_kernel_is_fast():
            return "the compiled block kernel is not built (or not vectorized) here"
        assert self.biases is not None
        if self.scales.dtype not in (torch.bfloat16, torch.float16):
            return f"{self.scales.dtype} scales"
        if not (fp16_exact(self.scales) and fp16_exact(self.biases)):
            return "scales or biases that float16 does not hold exactly"
        return None

    def _table_unsupported(self) -> str | None:
        from anyquant.runtime import kernels

        if self.settings.mode not in ("mxfp4", "nvfp4"):
            return f"mode {self.settings.mode}"
        if not kernels.lut_available():
            return "the compiled 4-bit table kernel is not built here"
        return None if self.in_features % 32 == 0 else f"in_features {self.in_features} not a multiple of 32"

    def fast_cpu_unsupported(self) -> str | None:
        """``None`` when cpu-fast runs this layer: 4-bit affine groups as Q4_1 blocks (``d = scale``, ``m = bias``) on
        the compiled kernel, MXFP4/NVFP4 codes on its 4-bit table kernel, anything else as a bfloat16 copy prepacked
        for oneDNN where that runs fast."""
        if self._q4_1_unsupported() is None or self._table_unsupported() is None:
            return None
        from anyquant.runtime.fastcpu import bf16_head_status

        ok, reason = bf16_head_status()
        return None if ok else reason

    def to_fast_cpu(
        self, *, small_rows: int | None = None, prefill_dtype: torch.dtype | None = None
    ) -> torch.nn.Module:
        """Q4_1 blocks on the compiled kernel (4-bit affine), else a bfloat16 copy prepacked for oneDNN (mlx's own
        dequantized weight where its scales are bfloat16)."""
        if self._q4_1_unsupported() is None:
            from anyquant.runtime.kernels.linear import q4_1_from_codes

            from .dequant import unpack

            st = self.settings
            assert self.biases is not None
            codes = unpack(self.qweight, 4, self.in_features)
            per = st.group_size // 32
            blocks = q4_1_from_codes(
                codes, self.scales.repeat_interleave(per, dim=1), self.biases.repeat_interleave(per, dim=1)
            )
            return _q4_1_class()(
                blocks,
                self.out_features,
                self.in_features,
                self._buffers.get("bias"),
                scale_dtype=self.scales.dtype,
                small_rows=small_rows or 64,
                prefill_dtype=prefill_dtype,
                compute_dtype=self.compute_dtype,
                interleave=True,
            )
        if self._table_unsupported() is None:
            return self._fp4_table(small_rows, prefill_dtype)
        from anyquant.runtime.fastcpu import PrepackedBf16Linear

        return PrepackedBf16Linear(self)

    def _fp4_table(self, small_rows: int | None, prefill_dtype: torch.dtype | None) -> torch.nn.Module:
        """MXFP4/NVFP4 codes kept packed on the 4-bit table kernel (E2M1 the table, the E8M0/E4M3 scales)."""
        from anyquant.runtime.kernels.lut import Lut4Linear

        from .dequant import E2M1_SIGNED, fp4_scales, unpack

        st = self.settings
        return Lut4Linear(
            unpack(self.qweight, 4, self.in_features),
            fp4_scales(self.scales, st.mode),
            torch.tensor(E2M1_SIGNED, dtype=torch.float32),
            group=st.group_size,
            round_to=torch.bfloat16,
            bias=self._buffers.get("bias"),
            small_rows=small_rows or 64,
            prefill_dtype=prefill_dtype,
            compute_dtype=self.compute_dtype,
        )

    def extra_repr(self) -> str:
        st = self.settings
        return f"{super().extra_repr()}, mlx {st.mode} {st.bits}-bit g{st.group_size}"


@functools.cache
def _q4_1_class() -> type[torch.nn.Module]:
    from anyquant.runtime.kernels.linear import BlockLinear

    class MlxQ4_1Linear(BlockLinear):
        """An mlx-lm 4-bit affine linear as GGUF Q4_1 blocks (``d`` its scale, ``m`` its bias, per block of 32) on the
        compiled kernel. Few rows: the kernel (``q d + m`` in float32). Many rows and :meth:`dequantize`: mlx's own
        arithmetic from the blocks, ``scale * q`` then ``+ bias``, each rounded to the scales' dtype."""

        def __init__(
            self,
            blocks: torch.Tensor,
            out_features: int,
            in_features: int,
            bias: torch.Tensor | None,
            *,
            scale_dtype: torch.dtype,
            **kwargs: Any,
        ) -> None:
            super().__init__(blocks, "Q4_1", out_features, in_features, bias, **kwargs)
            self.scale_dtype = scale_dtype

        def dequantize(self) -> torch.Tensor:
            raw = self.raw_blocks().reshape(self.out_features, self.in_features // 32, 20)
            d = raw[..., 0:2].contiguous().view(torch.float16).to(self.scale_dtype)
            m = raw[..., 2:4].contiguous().view(torch.float16).to(self.scale_dtype)
            qs = raw[..., 4:]
            q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).to(self.scale_dtype)
            return (d * q + m).reshape(self.out_features, self.in_features)

        def exact_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return self.dequantize().to(dtype)

    return MlxQ4_1Linear
