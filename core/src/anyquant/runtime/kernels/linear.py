"""``cpu-fast``'s linear over a weight kept as raw GGUF blocks (Q4_0, Q4_1, Q8_0), read in place.

- few rows (``<= small_rows``: decode): :func:`torch.ops.anyquant.ggml_gemv` on the blocks as stored
  (activations quantized per block of 32 in ``passes`` int8 passes, integer dot products: llama.cpp's
  arithmetic with ``passes=1``; tolerance below);
- many rows (prompts): the exact weight, dequantized from the blocks per forward by the format
  (:meth:`BlockLinear.dequantize`), and a float GEMM in ``prefill_dtype`` (default: the input's dtype).

No copy of the weight is made at load: the blocks may be a view of the mmapped file. Tolerance against
the exact weight (few rows): the activations' rounding, half a step of ``max|x| / 127`` per block of 32
with one pass (about 2e-3 of the largest output on random data; ``core/tests/test_kernels.py`` allows
1e-2), 256 times less with two (tests allow 1e-4).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import GGML_TYPES

__all__ = ["BlockLinear"]


class BlockLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` ``[out, in]`` as raw GGUF blocks (see the module docstring).

    A format subclasses it with :meth:`dequantize` (the exact weight from ``blocks``)."""

    blocks: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        blocks: torch.Tensor,
        type_name: str,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        *,
        small_rows: int,
        prefill_dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype = torch.float32,
        passes: int = 2,
    ) -> None:
        super().__init__()
        if type_name not in GGML_TYPES:
            raise ValueError(f"BlockLinear takes {sorted(GGML_TYPES)}, not {type_name}")
        code, size = GGML_TYPES[type_name]
        if in_features % 32 or blocks.dtype != torch.uint8 or blocks.numel() != out_features * in_features // 32 * size:
            raise ValueError(
                f"{type_name} blocks of {blocks.numel()} bytes ({blocks.dtype}) do not hold [{out_features}, {in_features}]"
            )
        if passes not in (1, 2):
            raise ValueError(f"passes={passes!r} is not 1 or 2")
        self.type_name, self.ggml_type, self.passes = type_name, code, passes
        self.out_features, self.in_features = out_features, in_features
        self.small_rows, self.prefill_dtype = small_rows, prefill_dtype
        self.register_buffer("blocks", blocks.reshape(-1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` (float32), from the blocks."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        y: torch.Tensor
        if x2.shape[0] <= self.small_rows:
            y = torch.ops.anyquant.ggml_gemv(
                x2, self.blocks, self.ggml_type, self.out_features, self.in_features, -1, self.passes
            ).to(x.dtype)
        else:
            dtype = self.prefill_dtype or x.dtype
            y = torch.mm(x2.to(dtype), self.dequantize().to(dtype).t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _apply(self, fn: Any, recurse: bool = True) -> BlockLinear:
        """The blocks stay on the CPU as they are: device moves are refused, dtype casts reach the bias only."""
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            moved = fn(buf)
            if moved.device != buf.device:
                raise RuntimeError("BlockLinear (cpu-fast backend) runs on the CPU only; load with another backend")
            if name == "bias":
                self._buffers[name] = moved
        return self

    def packed_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values() if b is not None)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, type={self.type_name} "
            f"(blocks read in place), passes={self.passes}, small_rows={self.small_rows}, bias={self.bias is not None}"
        )
