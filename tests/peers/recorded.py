"""Judging a loaded model against a peer's recorded outputs (fixtures committed with the logits, greedy tokens and
weight hashes the peer produced in its own venv: compressed-tensors, transformers' FP8 and MXFP4, bitsandbytes, MLX).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["assert_greedy_or_near_tie", "forward_logits", "greedy_tokens", "rel_error", "sha256_f32"]


def sha256_f32(t: torch.Tensor) -> str:
    """sha256 of the tensor's values as little-endian float32 (exact for every dtype a weight comes in)."""
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def forward_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of one forward of a :class:`~anyquant.LoadedModel` over ``ids``."""
    with torch.no_grad():
        out = model.module(torch.tensor([list(ids)]))
    return (out.logits if hasattr(out, "logits") else out)[0].float()


def greedy_tokens(model: Any, ids: Sequence[int], n: int) -> list[int]:
    return list(model.complete(list(ids), max_new_tokens=n, temperature=0.0).token_ids)


def assert_greedy_or_near_tie(
    exact: Callable[[], Any], prompt: Sequence[int], want: Sequence[int], got: Sequence[int], tol: float
) -> None:
    """Greedy tokens ``got`` equal the peer's ``want``, or first differ at a near-tie: there, with the peer's tokens
    forced, the exact model's (``exact()``, loaded only when needed) logits of the two tokens are closer than ``tol``
    of the largest logit (a random tiny model has such steps; what follows a different token is not compared)."""
    if list(got) == list(want):
        return
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    assert i < len(got) and i < len(want), (got, want)
    logits = forward_logits(exact(), [*prompt, *want[:i]])[-1]
    gap = abs(float(logits[want[i]] - logits[got[i]]))
    assert gap <= tol * float(logits.abs().max()), (i, list(got), list(want), gap)


def assert_fast_modules_exact(fast: Any, exact: Any, names: Any) -> int:
    """Every module ``names`` of the ``fast`` model that still decodes (a fast path's module with ``dequantize``) gives
    the ``exact`` model's weight bit for bit (its exact form kept beside the fast one); returns how many were checked."""
    checked = 0
    for name in names:
        mod = fast.module.get_submodule(name)
        if hasattr(mod, "dequantize"):
            want = exact.module.get_submodule(name).dequantize()
            got = mod.dequantize()
            assert got.dtype == want.dtype and torch.equal(got, want), name
            checked += 1
    return checked
