"""``FP8Linear``: an FP8 e4m3 weight with its ``weight_scale_inv``, decoded as transformers' FineGrainedFP8 does; or
ModelOpt's ``weight_scale`` (per tensor, output channel or 128x128 block) with its input quantization (a static
per-tensor ``input_scale``, or dynamic per token), run as vLLM's ``QuantFP8`` does."""

from __future__ import annotations

import torch

from anyquant.runtime.layouts import Decoded, E4M3Groups, Layout
from anyquant.runtime.qlinear import QuantLinearBase

__all__ = ["FP8InputQuant", "FP8Linear", "KVQuantFP8", "dequantize_fp8", "quantize_fp8_activations"]

FP8_MAX = 448.0
#: vLLM's ``_FP8_MIN_SCALING_FACTOR``: the least dynamic scale (an all-zero token)
MIN_DYNAMIC_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_fp8_activations(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` through FP8 e4m3 and back, as vLLM's ``QuantFP8.forward_native`` quantizes a linear's input (and its
    FP8 GEMM scales the product back): ``q = e4m3(clamp(float32(x) * (1 / s), -448, 448))``, then ``float32(q) * s``
    in ``x``'s dtype. ``s``: the stored static per-tensor ``scale``, or (``None``) each token's
    ``max(max|x| / 448, 1 / (448 * 512))``. ModelOpt's own fake quantizer multiplies by ``448 / amax`` instead of
    ``1 / (amax / 448)``: the two differ in a float32 rounding now and then."""
    xf = x.to(torch.float32)
    if scale is None:
        s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_DYNAMIC_SCALE)
    else:
        s = scale.to(torch.float32)
    q = (xf * s.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * s).to(x.dtype)


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """``round_to(dtype, float32(w) * float32(scale_inv[i // bh, j // bw]))``: transformers' ``Fp8Dequantize``
    (one float32 product, one rounding). Edge blocks shorter than ``block`` (a dimension not a multiple of it) read
    their block's scale, as DeepSeek-V3's reference does (transformers 5.24 refuses such checkpoints)."""
    w = weight.to(torch.float32)
    s = scale_inv.to(torch.float32)
    if s.numel() == 1:
        s = s.reshape(())
    elif block is None:  # one scale per output channel (ModelOpt's FP8_PER_CHANNEL_PER_TOKEN)
        s = s.reshape(-1, 1)
    else:
        rows, cols = w.shape
        s = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return (w * s).to(dtype)


class FP8Linear(QuantLinearBase):
    packed_names = ("weight_fp8", "weight_scale_inv")
    weight_fp8: torch.Tensor
    #: the weight's multiplier: ``weight_scale_inv`` of ``quant_method: fp8``, ModelOpt's ``weight_scale``
    weight_scale_inv: torch.Tensor
    input_scale: torch.Tensor | None

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
        input_quant: str | None = None,
        input_scale: torch.Tensor | None = None,
    ) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, mode=mode, compute_dtype=compute_dtype)
        self.block, self.round_to = block, round_to
        if input_quant not in (None, "static", "token") or (input_quant == "static") != (input_scale is not None):
            raise ValueError(f"input quantization {input_quant!r} with input_scale {input_scale is not None}")
        self.input_quant = input_quant
        if input_scale is not None:
            from anyquant.runtime.finite import check_finite

            check_finite("input_scale", input_scale)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.to(torch.float32).reshape(()))
        self.set_packed(bias, weight_fp8=weight, weight_scale_inv=scale_inv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quant is not None:
            x = quantize_fp8_activations(x, self.input_scale)
        return super().forward(x)

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` in the model's dtype, as transformers dequantizes it."""
        if self._weight is not None:
            return self._weight
        return dequantize_fp8(self.weight_fp8, self.weight_scale_inv, self.block, self.round_to)

    def extra_repr(self) -> str:
        if self.block:
            blocks = f"{self.block[0]}x{self.block[1]} blocks"
        else:
            blocks = "per tensor" if self.weight_scale_inv.numel() == 1 else "per channel"
        acts = {"static": ", static FP8 inputs", "token": ", per-token FP8 inputs"}.get(self.input_quant or "", "")
        return f"{super().extra_repr()}, fp8 e4m3 {blocks}{acts}"

    # ------------------------------------------------------------------ packed layouts

    def packed_layouts(self) -> list[Layout]:
        """The FP8 bytes as stored with their scale per tensor, output channel or block (the exact weight
        transformers' dequantization gives), else a bfloat16 copy of that weight (within FP8's own tolerance)."""
        n, k, s = self.out_features, self.in_features, self.weight_scale_inv
        shape: tuple[int, ...]
        if s.numel() == 1:
            rows, group, shape = n, k, (1, 1)
        elif self.block is None:  # per output channel
            rows, group, shape = 1, k, (n, 1)
        else:  # [ceil(out / bh), ceil(in / bw)]: blocks at the edges shorter than the block read their block's scale
            (rows, group), shape = self.block, tuple(s.shape)
        fp8 = E4M3Groups(
            k,
            n,
            group,
            weight=self.weight_fp8,
            scales=lambda: s.reshape(shape),
            round_to=self.round_to,
            rows=rows,
            bias=self._buffers.get("bias"),
        )
        return [fp8, Decoded(self)]

    def behind_inputs(self, fast: torch.nn.Module) -> torch.nn.Module:
        """A fast layer behind the input quantization ModelOpt's config asks for."""
        return fast if self.input_quant is None else FP8InputQuant(fast, self.input_scale)


class FP8InputQuant(torch.nn.Module):
    """A fast linear behind ModelOpt's FP8 input quantization (:func:`quantize_fp8_activations`: the static
    ``input_scale``, or per token when it is ``None``)."""

    input_scale: torch.Tensor | None

    def __init__(self, inner: torch.nn.Module, input_scale: torch.Tensor | None) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("input_scale", input_scale, persistent=False)
        self.in_features, self.out_features = int(inner.in_features), int(inner.out_features)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(quantize_fp8_activations(x, self.input_scale))
        return out

    def dequantize(self) -> torch.Tensor:
        out: torch.Tensor = self.inner.dequantize()  # type: ignore[operator]
        return out

    def extra_repr(self) -> str:
        return "input=static per-tensor fp8" if self.input_scale is not None else "input=dynamic per-token fp8"


class KVQuantFP8(torch.nn.Module):
    """ModelOpt's FP8 KV cache on one attention layer (``kv_cache_quant_algo: FP8``): the keys (after the rotary
    embedding) and the values through e4m3 with the stored ``k_scale``/``v_scale`` before the cache, as vLLM's FP8
    cache stores them (``e4m3(clamp(k / k_scale))``, read back times ``k_scale``)."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __init__(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("k_scale", k_scale.to(torch.float32).reshape(()))
        self.register_buffer("v_scale", v_scale.to(torch.float32).reshape(()))

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_activations(k, self.k_scale), quantize_fp8_activations(v, self.v_scale)

    def extra_repr(self) -> str:
        return f"fp8 e4m3 KV cache, k_scale={float(self.k_scale):.4g}, v_scale={float(self.v_scale):.4g}"
