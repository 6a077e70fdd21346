"""``FP8Linear``: an FP8 e4m3 weight with its ``weight_scale_inv``, decoded as transformers' FineGrainedFP8 does."""

from __future__ import annotations

import torch

from anyquant.runtime.qlinear import QuantLinearBase

__all__ = ["FP8Linear", "dequantize_fp8"]


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """``round_to(dtype, float32(w) * float32(scale_inv[i // bh, j // bw]))``: transformers' ``Fp8Dequantize``
    (one float32 product, one rounding). Edge blocks shorter than ``block`` (a dimension not a multiple of it) read
    their block's scale, as DeepSeek-V3's reference does (transformers 5.24 refuses such checkpoints)."""
    w = weight.to(torch.float32)
    s = scale_inv.to(torch.float32)
    if block is None or s.numel() == 1:
        s = s.reshape(())
    else:
        rows, cols = w.shape
        s = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return (w * s).to(dtype)


class FP8Linear(QuantLinearBase):
    packed_names = ("weight_fp8", "weight_scale_inv")
    weight_fp8: torch.Tensor
    weight_scale_inv: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        scale_inv: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        block: tuple[int, int] | None,
        round_to: torch.dtype,
        mode: str = "reference",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, mode=mode, compute_dtype=compute_dtype)
        self.block, self.round_to = block, round_to
        self.set_packed(bias, weight_fp8=weight, weight_scale_inv=scale_inv)

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` in the model's dtype, as transformers dequantizes it."""
        if self._weight is not None:
            return self._weight
        return dequantize_fp8(self.weight_fp8, self.weight_scale_inv, self.block, self.round_to)

    def extra_repr(self) -> str:
        blocks = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per tensor"
        return f"{super().extra_repr()}, fp8 e4m3 {blocks}"

    # ------------------------------------------------------------------ cpu-fast

    def _kernel_scales(self) -> tuple[torch.Tensor, int] | None:
        """The op's per-row group scales, or ``None`` where its groups cannot hold this layout (partial blocks)."""
        from anyquant.runtime.kernels.lut import expand_block_scales

        n, k = self.out_features, self.in_features
        if self.block is None or self.weight_scale_inv.numel() == 1:
            return self.weight_scale_inv.reshape(1, 1).to(torch.float32).expand(n, 1).contiguous(), k
        if k % self.block[1] or self.block[1] % 16:
            return None
        return expand_block_scales(self.weight_scale_inv, n, k, self.block)

    def fast_cpu_unsupported(self) -> str | None:
        """Why :meth:`to_fast_cpu` cannot convert this layer (``None`` when it can): the FP8 kernel where it has its
        vector path, else a bfloat16 copy where the CPU runs bfloat16 fast."""
        from anyquant.runtime.fastcpu import bf16_head_status
        from anyquant.runtime.kernels.lut import fp8_kernel_runs

        if fp8_kernel_runs() and self.in_features % 16 == 0 and self._kernel_scales() is not None:
            return None
        ok, reason = bf16_head_status()
        return None if ok else reason

    def to_fast_cpu(
        self, *, small_rows: int | None = None, prefill_dtype: torch.dtype | None = None
    ) -> torch.nn.Module:
        """The FP8 bytes as they are on the compiled kernel's ``fp8_gemv`` (one byte a weight; the exact weight
        transformers' dequantization), else a bfloat16 copy prepacked for oneDNN."""
        from anyquant.runtime.fastcpu import PrepackedBf16Linear
        from anyquant.runtime.kernels.lut import E4M3Linear, fp8_kernel_runs

        kernel = self._kernel_scales() if fp8_kernel_runs() and self.in_features % 16 == 0 else None
        if kernel is None:
            return PrepackedBf16Linear(self)
        scales, group = kernel
        return E4M3Linear(
            self.weight_fp8,
            scales,
            group=group,
            round_to=self.round_to,
            bias=self._buffers.get("bias"),
            small_rows=small_rows or 64,
            prefill_dtype=prefill_dtype,
            compute_dtype=self.compute_dtype,
        )
