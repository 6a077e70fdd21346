"""The native decoder's decode step as one compiled function per layer, for layers whose linears are all
cpu-fast: int4 (GPTQ, AWQ, GGUF Q4), GGUF blocks read in place (GGUF Q4_0/Q4_1/Q8_0 with the compiled kernel,
:mod:`anyquant.runtime.kernels`) or bfloat16 prepacked (EXL3, EXL2).

On a two-core CPU a SmolLM2-135M decode step spent about half its time outside the weight kernels: some
1,500 small ATen calls, each with Python's argument parsing, and the ``nn.Module`` calls around them
(measured in docs/benchmarks.md). A layer that is "RMSNorm, q/k/v, rotary, KV write, attention, o,
RMSNorm, gate/up, SiLU, down" with cpu-fast linears runs here as one TorchScript function
(:func:`int4_layer`, with the fused q/k/v and gate/up int4 calls, or :func:`bf16_layer`), called with the
layer's tensors: the same ATen ops in the same order on the same tensors, so the logits are bitwise those
of the module path (tests compare them), with the Python between the ops gone.

:class:`DecodeStep` decides per call whether the fast path applies and falls back to the modules
otherwise: prompts (more than one new token), activations other than float32, and any forward hook or
pre-hook on a layer or one of its submodules, or a global one, or a ``forward`` set on one of those
instances (hooks and wrappers keep running, because those steps go through the modules; the model's own
hooks fire either way). A submodule replaced after the first decode
step takes every later step back to the modules (the step is built once, from the modules it found).
Layers of any other make run through their modules inside a fast step. ``PYTORCH_JIT=0`` (torch's own
switch) runs the same functions as plain Python; so does a torch without TorchScript, or an install
without the ``.py`` sources TorchScript compiles from (a frozen application).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any, List, NamedTuple, Optional, Union  # noqa: UP035 - TorchScript reads List/Optional/Union

import torch
import torch.nn.functional as F
from torch import nn

from .layers import (  # _rotary: the module path's own, compiled in
    FusedInt4,
    RMSNorm,
    Router,
    SparseMoe,
    _rotary,
    fusion,
)

__all__ = ["LAYER_FUNCTIONS", "DecodeStep", "bf16_layer", "ggml_layer", "int4_layer"]

log = logging.getLogger(__name__)


def _attention(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    mask: Optional[torch.Tensor],  # noqa: UP045 - TorchScript reads the annotation
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    q_norm: Optional[torch.Tensor],  # noqa: UP045
    k_norm: Optional[torch.Tensor],  # noqa: UP045
    eps: float,
) -> torch.Tensor:
    """Rotary embedding of the queries and keys ``qk`` (``[b, (heads + kv_heads) * head_dim]``: rotated
    together, elementwise, so bitwise the module path's separate q and k; first each head normalised by
    ``q_norm``/``k_norm`` where given, Qwen3's), the KV write at ``start``, and attention: ``[b, heads * head_dim]``."""
    b = qk.shape[0]
    rotated = heads + kv_heads
    if q_norm is not None and k_norm is not None:
        q = F.rms_norm(qk[:, : heads * head_dim].view(b, 1, heads, head_dim), [head_dim], q_norm, eps)
        k = F.rms_norm(qk[:, heads * head_dim :].view(b, 1, kv_heads, head_dim), [head_dim], k_norm, eps)
        qk = torch.cat([q, k], 2).transpose(1, 2)
    else:
        qk = qk.view(b, 1, rotated, head_dim).transpose(1, 2)
    qk = _rotary(qk, cos, sin)
    v = v.view(b, 1, kv_heads, head_dim).transpose(1, 2)
    keys.narrow(2, start, 1).copy_(qk[:, heads:])
    values.narrow(2, start, 1).copy_(v)
    k_all, v_all = keys.narrow(2, 0, start + 1), values.narrow(2, 0, start + 1)
    if keys.dtype != qk.dtype:  # a narrower cache: as NativeCache.update gives it (history read back, new exact)
        k_all = torch.cat([keys.narrow(2, 0, start).to(qk.dtype), qk[:, heads:]], 2)
        v_all = torch.cat([values.narrow(2, 0, start).to(qk.dtype), v], 2)
    out = F.scaled_dot_product_attention(
        qk[:, :heads],
        k_all,
        v_all,
        attn_mask=mask,
        scale=scaling,
        enable_gqa=kv_heads != heads,
    )
    return out.transpose(1, 2).reshape(b, heads * head_dim)


def _int4(x: torch.Tensor, packed: torch.Tensor, group: int, scales: torch.Tensor) -> torch.Tensor:
    """:class:`~anyquant.runtime.fastcpu.FastInt4Linear`'s decode path on float32 rows ``x``."""
    y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group, scales)
    return y.to(x.dtype)


def int4_attention(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    mask: Optional[torch.Tensor],  # noqa: UP045 - TorchScript reads the annotation
    norm1: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    qkv: torch.Tensor,
    qkv_scales: torch.Tensor,
    qkv_group: int,
    o: torch.Tensor,
    o_scales: torch.Tensor,
    o_group: int,
    q_norm: Optional[torch.Tensor],  # noqa: UP045
    k_norm: Optional[torch.Tensor],  # noqa: UP045
) -> torch.Tensor:
    """The attention half of :func:`int4_layer`: ``h`` plus the attention of its normalised rows."""
    b, hidden = h.shape[0], h.shape[-1]
    y = _int4(F.rms_norm(h, [hidden], norm1, eps).view(b, hidden), qkv, qkv_group, qkv_scales)
    rotated = (heads + kv_heads) * head_dim
    a = _attention(
        y[:, :rotated],
        y[:, rotated:],
        cos,
        sin,
        keys,
        values,
        start,
        mask,
        heads,
        kv_heads,
        head_dim,
        scaling,
        q_norm,
        k_norm,
        eps,
    )
    return h + _int4(a, o, o_group, o_scales).view(b, 1, hidden)


def int4_layer(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    mask: Optional[torch.Tensor],  # noqa: UP045 - TorchScript reads the annotation
    norm1: torch.Tensor,
    norm2: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    qkv: torch.Tensor,
    qkv_scales: torch.Tensor,
    qkv_group: int,
    o: torch.Tensor,
    o_scales: torch.Tensor,
    o_group: int,
    q_norm: Optional[torch.Tensor],  # noqa: UP045
    k_norm: Optional[torch.Tensor],  # noqa: UP045
    gate_up: torch.Tensor,
    gate_up_scales: torch.Tensor,
    gate_up_group: int,
    down: torch.Tensor,
    down_scales: torch.Tensor,
    down_group: int,
    intermediate: int,
) -> torch.Tensor:
    """One decoder layer of cpu-fast int4 linears for one new token per sequence (``h`` ``[b, 1, hidden]``
    float32), writing its key and value at position ``start`` of ``keys``/``values`` (``[b, kv_heads,
    room, head_dim]``); ``mask``: the native model's boolean ``[b, 1, 1, start + 1]`` for padded batches,
    else ``None``; ``q_norm``/``k_norm``: Qwen3's per-head norms, else ``None``. The ops and their order are
    :class:`~anyquant.runtime.native.DecoderLayer`'s with :class:`~anyquant.runtime.layers.FusedInt4` q/k/v and
    gate/up (``sin`` signed as for :func:`~anyquant.runtime.layers._rotary`)."""
    b, hidden = h.shape[0], h.shape[-1]
    h = int4_attention(
        h, cos, sin, keys, values, start, mask, norm1, eps, heads, kv_heads, head_dim, scaling,
        qkv, qkv_scales, qkv_group, o, o_scales, o_group, q_norm, k_norm,
    )  # fmt: skip
    gu = _int4(F.rms_norm(h, [hidden], norm2, eps).view(b, hidden), gate_up, gate_up_group, gate_up_scales)
    m = F.silu(gu[:, :intermediate]) * gu[:, intermediate:]
    return h + _int4(m, down, down_group, down_scales).view(b, 1, hidden)


def int4_moe_layer(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    mask: Optional[torch.Tensor],  # noqa: UP045 - TorchScript reads the annotation
    norm1: torch.Tensor,
    norm2: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    qkv: torch.Tensor,
    qkv_scales: torch.Tensor,
    qkv_group: int,
    o: torch.Tensor,
    o_scales: torch.Tensor,
    o_group: int,
    q_norm: Optional[torch.Tensor],  # noqa: UP045
    k_norm: Optional[torch.Tensor],  # noqa: UP045
    router: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    gate_up: List[torch.Tensor],  # noqa: UP006
    gate_up_scales: List[torch.Tensor],  # noqa: UP006
    gate_up_group: int,
    down: List[torch.Tensor],  # noqa: UP006
    down_scales: List[torch.Tensor],  # noqa: UP006
    down_group: int,
    intermediate: int,
) -> torch.Tensor:
    """:func:`int4_layer` for a Qwen3-MoE sparse layer: the router's top-k experts of each row, each expert's
    gate/up one int4 call; the ops and their order are :class:`~anyquant.runtime.layers.SparseMoe`'s with
    :class:`~anyquant.runtime.experts.Experts` (one row: its experts in ascending order, else each chosen expert
    on the rows that chose it, gathered and added back)."""
    b, hidden = h.shape[0], h.shape[-1]
    h = int4_attention(
        h, cos, sin, keys, values, start, mask, norm1, eps, heads, kv_heads, head_dim, scaling,
        qkv, qkv_scales, qkv_group, o, o_scales, o_group, q_norm, k_norm,
    )  # fmt: skip
    x = F.rms_norm(h, [hidden], norm2, eps).view(b, hidden)
    logits = F.linear(x, router)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    top, index = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    top = top.to(logits.dtype)
    out = torch.zeros_like(x)
    if b == 1:
        chosen: List[int] = index[0].tolist()  # noqa: UP006
        weights = top[0]
        for e in sorted(chosen):
            gu = _int4(x, gate_up[e], gate_up_group, gate_up_scales[e])
            m = F.silu(gu[:, :intermediate]) * gu[:, intermediate:]
            out = out + _int4(m, down[e], down_group, down_scales[e]) * weights[chosen.index(e)]
    else:
        experts: List[int] = torch.unique(index).tolist()  # noqa: UP006
        for e in experts:
            found = torch.where(index == e)
            rows, pos = found[0], found[1]
            gu = _int4(x[rows], gate_up[e], gate_up_group, gate_up_scales[e])
            m = F.silu(gu[:, :intermediate]) * gu[:, intermediate:]
            y = _int4(m, down[e], down_group, down_scales[e]) * top[rows, pos].unsqueeze(1)
            out.index_add_(0, rows, y)
    return h + out.view(b, 1, hidden)


def _bf16(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """:class:`~anyquant.runtime.fastcpu.PrepackedBf16Linear`'s forward on float32 rows ``x``."""
    no_scalars: List[Optional[Union[int, float, complex]]] = []  # noqa: UP006, UP007, UP045 - TorchScript's Scalar?[]
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", no_scalars, "")
    return y.to(x.dtype)


def bf16_layer(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    mask: Optional[torch.Tensor],  # noqa: UP045 - TorchScript reads the annotation
    norm1: torch.Tensor,
    norm2: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    q_norm: Optional[torch.Tensor],  # noqa: UP045
    k_norm: Optional[torch.Tensor],  # noqa: UP045
) -> torch.Tensor:
    """:func:`int4_layer` for layers of cpu-fast bfloat16 prepacked linears (EXL3, EXL2): seven oneDNN calls."""
    b, hidden = h.shape[0], h.shape[-1]
    x = F.rms_norm(h, [hidden], norm1, eps).view(b, hidden)
    qk = torch.cat([_bf16(x, q), _bf16(x, k)], 1)
    a = _attention(
        qk, _bf16(x, v), cos, sin, keys, values, start, mask, heads, kv_heads, head_dim, scaling, q_norm, k_norm, eps
    )
    h = h + _bf16(a, o).view(b, 1, hidden)
    x = F.rms_norm(h, [hidden], norm2, eps).view(b, hidden)
    return h + _bf16(F.silu(_bf16(x, gate)) * _bf16(x, up), down).view(b, 1, hidden)


def _ggml(x: torch.Tensor, blocks: torch.Tensor, kind: int, rows: int, passes: int) -> torch.Tensor:
    """:class:`~anyquant.runtime.kernels.linear.BlockLinear`'s decode path on float32 rows ``x``."""
    y: torch.Tensor = torch.ops.anyquant.ggml_gemv(x, blocks, kind, rows, x.shape[-1], -1, passes)
    return y


def ggml_layer(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    mask: Optional[torch.Tensor],  # noqa: UP045 - TorchScript reads the annotation
    norm1: torch.Tensor,
    norm2: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    blocks: List[torch.Tensor],  # noqa: UP006 - q, k, v, o, gate, up, down
    kinds: List[int],  # noqa: UP006 - their GGUF types
    rows: List[int],  # noqa: UP006 - their output features
    passes: List[int],  # noqa: UP006 - their activation passes
    q_norm: Optional[torch.Tensor],  # noqa: UP045
    k_norm: Optional[torch.Tensor],  # noqa: UP045
) -> torch.Tensor:
    """:func:`int4_layer` for layers of GGUF-block linears (Q4_0, Q4_1, Q8_0 read in place): seven kernel calls."""
    b, hidden = h.shape[0], h.shape[-1]
    x = F.rms_norm(h, [hidden], norm1, eps).view(b, hidden)
    qk = torch.cat(
        [_ggml(x, blocks[0], kinds[0], rows[0], passes[0]), _ggml(x, blocks[1], kinds[1], rows[1], passes[1])], 1
    )
    v = _ggml(x, blocks[2], kinds[2], rows[2], passes[2])
    a = _attention(qk, v, cos, sin, keys, values, start, mask, heads, kv_heads, head_dim, scaling, q_norm, k_norm, eps)
    h = h + _ggml(a, blocks[3], kinds[3], rows[3], passes[3]).view(b, 1, hidden)
    x = F.rms_norm(h, [hidden], norm2, eps).view(b, hidden)
    m = F.silu(_ggml(x, blocks[4], kinds[4], rows[4], passes[4])) * _ggml(x, blocks[5], kinds[5], rows[5], passes[5])
    return h + _ggml(m, blocks[6], kinds[6], rows[6], passes[6]).view(b, 1, hidden)


LAYER_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "int4": int4_layer,
    "int4_moe": int4_moe_layer,
    "bf16": bf16_layer,
    "ggml": ggml_layer,
}
_compiled: dict[str, Callable[..., torch.Tensor]] = {}
_compile_lock = threading.Lock()


def compiled_layer(kind: str) -> Callable[..., torch.Tensor]:
    """``LAYER_FUNCTIONS[kind]`` compiled by TorchScript once per process (the plain function where
    TorchScript is missing or refuses it; torch's ``PYTORCH_JIT=0`` gives the plain function too)."""
    with _compile_lock:
        if kind not in _compiled:
            function = LAYER_FUNCTIONS[kind]
            try:
                with warnings.catch_warnings():
                    # torch 2.9+ marks torch.jit.script deprecated; it is what runs a fixed op sequence
                    # without Python between the ops on every torch this project supports
                    warnings.simplefilter("ignore", DeprecationWarning)
                    warnings.simplefilter("ignore", FutureWarning)
                    _compiled[kind] = torch.jit.script(function)
            except Exception as e:  # any refusal means: run the Python function
                log.debug("TorchScript did not compile the %s decode step (%s); running it as Python", kind, e)
                _compiled[kind] = function
        return _compiled[kind]


def _hooked(module: nn.Module) -> bool:
    """Hooks on ``module``, or a ``forward`` set on the instance (as accelerate's and similar wrappers do)."""
    return bool(module._forward_hooks or module._forward_pre_hooks) or "forward" in module.__dict__


def _global_hooks() -> bool:
    from torch.nn.modules import module as module_mod

    return bool(
        getattr(module_mod, "_global_forward_hooks", None) or getattr(module_mod, "_global_forward_pre_hooks", None)
    )


class _Layer(NamedTuple):
    """One layer of a :class:`DecodeStep`: which function runs it and its arguments after ``mask``."""

    kind: str
    args: tuple[Any, ...]
    small_rows: int  # the most rows its kernels take on their decode path


class DecodeStep:
    """The fast decode path of one :class:`~anyquant.runtime.native.NativeCausalLM` (see the module docstring).

    Built by :meth:`build` on the model's first decode step: per layer, the function of
    :data:`LAYER_FUNCTIONS` that computes it and its arguments, or ``None`` for a layer that is neither
    all cpu-fast int4 nor all bfloat16 prepacked (a layer a GPTQ ``dynamic`` rule left dense, a GGUF tensor
    in Q6_K ...), which runs through its module. ``build`` gives ``None`` when no layer qualifies (then the
    model never asks again)."""

    def __init__(self, model: Any, layers: list[_Layer | None], watched: list[tuple[Any, str, Any]]) -> None:
        self.layers = [None if layer is None else (compiled_layer(layer.kind), layer.args) for layer in layers]
        self.modules = model.model.layers
        self.watched = watched
        # the modules whose hooks the module path would call (the model's own run either way; its
        # Decoder and ModuleList have no forward of their own)
        self.hookable = [child for _, _, child in watched[2:]]
        self.small_rows = min(layer.small_rows for layer in layers if layer is not None)

    @staticmethod
    def build(model: Any) -> DecodeStep | None:
        layers = [_plan_layer(layer) for layer in model.model.layers]
        if all(layer is None for layer in layers):
            return None
        watched: list[tuple[Any, str, Any]] = [
            (model, "model", model.model),
            (model.model, "layers", model.model.layers),
        ]
        for index, (layer, planned) in enumerate(zip(model.model.layers, layers, strict=True)):
            watched.append((model.model.layers, str(index), layer))
            if planned is None:
                continue
            attn, mlp = layer.self_attn, layer.mlp
            parents: list[tuple[nn.Module, tuple[str, ...]]] = [
                (layer, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")),
                (attn, ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
            ]
            if planned.kind == "int4_moe":
                parents += [(mlp, ("gate", "experts")), (mlp.experts, tuple(mlp.experts._modules))]
                parents += [(e, ("gate_proj", "up_proj", "down_proj")) for e in mlp.experts]
            else:
                parents.append((mlp, ("gate_proj", "up_proj", "down_proj")))
            for parent, names in parents:
                watched += [(parent, name, parent._modules[name]) for name in names if name in parent._modules]
        return DecodeStep(model, layers, watched)

    def usable(self, h: torch.Tensor) -> bool:
        """True when this step may run on the fast path: float32 on the CPU, few enough rows, no hooks, every
        module the one the plan was built from."""
        if h.dtype != torch.float32 or h.device.type != "cpu" or h.shape[0] > self.small_rows or _global_hooks():
            return False
        if any(_hooked(m) for m in self.hookable):
            return False
        return all(parent._modules.get(name) is child for parent, name, child in self.watched)

    def run(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, cache: Any
    ) -> torch.Tensor:
        """All layers for one new token per row, writing the cache (``h`` ``[b, 1, hidden]``)."""
        for i, (module, planned) in enumerate(zip(self.modules, self.layers, strict=True)):
            if planned is None:
                h = module(h, cos, sin, mask, cache)
                continue
            function, args = planned
            start = cache.lengths[i]
            keys, values = cache.reserve(i, start + 1, h.shape[0], args[4], args[5], h)  # kv_heads, head_dim
            h = function(h, cos, sin, keys, values, start, mask, *args)
            cache.lengths[i] = start + 1
        return h


def _plan_layer(layer: Any) -> _Layer | None:
    """How :class:`DecodeStep` runs ``layer``: ``None`` when some part of it is not the shape one of
    :data:`LAYER_FUNCTIONS` computes."""
    from .fastcpu import FastInt4Linear, PrepackedBf16Linear

    def plain_norm(m: nn.Module) -> bool:
        return type(m) is RMSNorm and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"

    def plain_int4(m: nn.Module) -> bool:
        return (
            isinstance(m, FastInt4Linear)
            and type(m).forward is FastInt4Linear.forward
            and m.perm is None
            and m.bias is None
            and m.padded_out == m.out_features
            and m.packed.device.type == "cpu"
        )

    def plain_bf16(m: nn.Module) -> bool:
        return type(m) is PrepackedBf16Linear and m.bias is None

    def plain_ggml(m: nn.Module) -> bool:
        from .kernels.linear import BlockLinear

        return isinstance(m, BlockLinear) and type(m).forward is BlockLinear.forward and m.bias is None

    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    if not (plain_norm(norm1) and plain_norm(norm2) and norm1.variance_epsilon == norm2.variance_epsilon):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    eps = float(norm1.variance_epsilon)
    norms = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    qk_norms: tuple[Any, ...] = (None, None)
    if norms != [None, None]:
        if not all(m is not None and plain_norm(m) and float(m.variance_epsilon) == eps for m in norms):
            return None
        qk_norms = tuple(m.weight for m in norms if m is not None)
    common: tuple[Any, ...] = (norm1.weight, norm2.weight, eps)
    common += (attn.heads, attn.kv_heads, attn.head_dim, float(attn.scaling))
    attention = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    sparse = _sparse(mlp)
    if sparse is None and not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return None  # an MLP of another make
    if sparse is None and all(plain_bf16(m) for m in (*attention, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        linears = (*attention, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        packs = tuple(m.packed for m in linears)
        small_rows = min(2**62 if m.small_rows is None else m.small_rows for m in linears)
        return _Layer("bf16", common + packs + qk_norms, small_rows)
    blocked: tuple[Any, ...] = (*attention, mlp.gate_proj, mlp.up_proj, mlp.down_proj) if sparse is None else ()
    if blocked and all(plain_ggml(m) for m in blocked):
        ggml: tuple[Any, ...] = ([m.blocks for m in blocked], [m.ggml_type for m in blocked])
        ggml += ([m.out_features for m in blocked], [m.passes for m in blocked])
        return _Layer("ggml", common + ggml + qk_norms, min(m.small_rows for m in blocked))
    qkv = fusion(attn, ("q_proj", "k_proj", "v_proj"))
    o = attn.o_proj
    if not (isinstance(qkv, FusedInt4) and qkv.plain and plain_int4(o) and o.scales_and_zeros.is_contiguous()):
        return None  # the fused members: FusedInt4.build and .plain checked them; o's scales are used as they are
    int4: tuple[Any, ...] = (qkv.packed, qkv.scales_and_zeros, qkv.kernel_group)
    int4 += (o.packed, o.scales_and_zeros, o.kernel_group, *qk_norms)
    if sparse is not None:
        router, top_k, norm_topk, experts = sparse
        planned = [_plan_mlp(expert, plain_int4) for expert in experts]
        if not planned or any(p is None for p in planned):
            return None
        mlps = [p for p in planned if p is not None]
        intermediate = experts[0].gate_proj.out_features
        groups = {(g.kernel_group, d.kernel_group) for g, d in mlps}
        if len(groups) != 1 or any(g.sizes != [intermediate, intermediate] for g, _ in mlps):
            return None  # one kernel group per kind of linear and one size: the function takes each once
        gate_group, down_group = groups.pop()
        moe: tuple[Any, ...] = (router, top_k, norm_topk, [g.packed for g, _ in mlps])
        moe += (
            [g.scales_and_zeros for g, _ in mlps],
            gate_group,
            [d.packed for _, d in mlps],
            [d.scales_and_zeros for _, d in mlps],
            down_group,
        )
        small_rows = min([qkv.small_rows, o.small_rows] + [min(g.small_rows, d.small_rows) for g, d in mlps])
        return _Layer("int4_moe", common + int4 + moe + (intermediate,), small_rows)
    dense = _plan_mlp(mlp, plain_int4)
    if dense is None:
        return None
    gate_up, down = dense
    int4 += (gate_up.packed, gate_up.scales_and_zeros, gate_up.kernel_group)
    int4 += (down.packed, down.scales_and_zeros, down.kernel_group, mlp.gate_proj.out_features)
    small_rows = min(qkv.small_rows, gate_up.small_rows, o.small_rows, down.small_rows)
    return _Layer("int4", common + int4, small_rows)


def _plan_mlp(mlp: Any, plain_int4: Callable[[nn.Module], bool]) -> tuple[FusedInt4, Any] | None:
    """The fused gate/up and the down linear of a SiLU-gated MLP (a dense layer's or one expert's) of cpu-fast
    int4 linears, or ``None``."""
    gate_up, down = fusion(mlp, ("gate_proj", "up_proj")), mlp.down_proj
    if not (isinstance(gate_up, FusedInt4) and gate_up.plain and plain_int4(down)):
        return None
    if not down.scales_and_zeros.is_contiguous():  # used as it is
        return None
    return gate_up, down


def _sparse(mlp: Any) -> tuple[torch.Tensor, int, bool, list[Any]] | None:
    """``(router weight, top_k, norm_topk_prob, experts)`` of the native decoder's Qwen3-MoE block whose experts are
    :class:`~anyquant.runtime.experts.Experts` with SiLU (what :func:`int4_moe_layer` computes), else ``None``."""
    from .experts import FORWARDS, Expert, Experts

    if type(mlp) is not SparseMoe or type(mlp.gate) is not Router or type(mlp.experts) is not Experts:
        return None
    weight = mlp.gate.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or (Expert.forward, Experts.forward) != FORWARDS:
        return None
    experts = list(mlp.experts)
    if len(experts) != weight.shape[0]:  # the router's every choice must index an expert
        return None
    if not all(type(e) is Expert and e.act_fn is F.silu for e in experts):
        return None
    return weight, int(mlp.gate.top_k), bool(mlp.gate.norm_topk_prob), experts
