"""The building blocks that the native decoder (:mod:`anyquant_runtime.native`) and its compiled decode step
(:mod:`anyquant_cpu.step`) share: RMSNorm, the rotary embedding, and the fused int4 call of linears that
share their input. Both modules import them from here (the decode step used to import them from the decoder,
which builds the decode step: an import circle)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from .activations import quantize_alike, shared_inputs

if TYPE_CHECKING:
    from anyquant_cpu.engine import FastInt4Linear

__all__ = ["FusedExperts", "FusedInt4", "RMSNorm", "Router", "SparseMoe", "fusion"]


class RMSNorm(nn.Module):
    #: up to this many rows (tokens) in float32, the compiled kernel's ``anyquant::rms_norm`` (one call, ~1 us;
    #: set by cpu-fast for its decode path, :func:`~anyquant_cpu.engine.kernel_norms`, and called alike by
    #: the decode step); 0: never (the exact backends)
    kernel_rows = 0

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            if x.numel() <= self.kernel_rows * x.shape[-1]:
                y: torch.Tensor = torch.ops.anyquant.rms_norm(x, self.weight, self.variance_epsilon)
                return y
            # one op instead of six; bitwise transformers' float32 arithmetic (tests compare)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def _rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, computed as
    ``roll(x, half) * cat(-sin1, sin2)``: one op instead of four, bitwise the same (negation is exact)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin


class FusedInt4:
    """One int4 kernel call, on the decode path, for cpu-fast linears that share their input (q/k/v, gate/up).

    The members' packed weights are concatenated along the output dimension (the kernel's blocked layout is
    per block of output rows, so this is exact) and each member's ``packed`` and ``scales_and_zeros`` buffers
    become views of the joint ones: no second copy. Prompts (more rows than ``small_rows``) still run each member's own exact path.
    """

    def __init__(self, members: list[FastInt4Linear]) -> None:
        self.members = members
        first = members[0]
        self.in_features, self.kernel_group, self.small_rows = first.in_features, first.kernel_group, first.small_rows
        self.packed = torch.cat([m.packed for m in members])
        self.scales_and_zeros = torch.cat([m.scales_and_zeros for m in members], dim=1).contiguous()
        self.slices: list[tuple[int, int]] = []
        offset = 0
        for m in members:
            # views of the joint buffers: no second copy (a member's own kernel call makes its scales contiguous)
            m.scales_and_zeros = self.scales_and_zeros[:, offset : offset + m.padded_out]
            m.packed = self.packed[offset : offset + m.padded_out]
            self.slices.append((offset, offset + m.out_features))
            offset += m.padded_out
        # no padding and no bias (the common case): the outputs are one split of the kernel's result
        self.sizes = [m.out_features for m in members]
        self.plain = all(m.padded_out == m.out_features and m.bias is None for m in members)

    @staticmethod
    def build(members: list[nn.Module]) -> FusedInt4 | None:
        from .cpu import engine

        found = engine()
        if found is None:  # no engine: no FastInt4Linear
            return None
        fast = found.FastInt4Linear
        first = members[0]
        if not all(
            isinstance(m, fast)
            and type(m).forward is fast.forward
            and m.perm is None
            and m.in_features == first.in_features
            and m.kernel_group == first.kernel_group
            and m.small_rows == first.small_rows
            and m.block_n == first.block_n
            and m.packed.device.type == "cpu"
            for m in members
        ):
            return None
        return FusedInt4(cast("list[FastInt4Linear]", members))

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > self.small_rows:
            return None
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.to(torch.bfloat16), self.packed, self.kernel_group, self.scales_and_zeros
        ).to(x.dtype)
        if self.plain:
            return list(y.view(*x.shape[:-1], y.shape[-1]).split(self.sizes, -1))
        outs = []
        for (start, end), m in zip(self.slices, self.members, strict=True):
            o = y[:, start:end]
            if m.bias is not None:
                o = o + m.bias.to(x.dtype)
            outs.append(o.reshape(*x.shape[:-1], end - start))
        return outs


def fusion(module: nn.Module, names: tuple[str, ...]) -> FusedInt4 | None:
    """The :class:`FusedInt4` of ``module``'s linears ``names`` (built on first use, after the loader placed
    its modules; ``None`` when they cannot run as one call)."""
    if "_fusion" not in module.__dict__:
        module.__dict__["_fusion"] = FusedInt4.build([getattr(module, n) for n in names])
    fused: FusedInt4 | None = module.__dict__["_fusion"]
    return fused


def _hooked(members: Sequence[nn.Module]) -> bool:
    """Hooks on one of ``members`` or global ones: the members then run one by one, so that the hooks fire."""
    from torch.nn.modules import module as module_mod

    if getattr(module_mod, "_global_forward_hooks", None) or getattr(module_mod, "_global_forward_pre_hooks", None):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in members)


def _joint(module: nn.Module, names: tuple[str, ...], h: torch.Tensor) -> list[torch.Tensor]:
    """``module``'s linears ``names`` applied to ``h``: one fused int4 call where :func:`fusion` gives one; linears
    behind the same input quantization with it done once (:func:`~anyquant_runtime.activations.shared_inputs`);
    else each linear in turn."""
    fused = fusion(module, names)
    outs = fused(h) if fused is not None and not _hooked(fused.members) else None
    if outs is not None:
        return outs
    members = [getattr(module, n) for n in names]
    alike = module.__dict__.get("_inputs_alike")
    if alike is None:  # decided once, as fusion() is: the members and their scales do not change
        alike = module.__dict__["_inputs_alike"] = quantize_alike(members)
    if alike and not _hooked(members):
        return shared_inputs(members, h)
    return [m(h) for m in members]


class Router(nn.Module):
    """Qwen3-MoE's router: its ``weight`` ``[experts, hidden]`` (a parameter, as transformers holds it: no
    quantized linear is swapped in), the routing computed by :class:`SparseMoe`."""

    #: keep the top-k weights in float32 (Mixtral's router does not cast them back to the logits' dtype)
    keep_float = False

    def __init__(self, experts: int, hidden: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(top_k_weights, top_k_index)`` of rows ``x`` ``[T, hidden]``: transformers' arithmetic (the softmax in
        float32, top-k, renormalised when ``norm_topk_prob``, back to the logits' dtype unless :attr:`keep_float`)."""
        logits = F.linear(x, self.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return (top if self.keep_float else top.to(logits.dtype)), index


class FusedExperts(nn.Module):
    """transformers' fused experts (3-D ``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``): what a
    dense checkpoint fills. The loader replaces it with :class:`~anyquant_runtime.experts.Experts` when the
    checkpoint stores one linear per expert (every quantized checkpoint); both are called the same way."""

    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        e, h, i = experts, hidden, intermediate
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act_fn = F.silu

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Each chosen expert on the rows that chose it, added in ascending expert order (transformers' order)."""
        out = torch.zeros_like(x)
        for e in torch.unique(top_k_index).tolist():
            pos, token_idx = torch.where((top_k_index == e).T)  # transformers' row order
            gate, up = F.linear(x[token_idx], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[token_idx, pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


class SparseMoe(nn.Module):
    """Qwen3-MoE's sparse block: the router's top-k experts per token, their outputs weighted and summed."""

    def __init__(self, experts: int, hidden: int, intermediate: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate = Router(experts, hidden, top_k, norm_topk_prob)
        self.experts: nn.Module = FusedExperts(experts, hidden, intermediate)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])
        weights, index = self.gate(x)
        out: torch.Tensor = self.experts(x, index, weights)
        return out.view(h.shape)
