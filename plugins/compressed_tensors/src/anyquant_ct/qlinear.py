"""``CTLinear``: one compressed-tensors linear over the bit-exact decoders of :mod:`anyquant_ct.dequant`."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from anyquant_runtime.activations import QuantizedInputs
from anyquant_runtime.layouts import E4M3Groups, Int4Groups, Int8Blocks, Layout, Table4
from anyquant_runtime.qlinear import QuantLinearBase

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

    # ------------------------------------------------------------------ packed layouts

    def packed_layouts(self) -> list[Layout] | str:
        """4-bit packed integers as integer groups, 8-bit integers as int8 blocks, FP8 as E4M3 groups, NVFP4/MXFP4 as
        codes into the E2M1 table; the rest stays on the exact path."""
        if self.weight_packed is None and self.weight_q is None:
            return "the packed tensors were dropped"
        a = self.args
        if self.storage in ("int8", "packed-int") and a.num_bits == 8:
            return self._int8_blocks()
        if self.storage == "fp8":
            return self._e4m3_groups()
        if self.storage in ("nvfp4", "mxfp4"):
            return [self._fp4_table()]
        if self.storage != "packed-int" or a.num_bits != 4:
            return f"{self.storage} {a.num_bits}-bit weights have no packed layout yet"
        if self.input_args is not None:
            return "its input activations are quantized (the exact path applies them)"
        if a.strategy not in ("group", "channel"):
            return f"per-{a.strategy} scales"
        return [
            Int4Groups(
                self.in_features,
                self.out_features,
                codes=self._int4_codes,
                zeros=self._int4_zeros,
                scales=lambda: self.weight_scale.reshape(self.out_features, -1).t().contiguous(),  # [G, out]
                group_size=self.in_features if a.strategy == "channel" else None,
                g_idx=self.weight_g_idx if a.strategy == "group" else None,
                bias=self._buffers.get("bias"),
            )
        ]

    def _int4_codes(self) -> torch.Tensor:
        """``q + 8`` ``[in, out]``: compressed-tensors' signed 4-bit values offset as stored, so that ``(q' - z') s``,
        with the zero points offset alike, is its weight."""
        assert self.weight_packed is not None
        q = unpack_int32(self.weight_packed, 4, self.in_features)  # [out, in], -8..7
        return (q.to(torch.int16) + 8).to(torch.uint8).t()

    def _int4_zeros(self) -> torch.Tensor:
        """``z + 8`` ``[G, out]`` (8 where the scheme is symmetric)."""
        groups = self.weight_scale.reshape(self.out_features, -1).shape[1]
        if self.weight_zero_point is None:
            return torch.full((groups, self.out_features), 8, dtype=torch.uint8)
        z = unpack_int32(self.weight_zero_point.t(), 4, self.out_features).t().reshape(self.out_features, groups)
        return (z.to(torch.int16) + 8).to(torch.uint8).t().contiguous()

    def _int8_blocks(self) -> list[Layout] | str:
        """The int8 codes as stored with their scale per group, per channel or for the whole tensor."""
        a, n, k, s = self.args, self.out_features, self.in_features, self.weight_scale
        if self.weight_zero_point is not None:
            return "8-bit weights with zero points (no symmetric int8 layout)"
        if self.weight_g_idx is not None:
            return "8-bit weights whose groups are not contiguous (a g_idx)"
        if a.strategy not in ("tensor", "channel", "group"):
            return f"8-bit weights with per-{a.strategy} scales"
        group = (a.group_size or 1) if a.strategy == "group" else k

        def scales() -> torch.Tensor:
            if a.strategy == "group":
                return s.reshape(n, -1)
            # one scale per row or for the whole tensor
            return (s.reshape(-1, 1) if s.numel() == n else s.reshape(1, 1)).expand(n, 1)

        def codes() -> torch.Tensor:
            if self.weight_q is not None:
                return self.weight_q
            assert self.weight_packed is not None
            return unpack_int32(self.weight_packed, 8, k)

        bias = self._buffers.get("bias")
        return [Int8Blocks(k, n, group, codes=codes, scales=scales, round_to=s.dtype, bias=bias)]

    def _e4m3_groups(self) -> list[Layout] | str:
        """The FP8 bytes as stored with their scale per tensor, output channel, group or block."""
        a, n, k, s = self.args, self.out_features, self.in_features, self.weight_scale
        if self.weight_zero_point is not None:
            return "FP8 weights with zero points"
        scales: Callable[[], torch.Tensor]
        if a.strategy == "tensor":
            scales, rows, group = (lambda: s.reshape(1, 1)), n, k
        elif a.strategy == "channel":
            scales, rows, group = (lambda: s.reshape(n, 1)), 1, k
        elif a.strategy == "group" and a.group_size and self.weight_g_idx is None:
            scales, rows, group = (lambda: s.reshape(n, -1)), 1, a.group_size
        elif a.strategy == "block" and a.block_structure:
            scales, (rows, group) = (lambda: s), a.block_structure
        else:
            return f"FP8 scales per {a.strategy} with no packed layout"
        assert self.weight_q is not None
        bias = self._buffers.get("bias")
        return [E4M3Groups(k, n, group, self.weight_q, scales, round_to=s.dtype, rows=rows, bias=bias)]

    def _fp4_table(self) -> Table4:
        """NVFP4/MXFP4 codes into the E2M1 table, each group's scale as compressed-tensors forms it
        (``bf16(fp8 scale) / weight_global_scale``, or ``2 ** (e - 127)``)."""
        from .dequant import E2M1, mx_scale

        assert self.weight_packed is not None
        packed, n, k = self.weight_packed, self.out_features, self.in_features

        def scales() -> torch.Tensor:
            if self.storage == "mxfp4":
                return mx_scale(self.weight_scale).to(torch.float32)
            assert self.weight_global_scale is not None
            return self.weight_scale.to(torch.bfloat16) / self.weight_global_scale

        return Table4(
            k,
            n,
            32 if self.storage == "mxfp4" else 16,
            codes=lambda: torch.stack((packed & 0x0F, packed >> 4), -1).reshape(n, k),
            scales=scales,
            table=torch.tensor([*E2M1, *(-v for v in E2M1)], dtype=torch.float32),
            round_to=torch.bfloat16,
            bias=self._buffers.get("bias"),
        )

    def behind_inputs(self, fast: torch.nn.Module) -> torch.nn.Module:
        """A fast layer behind the input quantization the config asks for (the layer itself where it asks none)."""
        if self.input_args is None:
            return fast
        return QuantizedInputs(
            fast,
            functools.partial(quantize_input, args=self.input_args),
            f"input={self.input_args.describe()}",
            exact_prompts=self.input_args.num_bits == 4 and self.input_args.type == "float",
            scale=self.input_scale,
            zero=self.input_zero_point,
            global_scale=self.input_global_scale,
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
