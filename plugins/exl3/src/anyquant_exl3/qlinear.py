"""``EXL3Linear``: an EXL3 trellis-coded linear layer over the pure-torch decoder."""

from __future__ import annotations

import torch
from torch import nn

from anyquant.runtime.parts import LinearParts
from anyquant.runtime.qlinear import QuantLinearBase

from .dequant import decode_exl3
from .ring import RingTable

__all__ = ["EXL3Linear", "EXL3TableEmbedding", "LinearParts"]


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
