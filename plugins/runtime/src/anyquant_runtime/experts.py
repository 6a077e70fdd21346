"""Mixture-of-experts layers whose experts are stored one linear each (quantized or dense).

transformers 5 holds a MoE layer's experts as two 3-D parameters (``experts.gate_up_proj`` ``[E, 2I, H]`` and
``experts.down_proj`` ``[E, H, I]``, "a collection of expert weights stored as 3D tensors") and converts the
per-expert tensors of a checkpoint into them while loading. Quantized checkpoints keep one linear per expert:
GPTQModel and AutoAWQ write ``mlp.experts.N.{gate,up,down}_proj`` (Qwen2/Qwen3-MoE, DeepSeek, OLMoE) or
``block_sparse_moe.experts.N.{w1,w3,w2}`` (Mixtral). :class:`Experts` replaces the fused module with those
linears, built by the format's own factory, and computes exactly what the fused module computes (the router,
its top-k, its weights and any shared expert stay transformers' own), running only the experts that some token
selected: a decode step reads the weights of ``top_k`` experts per layer, not of all of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .layers import _joint

__all__ = ["EXPERT_LEAVES", "Expert", "Experts", "checkpoint_names", "fused_experts", "stored_experts"]

#: the per-expert linears' names in checkpoints, (gate, up, down): transformers' and Mixtral's
EXPERT_LEAVES: tuple[tuple[str, str, str], ...] = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def fused_experts(module: nn.Module) -> tuple[int, int, int] | None:
    """``(experts, hidden, intermediate)`` when ``module`` is transformers' fused-experts module in its common
    form (3-D ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``, no biases, not transposed, an
    ``act_fn``, ``act(gate) * up``), else ``None``: a form this module does not reproduce is left alone."""
    gate_up = module._parameters.get("gate_up_proj")
    down = module._parameters.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return None
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        return None
    if any(n.endswith("_bias") for n in module._parameters) or not callable(getattr(module, "act_fn", None)):
        return None
    experts, double, hidden = gate_up.shape
    if double % 2 or tuple(down.shape) != (experts, hidden, double // 2):
        return None
    return int(experts), int(hidden), int(double // 2)


def checkpoint_names(model_type: str | None) -> Callable[[str], list[str]]:
    """The names a model's tensor may have in a checkpoint, besides its own: transformers' plain renamings for
    ``model_type`` run backwards (Mixtral's ``.mlp.`` is ``.block_sparse_moe.`` on disk). Renamings that are
    regular expressions beyond escaped dots are not reversed. ``None``: no renamings (nothing is imported)."""
    pairs: list[tuple[str, str]] = []
    if model_type is None:
        return lambda name: []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without conversion mappings: no renamings
        rules: Any = ()
    else:
        rules = get_checkpoint_conversion_mapping(model_type) or ()  # type: ignore[no-untyped-call]
    for rule in rules:
        if not isinstance(rule, WeightRenaming) or isinstance(rule, WeightConverter):
            continue
        if len(rule.source_patterns) != 1 or len(rule.target_patterns) != 1:
            continue
        source, target = (p.replace("\\.", ".") for p in (rule.source_patterns[0], rule.target_patterns[0]))
        if re.search(r"[\\^$*+?()\[\]{}|]", source + target):
            continue
        pairs.append((target, source))

    def names(name: str) -> list[str]:
        out = []
        for target, source in pairs:
            if target in name:
                out.append(name.replace(target, source))
        return out

    return names


def stored_experts(
    name: str, experts: int, has_module: Callable[[str], bool], renames: Callable[[str], list[str]]
) -> tuple[str, tuple[str, str, str]] | None:
    """Where the checkpoint keeps the experts of the model's fused module ``name``: ``(prefix, (gate, up,
    down))`` such that expert ``e``'s linears are ``{prefix}.{e}.{gate}`` etc., or ``None`` (not stored one linear
    per expert: the checkpoint holds the fused tensors, or nothing)."""
    for prefix in (name, *renames(name + ".")):
        prefix = prefix.rstrip(".")
        for leaves in EXPERT_LEAVES:
            if all(has_module(f"{prefix}.{e}.{leaf}") for e in (0, experts - 1) for leaf in leaves):
                return prefix, leaves
    return None


class Expert(nn.Module):
    """One expert: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; cpu-fast int4 ``gate_proj`` and ``up_proj`` run
    as one kernel call on the decode path (:class:`~anyquant_runtime.layers.FusedInt4`, bitwise the two calls)."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act_fn: Any) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = gate_proj, up_proj, down_proj, act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _joint(self, ("gate_proj", "up_proj"), x)
        out: torch.Tensor = self.down_proj(self.act_fn(gate) * up)
        return out


class Experts(nn.ModuleList):
    """A MoE layer's experts, one :class:`Expert` each (module names ``experts.<e>.gate_proj`` etc., as the
    checkpoints have them), called as transformers' fused module is:
    ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.

    Each selected expert runs on the tokens that chose it, scaled by their routing weight; the contributions are
    added in ascending expert order, as transformers adds them. Experts no token chose are not touched."""

    def __init__(self, experts: Iterable[Expert]) -> None:
        super().__init__(experts)
        if not len(self):
            raise ValueError("a MoE layer needs at least one expert")
        self.num_experts = len(self)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if hidden_states.shape[0] == 1:  # decode: one token, its top_k experts, no gather or scatter
            return self._one_token(hidden_states, top_k_index[0].tolist(), top_k_weights[0])
        return self._routed(hidden_states, top_k_index, top_k_weights)

    def _routed(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.num_experts:
                continue  # transformers' sentinel for experts held elsewhere
            token_idx, top_k_pos = torch.where(top_k_index == e)
            h = self[e](hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out

    def _one_token(self, x: torch.Tensor, chosen: list[int], weights: torch.Tensor) -> torch.Tensor:
        """The same sums as :meth:`forward`'s (0 plus each expert's share, in ascending expert order)."""
        out = torch.zeros_like(x)
        for pos, e in sorted(enumerate(chosen), key=lambda item: item[1]):
            if 0 <= e < self.num_experts:
                out = out + (self[e](x) * weights[pos]).to(out.dtype)
        return out

    def fused(self) -> nn.Module:
        """transformers' form of these experts, for saving: a module holding the 3-D ``gate_up_proj``
        ``[E, 2I, H]`` (gate rows, then up rows) and ``down_proj`` ``[E, H, I]`` of each expert's dense weights, so
        ``save_pretrained`` writes what transformers itself writes for the model (Mixtral's per-expert names under
        ``block_sparse_moe`` mixed with transformers 5's leaf names would not load back). Every expert's linears
        must be dense ``nn.Linear`` without bias (``export_dense`` has made them so)."""
        linears = [(e.gate_proj, e.up_proj, e.down_proj) for e in self]
        dense = [trio for trio in linears if all(isinstance(m, nn.Linear) and m.bias is None for m in trio)]
        if len(dense) != len(linears):
            raise ValueError("Experts.fused needs dense nn.Linear experts without bias")
        weights = [tuple(m.weight for m in trio if isinstance(m, nn.Linear)) for trio in dense]
        holder = nn.Module()
        holder.gate_up_proj = nn.Parameter(torch.stack([torch.cat([g, u]) for g, u, _ in weights]), requires_grad=False)
        holder.down_proj = nn.Parameter(torch.stack([d for _, _, d in weights]), requires_grad=False)
        return holder

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, one linear each"


#: the forwards the native decode step reproduces (:mod:`anyquant_cpu.step`): a class patched later (a
#: benchmark computing every expert) no longer matches and runs through its modules
FORWARDS = (Expert.forward, Experts.forward)
