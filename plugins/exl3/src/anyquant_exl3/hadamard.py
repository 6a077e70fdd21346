"""Block-diagonal Sylvester Hadamard transforms used by EXL3 (format doc §3.5).

``H128`` is the natural-order Sylvester matrix, ``H[i, j] = (-1) ** popcount(i & j)``, scaled by
``1 / sqrt(128)``. It is symmetric and orthogonal (``H @ H = I``), so the decoder's ``H · Ŵ · H`` exactly
inverts the encoder's regularization. EXL3 applies it block-diagonally: 128-row blocks on the left,
128-column blocks on the right.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

HAD_DIM = 128


def sylvester(n: int) -> torch.Tensor:
    """Unnormalized natural-order Sylvester Hadamard matrix of size ``n`` (a power of two), fp32 of ±1."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Sylvester Hadamard size must be a power of two, got {n}")
    idx = torch.arange(n)
    parity = torch.zeros((n, n), dtype=torch.int64)
    both = idx[:, None] & idx[None, :]
    for bit in range(max(n.bit_length() - 1, 0)):
        parity ^= (both >> bit) & 1
    return (1 - 2 * parity).to(torch.float32)


@lru_cache(maxsize=16)
def _normalized(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return (sylvester(n) * (1.0 / math.sqrt(n))).to(device=device, dtype=dtype)


def hadamard(n: int = HAD_DIM, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalized Sylvester Hadamard ``H_n / sqrt(n)`` on ``device`` (cached per device; treat as read-only)."""
    return _normalized(n, dtype, str(torch.device(device)))


def had_left(x: torch.Tensor, n: int = HAD_DIM) -> torch.Tensor:
    """``blockdiag(H) @ x``: transform each ``n``-row block of a 2-D tensor (new tensor, same dtype)."""
    rows, cols = x.shape
    if rows % n:
        raise ValueError(f"row count {rows} is not a multiple of the Hadamard size {n}")
    h = hadamard(n, x.dtype, x.device)
    return torch.matmul(h, x.reshape(rows // n, n, cols)).reshape(rows, cols)


def had_right(x: torch.Tensor, n: int = HAD_DIM) -> torch.Tensor:
    """``x @ blockdiag(H)``: transform each ``n``-column block of a 2-D tensor (new tensor, same dtype)."""
    rows, cols = x.shape
    if cols % n:
        raise ValueError(f"column count {cols} is not a multiple of the Hadamard size {n}")
    h = hadamard(n, x.dtype, x.device)
    return torch.matmul(x.reshape(rows * (cols // n), n), h).reshape(rows, cols)
