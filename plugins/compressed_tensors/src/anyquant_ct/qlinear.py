"""``CTLinear``: one compressed-tensors linear over the bit-exact decoders of :mod:`anyquant_ct.dequant`."""

from __future__ import annotations

import functools
from typing import Any

import torch

from anyquant.runtime.fastcpu import FastInt4Linear, contiguous_group_size, unsupported_reason
from anyquant.runtime.qlinear import QuantLinearBase

from .dequant import dequantize_fp4, dequantize_naive, dequantize_packed, quantize_input, unpack_int32
from .scheme import QArgs

__all__ = ["CTLinear"]


class CTLinear(QuantLinearBase):
    """A linear stored as compressed-tensors writes it (``storage``: ``packed-int``, ``int8``, ``fp8``, ``nvfp4``,
    ``mxfp4``); ``input_args`` quantizes its input as compressed-tensors' forward does."""

    packed_names = (
        "weight_packed",
        "weight_q",
        "weight_scale",
        "weight_zero_point",
        "weight_g_idx",
        "weight_global_scale",
    )
    weight_packed: torch.Tensor | None
    weight_q: torch.Tensor | None
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor | None
    weight_g_idx: torch.Tensor | None
    weight_global_scale: torch.Tensor | None
    input_scale: torch.Tensor | None
    input_zero_point: torch.Tensor | None
    input_global_scale: torch.Tensor | None

    def __init__(
        self,
        storage: str,
        args: QArgs,
        tensors: dict[str, torch.Tensor],
        bias: torch.Tensor | None,
        *,
        in_features: int,
        out_features: int,
        input_args: QArgs | None = None,
        mode: str = "reference",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(in_features, out_features, mode=mode, compute_dtype=compute_dtype)
        self.storage, self.args, self.input_args = storage, args, input_args
        self.register_buffer("input_scale", tensors.get("input_scale"), persistent=False)
        self.register_buffer("input_zero_point", tensors.get("input_zero_point"), persistent=False)
        self.register_buffer("input_global_scale", tensors.get("input_global_scale"), persistent=False)
        self.set_packed(
            bias,
            weight_packed=tensors.get("weight_packed"),
            weight_q=tensors.get("weight"),
            weight_scale=tensors["weight_scale"],
            weight_zero_point=tensors.get("weight_zero_point"),
            weight_g_idx=tensors.get("weight_g_idx"),
            weight_global_scale=tensors.get("weight_global_scale"),
        )

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` as compressed-tensors' decompressor gives it (in its dtype)."""
        if self._weight is not None:
            return self._weight
        shape = (self.out_features, self.in_features)
        if self.storage == "packed-int":
            assert self.weight_packed is not None
            return dequantize_packed(
                self.weight_packed, self.weight_scale, self.weight_zero_point, self.weight_g_idx, self.args, shape
            )
        if self.storage in ("nvfp4", "mxfp4"):
            assert self.weight_packed is not None
            return dequantize_fp4(
                self.weight_packed, self.weight_scale, self.weight_global_scale, self.args, mx=self.storage == "mxfp4"
            )
        assert self.weight_q is not None
        return dequantize_naive(self.weight_q, self.weight_scale, self.weight_zero_point, self.weight_g_idx, self.args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_args is not None:
            x = quantize_input(x, self.input_args, self.input_scale, self.input_zero_point, self.input_global_scale)
        return super().forward(x)

    # ------------------------------------------------------------------ cpu-fast

    def _group_size(self) -> int | None:
        if self.args.strategy == "channel":
            return self.in_features
        if self.args.strategy != "group":
            return None
        return contiguous_group_size(self.weight_g_idx, self.in_features, self.weight_scale.shape[-1])

    def fast_cpu_unsupported(self) -> str | None:
        """Why :meth:`to_fast_cpu` cannot convert this layer (``None`` when it can): 4-bit packed integers go to core's
        int4 path (GQ4 blocks on the compiled kernel), 8-bit integers to Q8_0 blocks on it; the rest stays exact."""
        if self.weight_packed is None and self.weight_q is None:
            return "the packed tensors were dropped"
        if self.storage in ("int8", "packed-int") and self.args.num_bits == 8:
            return self._q8_0_unsupported()
        if self.storage == "fp8":
            return self._e4m3_unsupported()
        if self.storage in ("nvfp4", "mxfp4"):
            from anyquant.runtime import kernels

            if not kernels.lut_available():
                return "FP4 weights run on the compiled 4-bit table kernel, which is not built here"
            if self.input_args is not None and self.input_args.num_bits == 4:
                # FP4 activations amplify the kernel's unrounded weights past any tolerance: the exact path
                return "FP4 input activations (NVFP4 W4A4) run on the exact path"
            return None if self.in_features % 32 == 0 else f"in_features {self.in_features} not a multiple of 32"
        if self.storage != "packed-int" or self.args.num_bits != 4:
            return f"{self.storage} {self.args.num_bits}-bit weights have no fast CPU path yet"
        if self.input_args is not None:
            return "its input activations are quantized (the exact path applies them)"
        if self.args.strategy not in ("group", "channel"):
            return f"per-{self.args.strategy} scales"
        return unsupported_reason(4, self.in_features, self.out_features, self._group_size())

    def _q8_0_unsupported(self) -> str | None:
        from anyquant.runtime.fastcpu import block_kernel_is_fast
        from anyquant.runtime.kernels.linear import fp16_exact

        if not block_kernel_is_fast():
            return "8-bit weights run on the compiled block kernel, which is not built (or not vectorized) here"
        if self.weight_zero_point is not None:
            return "8-bit weights with zero points (Q8_0 blocks have none)"
        if self.weight_g_idx is not None or self.in_features % 32:
            return "8-bit weights whose groups are not contiguous blocks of 32"
        if self.args.strategy == "group" and (self.args.group_size or 1) % 32:
            return f"8-bit groups of {self.args.group_size} (Q8_0 blocks are 32)"
        if self.args.strategy not in ("tensor", "channel", "group"):
            return f"8-bit weights with per-{self.args.strategy} scales"
        if not fp16_exact(self.weight_scale):
            return "8-bit scales that float16 does not hold exactly (Q8_0 blocks keep float16 scales)"
        return None

    def _e4m3_scales(self) -> tuple[torch.Tensor, int] | None:
        """The FP8 kernel's per-row group scales (``None``: a layout its groups cannot hold)."""
        from anyquant.runtime.kernels.lut import expand_block_scales

        n, k, s, a = self.out_features, self.in_features, self.weight_scale, self.args
        if a.strategy == "tensor":
            return s.reshape(1, 1).to(torch.float32).expand(n, 1).contiguous(), k
        if a.strategy == "channel":
            return s.reshape(n, 1).to(torch.float32), k
        if a.strategy == "group" and a.group_size and a.group_size % 16 == 0 and self.weight_g_idx is None:
            return s.reshape(n, -1).to(torch.float32), a.group_size
        if (
            a.strategy == "block"
            and a.block_structure
            and k % a.block_structure[1] == 0
            and a.block_structure[1] % 16 == 0
        ):
            return expand_block_scales(s, n, k, a.block_structure)
        return None

    def _e4m3_unsupported(self) -> str | None:
        from anyquant.runtime.kernels.lut import fp8_kernel_runs

        if not fp8_kernel_runs():
            return "FP8 weights run on the compiled kernel's fp8_gemv, which has no vector path here (AVX512F)"
        if self.weight_zero_point is not None or self.in_features % 16:
            return "FP8 weights with zero points or rows not a multiple of 16"
        return (
            None if self._e4m3_scales() is not None else f"FP8 scales per {self.args.strategy} the kernel does not hold"
        )

    def _e4m3(self, small_rows: int | None, prefill_dtype: torch.dtype | None) -> torch.nn.Module:
        """FP8 bytes as stored on ``fp8_gemv``, behind the input quantization the config asks for."""
        from anyquant.runtime.kernels.lut import E4M3Linear

        kernel = self._e4m3_scales()
        assert kernel is not None and self.weight_q is not None
        layer: torch.nn.Module = E4M3Linear(
            self.weight_q,
            kernel[0],
            group=kernel[1],
            round_to=self.weight_scale.dtype,
            bias=self._buffers.get("bias"),
            small_rows=small_rows or 64,
            prefill_dtype=prefill_dtype,
            compute_dtype=self.compute_dtype,
        )
        return self._behind_inputs(layer)

    def _behind_inputs(self, layer: torch.nn.Module) -> torch.nn.Module:
        """A fast layer behind the input quantization the config asks for (the layer itself where it asks none)."""
        if self.input_args is None:
            return layer
        return InputQuantized(layer, self.input_args, self.input_scale, self.input_zero_point, self.input_global_scale)

    def _fp4_table(self, small_rows: int | None, prefill_dtype: torch.dtype | None) -> torch.nn.Module:
        """NVFP4/MXFP4 codes kept packed on the 4-bit table kernel: the E2M1 table, each group's scale as
        compressed-tensors forms it (``bf16(fp8 scale) / weight_global_scale``, or ``2 ** (e - 127)``)."""
        from anyquant.runtime.kernels.lut import Lut4Linear

        from .dequant import E2M1, mx_scale

        assert self.weight_packed is not None
        packed = self.weight_packed
        codes = torch.stack((packed & 0x0F, packed >> 4), -1).reshape(self.out_features, self.in_features)
        if self.storage == "mxfp4":
            scales, group = mx_scale(self.weight_scale).to(torch.float32), 32
        else:
            assert self.weight_global_scale is not None
            scales, group = self.weight_scale.to(torch.bfloat16) / self.weight_global_scale, 16
        lut = torch.tensor([*E2M1, *(-v for v in E2M1)], dtype=torch.float32)
        layer: torch.nn.Module = Lut4Linear(
            codes,
            scales,
            lut,
            group=group,
            round_to=torch.bfloat16,
            bias=self._buffers.get("bias"),
            small_rows=small_rows or 64,
            prefill_dtype=prefill_dtype,
            compute_dtype=self.compute_dtype,
        )
        return self._behind_inputs(layer)

    def _q8_0(self, small_rows: int | None, prefill_dtype: torch.dtype | None) -> torch.nn.Module:
        """The int8 weight as Q8_0 blocks (its codes as stored, its scale per block of 32), run on the compiled kernel;
        wrapped in the input quantization the config asks for."""
        from anyquant.runtime.kernels.linear import q8_0_from_codes

        codes = self.weight_q if self.weight_q is not None else None
        if codes is None:
            assert self.weight_packed is not None
            codes = unpack_int32(self.weight_packed, 8, self.in_features)
        out, k = self.out_features, self.in_features
        s = self.weight_scale
        if self.args.strategy == "group":
            d = s.reshape(out, -1).repeat_interleave((self.args.group_size or 32) // 32, dim=1)
        else:  # one scale per row or for the whole tensor
            d = s.reshape(-1, 1).expand(out, k // 32) if s.numel() == out else s.reshape(1, 1).expand(out, k // 32)
        layer: torch.nn.Module = _int8_block_linear_class()(
            q8_0_from_codes(codes, d),
            out,
            k,
            self._buffers.get("bias"),
            round_to=s.dtype,
            small_rows=small_rows or 64,
            prefill_dtype=prefill_dtype,
            compute_dtype=self.compute_dtype,
            interleave=True,
        )
        return self._behind_inputs(layer)

    def to_fast_cpu(
        self, *, small_rows: int | None = None, prefill_dtype: torch.dtype | None = None
    ) -> torch.nn.Module:
        """The same layer as a :class:`~anyquant.runtime.fastcpu.FastInt4Linear`: codes ``q + 8`` and zero points
        ``z + 8`` (compressed-tensors' signed 4-bit values, offset as stored), so ``(q' - z') s`` is its weight."""
        reason = self.fast_cpu_unsupported()
        if reason is not None:
            raise ValueError(f"compressed-tensors layer cannot run on the fast CPU path: {reason}")
        if self.storage in ("int8", "packed-int") and self.args.num_bits == 8:
            return self._q8_0(small_rows, prefill_dtype)
        if self.storage in ("nvfp4", "mxfp4"):
            return self._fp4_table(small_rows, prefill_dtype)
        if self.storage == "fp8":
            return self._e4m3(small_rows, prefill_dtype)
        assert self.weight_packed is not None
        q = unpack_int32(self.weight_packed, 4, self.in_features)  # [out, in], -8..7
        codes = (q.to(torch.int16) + 8).to(torch.uint8).t()
        scales = self.weight_scale.reshape(self.out_features, -1).t().contiguous()  # [G, out]
        if self.weight_zero_point is not None:
            groups = scales.shape[0]
            z = unpack_int32(self.weight_zero_point.t(), 4, self.out_features).t().reshape(self.out_features, groups)
            zeros = (z.to(torch.int16) + 8).to(torch.uint8).t().contiguous()
        else:
            zeros = torch.full_like(scales, 8, dtype=torch.uint8)
        extra: dict[str, Any] = {} if small_rows is None else {"small_rows": small_rows}
        return FastInt4Linear(
            codes,
            zeros,
            scales,
            self.weight_g_idx if self.args.strategy == "group" else None,
            self._buffers.get("bias"),
            compute_dtype=self.compute_dtype,
            prefill_dtype=prefill_dtype,
            **extra,
        )

    def extra_repr(self) -> str:
        acts = f", input={self.input_args.describe()}" if self.input_args else ""
        return f"{super().extra_repr()}, {self.storage} {self.args.describe()}{acts}"


class KVQuant(torch.nn.Module):
    """compressed-tensors' ``kv_cache_scheme`` on one attention layer: the keys (after the rotary embedding) and the
    values fake-quantized with the stored ``k_scale``/``v_scale`` before the cache, as its forward does."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __init__(self, args: QArgs, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        super().__init__()
        self.args = args
        self.register_buffer("k_scale", k_scale)
        self.register_buffer("v_scale", v_scale)

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_input(k, self.args, self.k_scale, None), quantize_input(v, self.args, self.v_scale, None)

    def extra_repr(self) -> str:
        return self.args.describe()


class InputQuantized(torch.nn.Module):
    """A fast linear behind the input quantization of its compressed-tensors scheme (W8A8: per-token int8)."""

    input_scale: torch.Tensor | None
    input_zero_point: torch.Tensor | None
    input_global_scale: torch.Tensor | None

    def __init__(
        self,
        inner: torch.nn.Module,
        args: QArgs,
        scale: torch.Tensor | None,
        zero: torch.Tensor | None,
        global_scale: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.inner, self.args = inner, args
        self.register_buffer("input_scale", scale, persistent=False)
        self.register_buffer("input_zero_point", zero, persistent=False)
        self.register_buffer("input_global_scale", global_scale, persistent=False)
        self.in_features, self.out_features = int(inner.in_features), int(inner.out_features)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = quantize_input(x, self.args, self.input_scale, self.input_zero_point, self.input_global_scale)
        out: torch.Tensor = self.inner(q)
        return out

    def dequantize(self) -> torch.Tensor:
        out: torch.Tensor = self.inner.dequantize()  # type: ignore[operator]
        return out

    def extra_repr(self) -> str:
        return f"input={self.args.describe()}"


@functools.cache
def _int8_block_linear_class() -> type[torch.nn.Module]:
    from anyquant.runtime.kernels.linear import BlockLinear

    class CTInt8BlockLinear(BlockLinear):
        """compressed-tensors' int8 weight as Q8_0 blocks on the compiled kernel: its exact weight is
        ``round_to(scale dtype, q * s)``, compressed-tensors' own arithmetic, from the blocks."""

        def __init__(
            self,
            blocks: torch.Tensor,
            out_features: int,
            in_features: int,
            bias: torch.Tensor | None,
            *,
            round_to: torch.dtype,
            **kwargs: Any,
        ) -> None:
            super().__init__(blocks, "Q8_0", out_features, in_features, bias, **kwargs)
            self.round_to = round_to

        def dequantize(self) -> torch.Tensor:
            assert self.round_to is not None
            return self.exact_weight(self.round_to)

    return CTInt8BlockLinear
