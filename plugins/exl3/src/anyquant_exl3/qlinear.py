"""``EXL3Linear``: an EXL3 trellis-coded linear layer over the pure-torch decoder, and the layouts a fast backend runs
EXL3's and EXL2's weights from (:func:`decoded_layouts`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from anyquant_runtime.parts import LinearParts
from anyquant_runtime.qlinear import QuantLinearBase

from .dequant import decode_exl3
from .ring import RingTable

if TYPE_CHECKING:
    from anyquant_runtime.layouts import Layout

__all__ = ["EXL3Linear", "EXL3TableEmbedding", "LinearParts", "Q8Rounding", "decoded_layouts"]


class Q8Rounding:
    """A layer's decoded weight rounded to Q8_0 blocks, formed once on the first call of :meth:`blocks`,
    :meth:`codes` or :meth:`scales`: per block of 32 inputs ``d = max|w| / 127`` (float16), codes ``round(w / d)``
    (halves away from zero), llama.cpp's ``quantize_row_q8_0`` bit for bit
    (:func:`anyquant_runtime.packing.q8_0_blocks`). A second, lossy rounding of the format's weight: up to half
    a step, ``max|w_block| / 254``, per weight."""

    #: weights rounded per step of :meth:`_form`
    CHUNK = 1 << 22

    def __init__(self, layer: QuantLinearBase) -> None:
        self.layer = layer
        self._blocks: torch.Tensor | None = None

    def blocks(self) -> torch.Tensor:
        """``[out, in / 32, 34]`` uint8: each block's float16 scale, then its 32 int8 codes. The layer decoded once,
        rounded a few rows at a time (the float32 temporaries stay small)."""
        if self._blocks is None:
            from anyquant_runtime.packing import q8_0_blocks

            n, k = self.layer.out_features, self.layer.in_features
            weight = self.layer.dequantize()
            blocks = torch.empty(n, k // 32, 34, dtype=torch.uint8)
            rows = max(1, self.CHUNK // k)
            for start in range(0, n, rows):
                blocks[start : start + rows] = q8_0_blocks(weight[start : start + rows]).view(-1, k // 32, 34)
            self._blocks = blocks
        return self._blocks

    def codes(self) -> torch.Tensor:
        """``[out, in]`` int8."""
        return self.blocks()[..., 2:].contiguous().view(torch.int8).flatten(1)

    def scales(self) -> torch.Tensor:
        """``[out, in / 32]`` float16."""
        return self.blocks()[..., 0:2].contiguous().view(torch.float16).squeeze(-1)


def decoded_layouts(layer: QuantLinearBase) -> Sequence[Layout] | str:
    """What a fast backend runs an EXL3 / EXL2 layer from (their codes are trellis states or variable-bit groups, which
    no CPU kernel reads): the decoded weight,

    - re-quantized to Q8_0 blocks (:class:`Q8Rounding`, 1.0625 bytes per weight; ``Int8Blocks(rounded=True)``: a
      second rounding the format accepts, which a backend's option may refuse), where ``in_features`` is a multiple
      of 32; else
    - rounded to bfloat16 (``Decoded``: 2 bytes per weight; the layer kept for its exact weight).

    Measured against the exact weights (docs/benchmarks.md, "EXL3 on a CPU: bfloat16 vs Q8_0 blocks"): both forms'
    logits within the fast backend's 2e-2 of the largest on the test fixtures; on a trained-weight proxy Q8_0 twice
    bfloat16's logits error, +0.37 % perplexity against +0.13 %, at 2.4x its decode speed.
    """
    from anyquant_runtime.layouts import Decoded, Int8Blocks

    if layer.mode != "reference":
        return f"a {layer.mode} layer (a fast backend decodes the packed tensors of a reference one)"
    exact = Decoded(layer)
    if layer.in_features % 32:
        return [exact]
    q8 = Q8Rounding(layer)
    bias = layer._buffers.get("bias")
    k, n = layer.in_features, layer.out_features
    return [
        Int8Blocks(
            k, n, 32, codes=q8.codes, scales=q8.scales, round_to=torch.float32, bias=bias, q8_0=q8.blocks, rounded=True
        ),
        exact,
    ]


class EXL3Linear(QuantLinearBase):
    packed_names = ("trellis", "suh", "svh", "su", "sv")
    trellis: torch.Tensor
    suh: torch.Tensor | None
    svh: torch.Tensor | None
    su: torch.Tensor | None
    sv: torch.Tensor | None

    def __init__(
        self,
        trellis: torch.Tensor,
        suh: torch.Tensor | None,
        svh: torch.Tensor | None,
        bias: torch.Tensor | None,
        *,
        codebook: str,
        in_features: int,
        out_features: int,
        su: torch.Tensor | None = None,
        sv: torch.Tensor | None = None,
        multiplier: int | None = None,
        mode: str = "reference",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(in_features, out_features, mode=mode, compute_dtype=compute_dtype)
        self.codebook = codebook
        self.multiplier = multiplier
        self.k_bits = trellis.shape[-1] / 16
        self.set_packed(bias, trellis=trellis, suh=suh, svh=svh, su=su, sv=sv)

    def dequantize(self) -> torch.Tensor:
        """W as the CUDA kernels reconstruct it (fp16), ``[out, in]``, padding trimmed."""
        if self.trellis is None:
            assert self._weight is not None
            return self._weight
        return decode_exl3(
            self.trellis,
            self.suh,
            self.svh,
            su=self.su,
            sv=self.sv,
            codebook=self.codebook,
            in_features=self.in_features,
            out_features=self.out_features,
            multiplier=self.multiplier,
        )

    def packed_layouts(self) -> Sequence[Layout] | str:
        """The decoded weight as Q8_0 blocks or in bfloat16 (:func:`decoded_layouts`)."""
        return decoded_layouts(self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, K={self.k_bits:g}, codebook={self.codebook}"


class EXL3TableEmbedding(nn.Module):
    """A ring-coded token embedding (exllamav3 1.6 ``--embed_bits``, :mod:`anyquant_exl3.ring`): the packed
    table stays in memory (``1 + 16 K`` int16 words per 256 columns) and only the looked-up rows are decoded,
    to fp16 as exllamav3 does, then cast to the compute dtype."""

    trellis: torch.Tensor
    signs: torch.Tensor

    def __init__(
        self, trellis: torch.Tensor, signs: torch.Tensor, k: int, hidden: int, compute_dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(trellis.shape[0]), int(hidden)
        self.k_bits, self.compute_dtype = int(k), compute_dtype
        self.register_buffer("trellis", trellis)
        self.register_buffer("signs", signs)

    @property
    def table(self) -> RingTable:
        return RingTable(self.trellis, self.signs, self.k_bits, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = self.num_embeddings
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise IndexError(f"index out of range: ids must lie in [0, {n}) for this {n}-row table")
        return self.table.rows(ids.to(self.trellis.device)).to(self.compute_dtype)

    def dequantize(self) -> torch.Tensor:
        """The whole table as exllamav3 decodes it (fp16) ``[rows, hidden]``."""
        return self.table.decode()

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize().to(self.compute_dtype)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Device moves follow ``fn``; dtype casts (``module.half()``) leave the packed table alone."""
        for name, buf in self._buffers.items():
            if buf is not None:
                moved = fn(buf)
                self._buffers[name] = moved if moved.dtype == buf.dtype else buf.to(moved.device)
        return self

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, K={self.k_bits}, ring-coded (exllamav3 --embed_bits)"
