"""``FP8Linear``: an FP8 e4m3 weight with its ``weight_scale_inv``, decoded as transformers' FineGrainedFP8 does; or
ModelOpt's ``weight_scale`` (per tensor, output channel or 128x128 block) with its input quantization (a static
per-tensor ``input_scale``, or dynamic per token), run as vLLM's ``QuantFP8`` does; or transformers' ``fbgemm_fp8``
(``weight_scale`` per output channel, each input row quantized as fbgemm's ``quantize_fp8_per_row`` under
``activation_scale_ub``). ``NVFP4Linear``: ModelOpt's NVFP4
(FP4 E2M1 codes, an E4M3 scale per 16 inputs and a float32 ``weight_scale_2``), its inputs quantized to NVFP4 as
vLLM's emulation does."""

from __future__ import annotations

import functools

import torch

from anyquant_runtime.activations import (
    E2M1,
    FP8_MAX,
    MIN_DYNAMIC_SCALE,
    QuantizedInputs,
    quantize_fp8_activations,
    quantize_nvfp4_activations,
)
from anyquant_runtime.layouts import Decoded, E4M3Groups, Layout, Table4
from anyquant_runtime.qlinear import QuantLinearBase

__all__ = [
    "FP8Linear",
    "KVQuantFP8",
    "NVFP4Linear",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "nvfp4_codes",
    "quantize_fbgemm_activations",
    "quantize_fp8_activations",
]


def quantize_fbgemm_activations(x: torch.Tensor, scale_ub: torch.Tensor) -> torch.Tensor:
    """``x`` through FP8 e4m3 and back as fbgemm's ``quantize_fp8_per_row(x, scale_ub=...)`` quantizes an
    ``FbgemmFp8Linear``'s input (``fbgemm_gpu/experimental/gen_ai/src/quantize/quantize.cu``,
    ``dynamicQuantizeMatrixRowwise``) and its rowwise GEMM scales the product back: per row (the last dimension)
    ``s = max(min(max|x|, scale_ub) / 448, 1 / (448 * 512))`` in float32, ``q = e4m3(clamp(float32(x) / s, -448,
    448))`` (``__nv_fp8_e4m3`` saturates: a row whose max is above ``scale_ub`` clips at +-448), then ``float32(q) *
    s`` in ``x``'s dtype. Not vLLM's ``QuantFP8`` (:func:`quantize_fp8_activations`): fbgemm divides by ``s`` where
    vLLM multiplies by ``1 / s`` (a float32 rounding apart now and then), and bounds the row's max. fbgemm takes
    bfloat16 inputs only: on a bfloat16 model this is its arithmetic to the bit; on float32 it is the same rule on
    the float32 row."""
    xf = x.to(torch.float32)
    amax = torch.minimum(xf.abs().amax(dim=-1, keepdim=True), scale_ub.to(torch.float32).reshape(()))
    s = (amax / FP8_MAX).clamp(min=MIN_DYNAMIC_SCALE)
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
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
    #: ``fbgemm_fp8``: the per-row input quantization's upper bound (``activation_scale_ub``)
    scale_ub: torch.Tensor | None

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
        scale_ub: torch.Tensor | None = None,
    ) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, mode=mode, compute_dtype=compute_dtype)
        self.block, self.round_to = block, round_to
        if input_quant not in (None, "static", "token", "fbgemm") or (input_quant == "static") != (
            input_scale is not None
        ):
            raise ValueError(f"input quantization {input_quant!r} with input_scale {input_scale is not None}")
        if (input_quant == "fbgemm") != (scale_ub is not None):
            raise ValueError(f"input quantization {input_quant!r} with scale_ub {scale_ub is not None}")
        self.input_quant = input_quant
        if input_scale is not None:
            from anyquant_runtime.finite import check_finite

            check_finite("input_scale", input_scale)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.to(torch.float32).reshape(()))
        self.register_buffer("scale_ub", None if scale_ub is None else scale_ub.to(torch.float32).reshape(()))
        self.set_packed(bias, weight_fp8=weight, weight_scale_inv=scale_inv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_ub is not None:
            x = quantize_fbgemm_activations(x, self.scale_ub)
        elif self.input_quant is not None:
            x = quantize_fp8_activations(x, self.input_scale)
        return super().forward(x)

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` in the model's dtype, as transformers dequantizes it (ModelOpt,
        ``fbgemm_fp8``: ``float32(w) * scale``)."""
        if self._weight is not None:
            return self._weight
        return dequantize_fp8(self.weight_fp8, self.weight_scale_inv, self.block, self.round_to)

    def extra_repr(self) -> str:
        if self.block:
            blocks = f"{self.block[0]}x{self.block[1]} blocks"
        else:
            blocks = "per tensor" if self.weight_scale_inv.numel() == 1 else "per channel"
        acts = {
            "static": ", static FP8 inputs",
            "token": ", per-token FP8 inputs",
            "fbgemm": f", per-row FP8 inputs (fbgemm, scale_ub {float(self.scale_ub) if self.scale_ub is not None else 0:g})",
        }.get(self.input_quant or "", "")
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
        if self.input_quant is None:
            return fast
        if self.scale_ub is not None:
            return QuantizedInputs(
                fast,
                quantize_fbgemm_activations,
                f"input=fbgemm per-row fp8 (scale_ub {float(self.scale_ub):g})",
                scale_ub=self.scale_ub,
            )
        kind = "static per-tensor" if self.input_scale is not None else "dynamic per-token"
        return QuantizedInputs(fast, quantize_fp8_activations, f"input={kind} fp8", scale=self.input_scale)


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


#: ModelOpt's E2M1 table by 4-bit code (``nvfp4_tensor.e2m1_values``): bit 3 the sign, code 8 a positive zero
NVFP4_TABLE = (*E2M1, 0.0, *(-v for v in E2M1[1:]))


def nvfp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes ``[out, in]`` of ModelOpt's packed ``[out, in/2]``: input ``2j`` in byte ``j``'s low nibble,
    ``2j + 1`` in its high one."""
    rows, cols = packed.shape
    return torch.stack((packed & 0x0F, packed >> 4), -1).reshape(rows, 2 * cols)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, group: int) -> torch.Tensor:
    """ModelOpt's ``NVFP4QTensor.dequantize`` in float32: ``E2M1[code] * (float32(weight_scale) * weight_scale_2)``
    per group of ``group`` inputs (the scale product first, then one float32 product per weight)."""
    codes = nvfp4_codes(packed)
    rows, cols = codes.shape
    values = torch.tensor(NVFP4_TABLE, dtype=torch.float32)[codes.to(torch.long)]
    per_group = scale.to(torch.float32) * scale_2.to(torch.float32).reshape(())
    return (values.reshape(rows, cols // group, group) * per_group.unsqueeze(-1)).reshape(rows, cols)


class NVFP4Linear(QuantLinearBase):
    """ModelOpt's NVFP4 linear (``quant_algo: NVFP4``): the weight as :func:`dequantize_nvfp4` gives it (float32), its
    input through NVFP4 first as vLLM's emulation does (:func:`~anyquant_runtime.activations.quantize_nvfp4_activations`
    with the global scale ``1 / input_scale``, vLLM's ``input_global_scale_inv``)."""

    packed_names = ("weight_packed", "weight_scale", "weight_scale_2")
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    input_global_scale: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        scale_2: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        group: int = 16,
        mode: str = "reference",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        out_features, half = weight.shape
        super().__init__(2 * half, out_features, mode=mode, compute_dtype=compute_dtype)
        if weight.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"NVFP4 needs a uint8 weight and float8_e4m3fn scales, not {weight.dtype}/{scale.dtype}")
        if self.in_features % group or tuple(scale.shape) != (out_features, self.in_features // group):
            raise ValueError(f"weight_scale {list(scale.shape)} for a weight of [{out_features}, {self.in_features}]")
        self.group = group
        # vLLM: input_global_scale_inv = (1.0 / input_scale).to(float32)
        self.register_buffer("input_global_scale", (1.0 / input_scale.to(torch.float32).reshape(())).to(torch.float32))
        self.set_packed(
            bias, weight_packed=weight, weight_scale=scale, weight_scale_2=scale_2.to(torch.float32).reshape(())
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(quantize_nvfp4_activations(x, self.input_global_scale, self.group))

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` in float32, as ModelOpt dequantizes it."""
        if self._weight is not None:
            return self._weight
        return dequantize_nvfp4(self.weight_packed, self.weight_scale, self.weight_scale_2, self.group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, nvfp4 e2m1 e4m3 scales per {self.group}, nvfp4 inputs"

    def packed_layouts(self) -> list[Layout] | str:
        """The 4-bit codes into ModelOpt's E2M1 table with each group's float32 ``float32(weight_scale) *
        weight_scale_2``: the exact weight."""
        if getattr(self, "weight_packed", None) is None:
            return "the packed tensors were dropped"
        packed, s, s2 = self.weight_packed, self.weight_scale, self.weight_scale_2
        return [
            Table4(
                self.in_features,
                self.out_features,
                self.group,
                codes=lambda: nvfp4_codes(packed),
                scales=lambda: s.to(torch.float32) * s2,
                table=torch.tensor(NVFP4_TABLE, dtype=torch.float32),
                round_to=torch.float32,
                bias=self._buffers.get("bias"),
            )
        ]

    def behind_inputs(self, fast: torch.nn.Module) -> torch.nn.Module:
        """A fast layer behind the NVFP4 input quantization."""
        return QuantizedInputs(
            fast,
            functools.partial(quantize_nvfp4_activations, group_size=self.group),
            f"input=nvfp4 per {self.group} (global scale 1 / input_scale)",
            exact_prompts=True,
            global_scale=self.input_global_scale,
        )
