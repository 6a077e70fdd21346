"""bitsandbytes linears over bit-exact decoders of its 4-bit (nf4/fp4) and 8-bit (LLM.int8) storage.

The arithmetic is bitsandbytes 0.50's own (``functional.dequantize_4bit``, whose C kernel and Python fallback agree,
and the int8 ``int8_vectorwise_dequant``), written with the same torch operations in the same dtypes: a double
quantization's absmax is ``nested_quant_map[code] * nested_absmax[block] + offset`` (float32, multiply then add), a
4-bit value ``quant_map[code] * absmax[block]`` in float32 rounded once to the quant state's dtype (byte ``k`` holds
element ``2k`` in its high nibble), an int8 weight ``CB * SCB[row] * (1/127)`` in float32 (rounded to the model's dtype,
the exact value; transformers' ``dequantize()`` rounds it further to the model's dtype).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from anyquant.plugin import CheckpointError
from anyquant_runtime.layouts import Decoded, Layout, Table4
from anyquant_runtime.qlinear import QuantLinearBase

__all__ = ["Bnb4bitLinear", "Bnb8bitLinear", "parse_quant_state"]

BLOCKSIZES = frozenset({32, 64, 128, 256, 512, 1024, 2048, 4096})
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: bitsandbytes' 1/127, the constant its int8 dequantization multiplies by
INV_127 = 7.874015718698502e-3


def parse_quant_state(name: str, raw: torch.Tensor, quant_type: str, shape: tuple[int, int]) -> dict[str, Any]:
    """The serialized quant state (JSON in a uint8 tensor), every field checked against the layer."""
    try:
        state = json.loads(bytes(raw.to(torch.uint8).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{name}: the bitsandbytes quant state is not JSON: {e}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{name}: the bitsandbytes quant state is {type(state).__name__}, not an object")
    if state.get("quant_type") != quant_type:
        raise CheckpointError(f"{name}: quant state says {state.get('quant_type')!r}, its tensor name {quant_type!r}")
    if state.get("blocksize") not in BLOCKSIZES:
        raise CheckpointError(f"{name}: blocksize {state.get('blocksize')!r} is not a power of two from 32 to 4096")
    if state.get("dtype") not in DTYPES:
        raise CheckpointError(f"{name}: quant state dtype {state.get('dtype')!r} is not one of {sorted(DTYPES)}")
    if state.get("shape") != list(shape):
        raise CheckpointError(
            f"{name}: the quant state's shape {state.get('shape')!r} is not the layer's {list(shape)}"
        )
    if "nested_blocksize" in state:
        offset = state.get("nested_offset")
        if state["nested_blocksize"] not in BLOCKSIZES:
            raise CheckpointError(f"{name}: nested_blocksize {state['nested_blocksize']!r} is not a power of two")
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
            raise CheckpointError(f"{name}: nested_offset {offset!r} is not a finite number")
    return state


class Bnb4bitLinear(QuantLinearBase):
    """A bitsandbytes 4-bit linear (``Linear4bit`` as saved)."""

    packed_names = ("codes", "absmax", "quant_map", "nested_absmax", "nested_quant_map")
    codes: torch.Tensor
    absmax: torch.Tensor
    quant_map: torch.Tensor
    nested_absmax: torch.Tensor | None
    nested_quant_map: torch.Tensor | None

    def __init__(
        self,
        name: str,
        tensors: dict[str, torch.Tensor],
        state: dict[str, Any],
        bias: torch.Tensor | None,
        *,
        in_features: int,
        out_features: int,
        mode: str = "reference",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(in_features, out_features, mode=mode, compute_dtype=compute_dtype)
        n = in_features * out_features
        self.blocksize: int = state["blocksize"]
        self.round_to = DTYPES[state["dtype"]]
        self.quant_type: str = state["quant_type"]
        codes = tensors["weight"].contiguous().view(torch.uint8).reshape(-1)  # any quant_storage: the bytes in order
        blocks = -(-n // self.blocksize)
        if codes.numel() != (n + 1) // 2:
            raise CheckpointError(f"{name}: {codes.numel()} bytes of 4-bit codes for a [{out_features}, {in_features}]")
        if tensors["absmax"].numel() != blocks:
            raise CheckpointError(f"{name}: {tensors['absmax'].numel()} absmax values for {blocks} blocks")
        nested = tensors.get("nested_absmax")
        self.nested_blocksize: int = state.get("nested_blocksize", 0)
        self.nested_offset = float(state.get("nested_offset", 0.0))
        if nested is not None and nested.numel() != -(-blocks // self.nested_blocksize):
            raise CheckpointError(f"{name}: {nested.numel()} nested_absmax values for {blocks} blocks")
        self.set_packed(
            bias,
            codes=codes,
            absmax=tensors["absmax"],
            quant_map=tensors["quant_map"],
            nested_absmax=nested,
            nested_quant_map=tensors.get("nested_quant_map"),
        )

    def block_absmax(self) -> torch.Tensor:
        """Each block's absmax, float32 (double quantization undone as bitsandbytes does)."""
        if self.nested_absmax is None:
            return self.absmax
        assert self.nested_quant_map is not None
        per = self.nested_absmax.repeat_interleave(self.nested_blocksize)[: self.absmax.numel()]
        scaled = self.nested_quant_map[self.absmax.to(torch.long)] * per
        return scaled + torch.tensor(self.nested_offset, dtype=torch.float32)

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` in the quant state's dtype, as ``dequantize_4bit`` gives it."""
        if self._weight is not None:
            return self._weight
        n = self.in_features * self.out_features
        idx = torch.stack((self.codes >> 4, self.codes & 0x0F), -1).reshape(-1)[:n].to(torch.long)
        absmax = self.block_absmax().repeat_interleave(self.blocksize)[:n]
        return (self.quant_map[idx] * absmax).to(self.round_to).reshape(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        nested = ", double quantization" if self.nested_absmax is not None else ""
        return f"{super().extra_repr()}, {self.quant_type} blocksize={self.blocksize}{nested}"

    def packed_layouts(self) -> list[Layout]:
        """The codes into the ``quant_map`` with each block's absmax as its scale (where the blocks tile the rows),
        else a bfloat16 copy of the exact weight."""
        n, k, block = self.out_features, self.in_features, self.blocksize
        decoded: list[Layout] = [Decoded(self)]
        if k % block:  # blocks run across rows: no scale per group of one row's inputs
            return decoded
        table = Table4(
            k,
            n,
            block,
            codes=lambda: torch.stack((self.codes >> 4, self.codes & 0x0F), -1).reshape(-1)[: n * k].reshape(n, k),
            scales=lambda: self.block_absmax().reshape(n, k // block),
            table=self.quant_map,
            round_to=self.round_to,
            bias=self._buffers.get("bias"),
        )
        return [table, *decoded]


class Bnb8bitLinear(QuantLinearBase):
    """A bitsandbytes LLM.int8 linear (``Linear8bitLt`` as saved: row-major int8 and its row maxima)."""

    packed_names = ("cb", "scb")
    cb: torch.Tensor
    scb: torch.Tensor

    def __init__(
        self,
        cb: torch.Tensor,
        scb: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        mode: str = "reference",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        out_features, in_features = cb.shape
        super().__init__(in_features, out_features, mode=mode, compute_dtype=compute_dtype)
        self.set_packed(bias, cb=cb, scb=scb)

    def dequantize(self) -> torch.Tensor:
        """``CB * SCB / 127`` in float32, as bitsandbytes' ``int8_vectorwise_dequant`` computes it."""
        if self._weight is not None:
            return self._weight
        return (self.cb.to(torch.float32) * self.scb.view(-1, 1)) * INV_127

    def packed_layouts(self) -> list[Layout]:
        """A bfloat16 copy of the exact weight."""
        return [Decoded(self)]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int8 per row"
