"""Input Hessians ``E[x xᵀ]`` of a model's linears, for the LDLQ encoder.

One forward pass of the dense model over the calibration rows, with a pre-hook on every linear to encode.
Linears fed the very same tensor (``q/k/v`` from the input norm, ``gate/up`` from the post-attention norm)
share one Hessian: the product ``xᵀx`` is computed once per distinct input per batch. The inputs come
from the dense model (exllamav3 runs each layer on the already quantized layers' outputs; here every
layer sees full-precision inputs, which lets one forward serve all layers).

Memory: one float32 ``[in, in]`` matrix per distinct input, e.g. ~400 MB for SmolLM2-135M (30 layers of
3 x 576² + 1536²), so this suits the tiny and small models the CPU encoder is meant for.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

__all__ = ["capture_hessians"]


class _Collector:
    """Sums ``xᵀx`` per distinct input. Sharing is decided by identity with the previous call's input (q/k/v
    and gate/up are called one after the other with the same tensor object) on the first batch and checked
    on every later one."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.owner: dict[str, str] = {}  # linear -> the linear whose Hessian it shares
        self._last: tuple[torch.Tensor, str] | None = None
        self._first = True

    def end_batch(self) -> None:
        self._first = False
        self._last = None

    def hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            same = self._last[1] if self._last is not None and self._last[0] is x else None
            if self._first:
                self.owner[name] = same or name
            elif self.owner[name] != (name if same is None else same):
                raise RuntimeError(f"{name}: its input is shared differently from the first calibration batch")
            if self.owner[name] != name:
                return
            self._last = (x, name)
            flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
            if name in self.sums:
                self.sums[name].addmm_(flat.t(), flat)
            else:
                self.sums[name] = flat.t() @ flat

        return pre_hook


@torch.no_grad()
def capture_hessians(
    model: nn.Module,
    samples: torch.Tensor,
    names: Collection[str],
    *,
    batch: int = 4,
    progress: Callable[[float], None] | None = None,
) -> dict[str, torch.Tensor]:
    """``{linear name: E[x xᵀ]}`` (float32 ``[in, in]``) for the linears ``names`` of ``model``.

    ``model`` is a transformers causal LM (its ``.model`` runs the decoder without the head when present) or
    anyquant's native decoder (``anyquant.load(...).module``: the whole model runs);
    ``samples`` are token ids ``[rows, length]``. Linears that share an input get the same tensor object; a
    linear the forward never reached is left out.
    """
    modules = dict(model.named_modules())
    missing = [n for n in names if not isinstance(modules.get(n), nn.Linear)]
    if missing:
        raise KeyError(f"not linear modules of the model: {missing[:5]}")
    collector = _Collector()
    handles = [modules[n].register_forward_pre_hook(collector.hook(n)) for n in names]
    body = getattr(model, "model", None)
    if not isinstance(body, nn.Module) or type(body).forward is nn.Module.forward:
        body = model  # anyquant's native decoder: its ``.model`` holds the layers but has no forward of its own
    try:
        rows = samples.shape[0]
        for start in range(0, rows, batch):
            body(input_ids=samples[start : start + batch], use_cache=False)
            collector.end_batch()
            if progress is not None:
                progress(min(rows, start + batch) / rows)
    finally:
        for handle in handles:
            handle.remove()
    count = samples.numel()
    for value in collector.sums.values():
        value /= count
    return {n: collector.sums[collector.owner[n]] for n in names if n in collector.owner}
