"""Helpers shared by the plugins' tests: the decode path one token at a time, and relative error."""

from __future__ import annotations

import torch


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float32."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def stepwise_logits(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits computed one token at a time through the KV cache (the decode path, 1 row per linear)."""
    from anyquant.runtime.generate import _cache_keyword

    kw = _cache_keyword(module)
    out = module(ids[:, :1], use_cache=True)
    steps = [out.logits]
    for i in range(1, ids.shape[1]):
        out = module(ids[:, i : i + 1], use_cache=True, **{kw: getattr(out, kw)})
        steps.append(out.logits)
    return torch.cat(steps, dim=1)
