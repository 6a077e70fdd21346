"""The native decoder's decode step as one compiled function per layer, for layers whose linears are all
cpu-fast: int4 (GPTQ, AWQ, GGUF Q4), GGUF blocks read in place (GGUF Q4_0/Q4_1/Q8_0 with the compiled kernel,
:mod:`anyquant_cpu.kernels`) or bfloat16 prepacked (EXL3, EXL2; GGUF's K-quants without an int4 layout), of
one kind or mixed (GGUF Q4_K_M: Q4_K int4 beside Q6_K bfloat16, in the attention and in the experts).

On a two-core CPU a SmolLM2-135M decode step spent about half its time outside the weight kernels: some
1,500 small ATen calls, each with Python's argument parsing, and the ``nn.Module`` calls around them
(measured in docs/benchmarks.md). A layer that is "RMSNorm, q/k/v, rotary, KV write, attention, o,
RMSNorm, gate/up, SiLU, down" with cpu-fast linears runs here as one TorchScript function
(:func:`int4_layer`, with the fused q/k/v and gate/up int4 calls, :func:`bf16_layer`, :func:`ggml_layer`, or
:func:`mixed_layer`, which calls each linear by its own kind; ``*_moe_layer`` for Qwen3-MoE's routed experts,
a token's experts one ``anyquant::ggml_experts`` call where they are all GGUF blocks), called with the layer's tensors:
the same arithmetic in the same order on the same tensors, so the logits are bitwise those of the module path (tests
compare them), with the Python between the ops gone. Where every layer is planned, one
scripted module (:class:`_Stack`) runs them all in a single call per step. A layer's KV write and attention run on
the kernel's ``anyquant::decode_attention`` where its module does (``decode_kernel``), over a list of caches: a
server's rows, each with a cache of its own, then take the same single call (:meth:`DecodeStep.run_rows`), each row
bitwise what it gets alone.

:class:`DecodeStep` decides per call whether the fast path applies and falls back to the modules
otherwise: prompts (more than one new token), activations other than float32, and any forward hook or
pre-hook on a layer or one of its submodules, or a global one, or a ``forward`` set on one of those
instances (hooks and wrappers keep running, because those steps go through the modules; the model's own
hooks fire either way). A submodule replaced after the first decode
step takes every later step back to the modules (the step is built once, from the modules it found).
Layers of any other make run through their modules inside a fast step (Gemma 2's and 3's: four norms, soft-capping,
two rotary tables). A sliding-window layer's function is given the cache from the first position its window holds
(and its padding mask's columns from there): the keys and values its module's attention sees, so bitwise the same.
``PYTORCH_JIT=0`` (torch's own
switch) runs the same functions as plain Python; so does a torch without TorchScript, or an install
without the ``.py`` sources TorchScript compiles from (a frozen application).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import operator
import os
import threading
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any, List, NamedTuple, Optional, Tuple, Union, get_type_hints  # noqa: UP035 - TorchScript reads List/Optional/Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anyquant_runtime.layers import (  # _rotary: the module path's own, compiled in
    FusedInt4,
    RMSNorm,
    Router,
    SparseMoe,
    _rotary,
    fusion,
)

__all__ = [
    "LAYER_FUNCTIONS",
    "DecodeStep",
    "bf16_layer",
    "ggml_layer",
    "int4_layer",
    "int4_moe_layer",
    "mixed_layer",
    "mixed_moe_layer",
]

log = logging.getLogger(__name__)

Opt = Optional[Tensor]  # noqa: UP045 - the layer modules' mask argument (TorchScript reads Optional)
Tensors = List[Tensor]  # noqa: UP006 - their caches' buffers (TorchScript reads List)
Ints = List[int]  # noqa: UP006 - and where each writes


def _attention(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: List[torch.Tensor],  # noqa: UP006 - the caches' key buffers, each of its rows (one: a padded batch's)
    values: List[torch.Tensor],  # noqa: UP006
    starts: List[int],  # noqa: UP006 - where each writes its new position
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
    ``q_norm``/``k_norm`` where given, Qwen3's), the KV write at ``starts``, and attention: ``[b, heads * head_dim]``.
    ``scaling < 0`` (the planner's mark for attention with ``decode_kernel``): without a mask, the write and the
    attention by ``anyquant::decode_attention`` with scaling ``-scaling``, as the module computes them, over each
    cache's rows (one cache a lone request's, one each for a server's rows); else torch's, over one cache."""
    b = qk.shape[0]
    rotated = heads + kv_heads
    if q_norm is not None and k_norm is not None:
        q = _rms(qk[:, : heads * head_dim].view(b, 1, heads, head_dim), q_norm, eps)
        k = _rms(qk[:, heads * head_dim :].view(b, 1, kv_heads, head_dim), k_norm, eps)
        qk = torch.cat([q, k], 2).transpose(1, 2)
    else:
        qk = qk.view(b, 1, rotated, head_dim).transpose(1, 2)
    qk = _rotary(qk, cos, sin)
    v = v.view(b, 1, kv_heads, head_dim).transpose(1, 2)
    if scaling < 0.0 and mask is None:  # the planner's mark: the module's attention on the kernel (decode_kernel)
        return _kernel_attention(qk, v, keys, values, starts, heads, kv_heads, head_dim, -scaling)
    # torch's: one cache (a padded batch's rows: the mask)
    return _attention_torch(qk, v, keys[0], values[0], starts[0], mask, heads, kv_heads, head_dim, abs(scaling))


def _kernel_attention(
    qk: torch.Tensor,
    v: torch.Tensor,
    keys: List[torch.Tensor],  # noqa: UP006 - the caches' key buffers, each of its rows (one: a padded batch's)
    values: List[torch.Tensor],  # noqa: UP006
    starts: List[int],  # noqa: UP006 - where each writes its new position
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
) -> torch.Tensor:
    """:func:`_attention`'s write and attention by ``anyquant::decode_attention`` (rotated ``qk``, ``v``: ``[b,
    heads, 1, head_dim]``), as :meth:`~anyquant_runtime.native.Attention.decode` calls it."""
    out: torch.Tensor = torch.ops.anyquant.decode_attention(
        qk[:, :heads, 0], qk[:, heads:, 0], v[:, :, 0], keys, values, starts, 0, scaling
    )
    return out.view(qk.shape[0], heads * head_dim)


def _kernel_attention_missing(
    qk: torch.Tensor,
    v: torch.Tensor,
    keys: List[torch.Tensor],  # noqa: UP006 - the caches' key buffers, each of its rows (one: a padded batch's)
    values: List[torch.Tensor],  # noqa: UP006
    starts: List[int],  # noqa: UP006 - where each writes its new position
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
) -> torch.Tensor:
    """:func:`_kernel_attention` for compiling where the op is not loaded (no attention is marked then)."""
    return _attention_torch(qk, v, keys[0], values[0], starts[0], None, heads, kv_heads, head_dim, scaling)


def _attention_torch(
    qk: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    mask: Optional[torch.Tensor],  # noqa: UP045 - TorchScript reads the annotation
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
) -> torch.Tensor:
    """The KV write and torch's attention of :func:`_attention`'s rotated ``qk`` and ``v`` (``[b, heads, 1,
    head_dim]``)."""
    b = qk.shape[0]
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


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """An RMSNorm as its :class:`~anyquant_runtime.layers.RMSNorm` module computes it on the step's rows:
    ``eps < 0`` (the planner's mark for modules with ``kernel_rows``; the step runs only up to that many rows) the
    compiled kernel's ``anyquant::rms_norm`` with epsilon ``-eps``, else torch's."""
    if eps < 0.0:
        y: torch.Tensor = torch.ops.anyquant.rms_norm(x, weight, -eps)
        return y
    return F.rms_norm(x, [x.shape[-1]], weight, eps)


def _rms_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`_rms` for compiling where the kernel is not loaded (no module has ``kernel_rows`` then)."""
    return F.rms_norm(x, [x.shape[-1]], weight, abs(eps))


def _int4(x: torch.Tensor, packed: torch.Tensor, group: int, scales: torch.Tensor) -> torch.Tensor:
    """:class:`~anyquant_cpu.engine.FastInt4Linear`'s decode path on float32 rows ``x``."""
    y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group, scales)
    return y.to(x.dtype)


def int4_attention(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: List[torch.Tensor],  # noqa: UP006 - the caches' key buffers, each of its rows (one: a padded batch's)
    values: List[torch.Tensor],  # noqa: UP006
    starts: List[int],  # noqa: UP006 - where each writes its new position
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
    y = _int4(_rms(h, norm1, eps).view(b, hidden), qkv, qkv_group, qkv_scales)
    rotated = (heads + kv_heads) * head_dim
    a = _attention(
        y[:, :rotated],
        y[:, rotated:],
        cos,
        sin,
        keys,
        values,
        starts,
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
    keys: List[torch.Tensor],  # noqa: UP006 - the caches' key buffers, each of its rows (one: a padded batch's)
    values: List[torch.Tensor],  # noqa: UP006
    starts: List[int],  # noqa: UP006 - where each writes its new position
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
    float32), writing its key and value at position ``starts[i]`` of ``keys[i]``/``values[i]`` (``[b_i, kv_heads,
    room, head_dim]``: cache ``i``'s buffers, its ``b_i`` rows the next of ``h``'s; several caches only where the
    attention is the kernel's, :func:`_attention`); ``mask``: the native model's boolean ``[b, 1, 1, start + 1]``
    for a padded batch (one cache), else ``None``; ``q_norm``/``k_norm``: Qwen3's per-head norms, else ``None``. The ops and their order are
    :class:`~anyquant_runtime.native.DecoderLayer`'s with :class:`~anyquant_runtime.layers.FusedInt4` q/k/v and
    gate/up (``sin`` signed as for :func:`~anyquant_runtime.layers._rotary`)."""
    b, hidden = h.shape[0], h.shape[-1]
    h = int4_attention(
        h, cos, sin, keys, values, starts, mask, norm1, eps, heads, kv_heads, head_dim, scaling,
        qkv, qkv_scales, qkv_group, o, o_scales, o_group, q_norm, k_norm,
    )  # fmt: skip
    gu = _int4(_rms(h, norm2, eps).view(b, hidden), gate_up, gate_up_group, gate_up_scales)
    m = F.silu(gu[:, :intermediate]) * gu[:, intermediate:]
    return h + _int4(m, down, down_group, down_scales).view(b, 1, hidden)


def int4_moe_layer(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: List[torch.Tensor],  # noqa: UP006 - the caches' key buffers, each of its rows (one: a padded batch's)
    values: List[torch.Tensor],  # noqa: UP006
    starts: List[int],  # noqa: UP006 - where each writes its new position
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
    gate/up one int4 call; the ops and their order are :class:`~anyquant_runtime.layers.SparseMoe`'s with
    :class:`~anyquant_runtime.experts.Experts` (one row: its experts in ascending order, else each chosen expert
    on the rows that chose it, gathered and added back)."""
    b, hidden = h.shape[0], h.shape[-1]
    h = int4_attention(
        h, cos, sin, keys, values, starts, mask, norm1, eps, heads, kv_heads, head_dim, scaling,
        qkv, qkv_scales, qkv_group, o, o_scales, o_group, q_norm, k_norm,
    )  # fmt: skip
    x = _rms(h, norm2, eps).view(b, hidden)
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
    """:class:`~anyquant_cpu.engine.PrepackedBf16Linear`'s forward on float32 rows ``x``."""
    no_scalars: List[Optional[Union[int, float, complex]]] = []  # noqa: UP006, UP007, UP045 - TorchScript's Scalar?[]
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", no_scalars, "")
    return y.to(x.dtype)


def bf16_layer(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: List[torch.Tensor],  # noqa: UP006 - the caches' key buffers, each of its rows (one: a padded batch's)
    values: List[torch.Tensor],  # noqa: UP006
    starts: List[int],  # noqa: UP006 - where each writes its new position
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
    x = _rms(h, norm1, eps).view(b, hidden)
    qk = torch.cat([_bf16(x, q), _bf16(x, k)], 1)
    a = _attention(
        qk, _bf16(x, v), cos, sin, keys, values, starts, mask, heads, kv_heads, head_dim, scaling, q_norm, k_norm, eps
    )
    h = h + _bf16(a, o).view(b, 1, hidden)
    x = _rms(h, norm2, eps).view(b, hidden)
    return h + _bf16(F.silu(_bf16(x, gate)) * _bf16(x, up), down).view(b, 1, hidden)


def _ggml(x: torch.Tensor, blocks: torch.Tensor, kind: int, rows: int, passes: int) -> torch.Tensor:
    """:class:`~anyquant_cpu.kernels.linear.BlockLinear`'s decode path on float32 rows ``x``."""
    y: torch.Tensor = torch.ops.anyquant.ggml_gemv(x, blocks, kind, rows, x.shape[-1], -1, passes)
    return y


def _ggml_cat(
    x: torch.Tensor,
    blocks: List[torch.Tensor],  # noqa: UP006
    kinds: List[int],  # noqa: UP006
    rows: List[int],  # noqa: UP006
    passes: int,
) -> torch.Tensor:
    """:func:`_ggml` of several weights on the same rows ``x`` (q, k, v; gate, up), their outputs side by side:
    one kernel call (the activations quantized once), each output as :func:`_ggml` computes it."""
    y: torch.Tensor = torch.ops.anyquant.ggml_gemv_cat(x, blocks, kinds, rows, -1, passes)
    return y


def _experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    blocks: List[torch.Tensor],  # noqa: UP006
    kinds: List[int],  # noqa: UP006
    intermediate: int,
    passes: int,
) -> torch.Tensor:
    """A MoE layer's chosen experts on float32 rows ``x`` in one kernel call (``anyquant::ggml_experts``: bit for bit
    :class:`~anyquant_runtime.experts.Experts`' one-token path on GGUF-block linears). ``blocks``/``kinds``: each
    expert's gate, up and down."""
    y: torch.Tensor = torch.ops.anyquant.ggml_experts(x, index, weights, blocks, kinds, intermediate, -1, passes)
    return y


def _lut4(x: torch.Tensor, codes: torch.Tensor, table: torch.Tensor, group: int, rows: int, rnd: int) -> torch.Tensor:
    """:class:`~anyquant_cpu.kernels.lut.Lut4Linear`'s decode path on float32 rows ``x``: ``table`` holds its 16
    values, then its ``[rows, in / group]`` scales (the module's two buffers are views of it)."""
    y: torch.Tensor = torch.ops.anyquant.lut4_gemv(x, codes, table[16:].view(rows, -1), table[:16], group, rnd)
    return y


def _lut4_cat(
    x: torch.Tensor,
    codes: List[torch.Tensor],  # noqa: UP006
    tables: List[torch.Tensor],  # noqa: UP006
    groups: List[int],  # noqa: UP006
    rnd: int,
) -> torch.Tensor:
    """:func:`_lut4` of several weights on the same rows ``x`` (q, k, v; gate, up), their outputs side by side: one
    kernel call (one parallel region, no concatenation), each output as :func:`_lut4` computes it."""
    y: torch.Tensor = torch.ops.anyquant.lut4_gemv_cat(x, codes, tables, groups, rnd)
    return y


def _fp8(x: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, group: int, rnd: int) -> torch.Tensor:
    """:class:`~anyquant_cpu.kernels.lut.E4M3Linear`'s decode path on float32 rows ``x``."""
    y: torch.Tensor = torch.ops.anyquant.fp8_gemv(x, bits, scales, group, rnd)
    return y


def _in_python(function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``function`` left to Python by TorchScript (for compiling where the kernel op it calls is not loaded): a call
    back with ``function``'s signature, which TorchScript reads from the annotations (types, not strings)."""

    @functools.wraps(function)
    def call(*args: Any) -> torch.Tensor:
        return function(*args)

    hints = get_type_hints(function)  # this module's annotations are strings (postponed evaluation)
    signature = inspect.signature(function)
    params = [p.replace(annotation=hints[p.name]) for p in signature.parameters.values()]
    call.__signature__ = signature.replace(parameters=params, return_annotation=hints["return"])  # type: ignore[attr-defined]
    call.__annotations__ = hints
    ignored: Callable[..., torch.Tensor] = torch.jit.ignore(call)  # type: ignore[no-untyped-call]
    return ignored


_ggml_in_python = _in_python(_ggml)
_ggml_cat_in_python = _in_python(_ggml_cat)
_experts_in_python = _in_python(_experts)
_lut4_in_python = _in_python(_lut4)
_lut4_cat_in_python = _in_python(_lut4_cat)
_fp8_in_python = _in_python(_fp8)


def ggml_layer(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: List[torch.Tensor],  # noqa: UP006 - the caches' key buffers, each of its rows (one: a padded batch's)
    values: List[torch.Tensor],  # noqa: UP006
    starts: List[int],  # noqa: UP006 - where each writes its new position
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
    passes: int,  # their activation passes (one count: layers of several take the mixed function)
    q_norm: Optional[torch.Tensor],  # noqa: UP045
    k_norm: Optional[torch.Tensor],  # noqa: UP045
) -> torch.Tensor:
    """:func:`int4_layer` for layers of GGUF-block linears (Q4_0, Q4_1, Q8_0, or GQ4): four kernel calls (q/k/v
    and gate/up one call each)."""
    b, hidden = h.shape[0], h.shape[-1]
    x = _rms(h, norm1, eps).view(b, hidden)
    y = _ggml_cat(x, blocks[0:3], kinds[0:3], rows[0:3], passes)
    qk, v = y[:, : rows[0] + rows[1]], y[:, rows[0] + rows[1] :]
    a = _attention(qk, v, cos, sin, keys, values, starts, mask, heads, kv_heads, head_dim, scaling, q_norm, k_norm, eps)
    h = h + _ggml(a, blocks[3], kinds[3], rows[3], passes).view(b, 1, hidden)
    x = _rms(h, norm2, eps).view(b, hidden)
    gu = _ggml_cat(x, blocks[4:6], kinds[4:6], rows[4:6], passes)
    m = F.silu(gu[:, : rows[4]]) * gu[:, rows[4] :]
    return h + _ggml(m, blocks[6], kinds[6], rows[6], passes).view(b, 1, hidden)


#: one linear of a :func:`mixed_layer`: ``(kind, a, b, c, rows, passes)``. kind 0: cpu-fast int4 (``a`` the packed
#: weight, ``b`` its scales and offsets, ``c`` the kernel group); 1: bfloat16 prepacked (``a`` the oneDNN weight);
#: 2: GGUF blocks read in place (``a`` the blocks, ``c`` the GGUF type, ``passes`` the activation passes); 3: a 4-bit
#: table (``a`` the codes, ``b`` the table and scales, ``c`` the group, ``passes`` the rounding); 4: FP8 E4M3 (``a``
#: the weight's bytes, ``b`` the scales, ``c`` the group, ``passes`` the rounding).
#: ``rows``: the output features. Unused fields hold an empty tensor or 0.
Linear = Tuple[int, torch.Tensor, torch.Tensor, int, int, int]  # noqa: UP006 - TorchScript reads Tuple


def _linear(x: torch.Tensor, p: Linear) -> torch.Tensor:
    """One linear of any of the three kinds of :data:`Linear` on float32 rows ``x``: its module's decode path."""
    kind = p[0]
    if kind == 0:
        return _int4(x, p[1], p[3], p[2])
    if kind == 1:
        return _bf16(x, p[1])
    if kind == 3:
        return _lut4(x, p[1], p[2], p[3], p[4], p[5])
    if kind == 4:
        return _fp8(x, p[1], p[2], p[3], p[5])
    return _ggml(x, p[1], p[3], p[4], p[5])


def _joint(x: torch.Tensor, parts: List[Linear]) -> torch.Tensor:  # noqa: UP006
    """Linears that share their input, their outputs side by side: one call where ``parts`` is one fused int4
    linear (as :class:`~anyquant_runtime.layers.FusedInt4` runs them) or GGUF-block linears of one activation
    passes count (:func:`_ggml_cat`), else each in turn."""
    if len(parts) == 1:
        return _linear(x, parts[0])
    joint = _block_cat(x, parts)
    if joint is None:
        joint = _table_cat(x, parts)
    if joint is not None:
        return joint
    return torch.cat([_linear(x, p) for p in parts], 1)


def _block_cat(x: torch.Tensor, parts: List[Linear]) -> Optional[torch.Tensor]:  # noqa: UP006, UP045
    """``parts``' outputs on ``x`` side by side from one :func:`_ggml_cat` call where every one is a GGUF-block
    linear of the first one's activation passes count; else ``None``."""
    blocks: List[torch.Tensor] = []  # noqa: UP006
    kinds: List[int] = []  # noqa: UP006
    rows: List[int] = []  # noqa: UP006
    for p in parts:
        if p[0] != 2 or p[5] != parts[0][5]:
            return None
        blocks.append(p[1])
        kinds.append(p[3])
        rows.append(p[4])
    return _ggml_cat(x, blocks, kinds, rows, parts[0][5])


def _table_cat(x: torch.Tensor, parts: List[Linear]) -> Optional[torch.Tensor]:  # noqa: UP006, UP045
    """``parts``' outputs on ``x`` side by side from one :func:`_lut4_cat` call where every one is a 4-bit table
    linear of the first one's rounding; else ``None``."""
    codes: List[torch.Tensor] = []  # noqa: UP006
    tables: List[torch.Tensor] = []  # noqa: UP006
    groups: List[int] = []  # noqa: UP006
    for p in parts:
        if p[0] != 3 or p[5] != parts[0][5]:
            return None
        codes.append(p[1])
        tables.append(p[2])
        groups.append(p[3])
    return _lut4_cat(x, codes, tables, groups, parts[0][5])


def _mlp(x: torch.Tensor, gate_up: List[Linear], down: Linear, intermediate: int) -> torch.Tensor:  # noqa: UP006
    """A SiLU-gated MLP (a dense layer's or one expert's) on rows ``x``."""
    gu = _joint(x, gate_up)
    return _linear(F.silu(gu[:, :intermediate]) * gu[:, intermediate:], down)


def mixed_attention(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: List[torch.Tensor],  # noqa: UP006 - the caches' key buffers, each of its rows (one: a padded batch's)
    values: List[torch.Tensor],  # noqa: UP006
    starts: List[int],  # noqa: UP006 - where each writes its new position
    mask: Optional[torch.Tensor],  # noqa: UP045 - TorchScript reads the annotation
    norm1: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    qkv: List[Linear],  # noqa: UP006 - one fused int4 linear, or q, k, v
    o: Linear,
    q_norm: Optional[torch.Tensor],  # noqa: UP045
    k_norm: Optional[torch.Tensor],  # noqa: UP045
) -> torch.Tensor:
    """The attention half of :func:`mixed_layer`: ``h`` plus the attention of its normalised rows."""
    b, hidden = h.shape[0], h.shape[-1]
    y = _joint(_rms(h, norm1, eps).view(b, hidden), qkv)
    rotated = (heads + kv_heads) * head_dim
    a = _attention(
        y[:, :rotated],
        y[:, rotated:],
        cos,
        sin,
        keys,
        values,
        starts,
        mask,
        heads,
        kv_heads,
        head_dim,
        scaling,
        q_norm,
        k_norm,
        eps,
    )
    return h + _linear(a, o).view(b, 1, hidden)


def mixed_layer(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: List[torch.Tensor],  # noqa: UP006 - the caches' key buffers, each of its rows (one: a padded batch's)
    values: List[torch.Tensor],  # noqa: UP006
    starts: List[int],  # noqa: UP006 - where each writes its new position
    mask: Optional[torch.Tensor],  # noqa: UP045 - TorchScript reads the annotation
    norm1: torch.Tensor,
    norm2: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    qkv: List[Linear],  # noqa: UP006 - one fused int4 linear, or q, k, v
    o: Linear,
    q_norm: Optional[torch.Tensor],  # noqa: UP045
    k_norm: Optional[torch.Tensor],  # noqa: UP045
    gate_up: List[Linear],  # noqa: UP006 - one fused int4 linear, or gate, up
    down: Linear,
    intermediate: int,
) -> torch.Tensor:
    """:func:`int4_layer` for a layer whose linears are of different cpu-fast kinds (a GGUF Q4_K_M file's Q4_K
    int4 and Q6_K bfloat16, a Q4_0 file's blocks and its Q6_K ones): each linear its own kind's call
    (:data:`Linear`), the int4 q/k/v or gate/up one fused call where the module path fuses them."""
    b, hidden = h.shape[0], h.shape[-1]
    h = mixed_attention(
        h, cos, sin, keys, values, starts, mask, norm1, eps, heads, kv_heads, head_dim, scaling, qkv, o, q_norm, k_norm
    )
    x = _rms(h, norm2, eps).view(b, hidden)
    return h + _mlp(x, gate_up, down, intermediate).view(b, 1, hidden)


def mixed_moe_layer(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: List[torch.Tensor],  # noqa: UP006 - the caches' key buffers, each of its rows (one: a padded batch's)
    values: List[torch.Tensor],  # noqa: UP006
    starts: List[int],  # noqa: UP006 - where each writes its new position
    mask: Optional[torch.Tensor],  # noqa: UP045 - TorchScript reads the annotation
    norm1: torch.Tensor,
    norm2: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    qkv: List[Linear],  # noqa: UP006 - one fused int4 linear, or q, k, v
    o: Linear,
    q_norm: Optional[torch.Tensor],  # noqa: UP045
    k_norm: Optional[torch.Tensor],  # noqa: UP045
    router: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    gate_up: List[List[Linear]],  # noqa: UP006 - per expert: one fused int4 linear, or gate, up
    down: List[Linear],  # noqa: UP006 - per expert
    intermediate: int,
    expert_blocks: List[torch.Tensor],  # noqa: UP006 - every expert's gate, up, down where all are GGUF-block linears
    expert_kinds: List[int],  # noqa: UP006 - their block types
    expert_passes: int,  # their activation passes (one count), 0 where expert_blocks is empty
) -> torch.Tensor:
    """:func:`int4_moe_layer` with each expert's (and the attention's) linears of any cpu-fast kind, as
    :func:`mixed_layer` runs them; one token's experts in one kernel call (:func:`_experts`) where they are all
    GGUF-block linears of one activation passes count."""
    b, hidden = h.shape[0], h.shape[-1]
    h = mixed_attention(
        h, cos, sin, keys, values, starts, mask, norm1, eps, heads, kv_heads, head_dim, scaling, qkv, o, q_norm, k_norm
    )
    x = _rms(h, norm2, eps).view(b, hidden)
    logits = F.linear(x, router)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    top, index = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    top = top.to(logits.dtype)
    if b == 1 and expert_passes > 0:
        return h + _experts(x, index, top, expert_blocks, expert_kinds, intermediate, expert_passes).view(b, 1, hidden)
    out = torch.zeros_like(x)
    if b == 1:
        chosen: List[int] = index[0].tolist()  # noqa: UP006
        weights = top[0]
        for e in sorted(chosen):
            out = out + _mlp(x, gate_up[e], down[e], intermediate) * weights[chosen.index(e)]
    else:
        experts: List[int] = torch.unique(index).tolist()  # noqa: UP006
        for e in experts:
            found = torch.where(index == e)
            rows, pos = found[0], found[1]
            y = _mlp(x[rows], gate_up[e], down[e], intermediate) * top[rows, pos].unsqueeze(1)
            out.index_add_(0, rows, y)
    return h + out.view(b, 1, hidden)


LAYER_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "int4": int4_layer,
    "int4_moe": int4_moe_layer,
    "bf16": bf16_layer,
    "ggml": ggml_layer,
    "mixed": mixed_layer,
    "mixed_moe": mixed_moe_layer,
}
_compiled: dict[str, Callable[..., torch.Tensor]] = {}
_compile_lock = threading.Lock()


@contextlib.contextmanager
def _scripting(kinds: Collection[str]) -> Iterator[None]:
    """While TorchScript compiles functions of ``kinds``: where the kernel op is not loaded, the ``mixed``
    functions' block branch is compiled as a call back into Python (no GGUF-block linear can exist without
    the op, which TorchScript must resolve)."""
    global _ggml, _ggml_cat, _experts, _rms, _lut4, _lut4_cat, _fp8, _kernel_attention
    from . import kernels

    compiled = _ggml, _ggml_cat, _experts, _rms, _lut4, _lut4_cat, _fp8, _kernel_attention
    if not kernels.available():
        _rms = _rms_torch
    if not kernels.attention_available():
        _kernel_attention = _kernel_attention_missing
        if any(kind.startswith("mixed") for kind in kinds):
            _ggml, _ggml_cat, _experts = _ggml_in_python, _ggml_cat_in_python, _experts_in_python
    if not kernels.lut_available() and any(kind.startswith("mixed") for kind in kinds):
        _lut4, _lut4_cat, _fp8 = _lut4_in_python, _lut4_cat_in_python, _fp8_in_python
    try:
        with warnings.catch_warnings():
            # torch 2.9+ marks torch.jit.script deprecated; it is what runs a fixed op sequence
            # without Python between the ops on every torch this project supports
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        _ggml, _ggml_cat, _experts, _rms, _lut4, _lut4_cat, _fp8, _kernel_attention = compiled


def compiled_layer(kind: str) -> Callable[..., torch.Tensor]:
    """``LAYER_FUNCTIONS[kind]`` compiled by TorchScript once per process (the plain function where
    TorchScript is missing or refuses it; torch's ``PYTORCH_JIT=0`` gives the plain function too)."""
    with _compile_lock:
        if kind not in _compiled:
            function = LAYER_FUNCTIONS[kind]
            try:
                with _scripting([kind]):
                    _compiled[kind] = torch.jit.script(function)
            except Exception as e:  # any refusal means: run the Python function
                log.debug("TorchScript did not compile the %s decode step (%s); running it as Python", kind, e)
                _compiled[kind] = function
        return _compiled[kind]


class _Planned(nn.Module):
    """One layer of a :class:`_Stack`: the arguments of its :data:`LAYER_FUNCTIONS` function after ``mask``
    (a tuple attribute: TorchScript types it from the values)."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        super().__init__()
        self.args = args


class _Int4Layer(_Planned):
    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, k: Tensors, v: Tensors, start: Ints, mask: Opt) -> Tensor:
        return int4_layer(h, cos, sin, k, v, start, mask, *self.args)


class _Int4MoeLayer(_Planned):
    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, k: Tensors, v: Tensors, start: Ints, mask: Opt) -> Tensor:
        return int4_moe_layer(h, cos, sin, k, v, start, mask, *self.args)


class _Bf16Layer(_Planned):
    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, k: Tensors, v: Tensors, start: Ints, mask: Opt) -> Tensor:
        return bf16_layer(h, cos, sin, k, v, start, mask, *self.args)


class _GgmlLayer(_Planned):
    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, k: Tensors, v: Tensors, start: Ints, mask: Opt) -> Tensor:
        return ggml_layer(h, cos, sin, k, v, start, mask, *self.args)


class _MixedLayer(_Planned):
    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, k: Tensors, v: Tensors, start: Ints, mask: Opt) -> Tensor:
        return mixed_layer(h, cos, sin, k, v, start, mask, *self.args)


class _MixedMoeLayer(_Planned):
    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, k: Tensors, v: Tensors, start: Ints, mask: Opt) -> Tensor:
        return mixed_moe_layer(h, cos, sin, k, v, start, mask, *self.args)


_LAYER_MODULES: dict[str, type[_Planned]] = {
    "int4": _Int4Layer,
    "int4_moe": _Int4MoeLayer,
    "bf16": _Bf16Layer,
    "ggml": _GgmlLayer,
    "mixed": _MixedLayer,
    "mixed_moe": _MixedMoeLayer,
}


class _Stack(nn.Module):
    """Every layer of a :class:`DecodeStep` in one TorchScript call (a call per layer from Python converts
    its twenty-odd arguments each time: ~25 us a layer, ~10 % of a SmolLM2 decode step on two cores)."""

    def __init__(self, layers: list[_Planned]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Opt,
        keys: List[Tensors],  # noqa: UP006 - per layer, each cache's buffers
        values: List[Tensors],  # noqa: UP006
        starts: List[Ints],  # noqa: UP006
    ) -> Tensor:
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, keys[i], values[i], starts[i], mask)
        return h


def _stack(layers: list[_Layer]) -> Any:
    """The scripted :class:`_Stack` of ``layers`` (every layer planned), or ``None`` where TorchScript is off,
    missing or refuses it (then :meth:`DecodeStep.run` calls each layer's function)."""
    if os.environ.get("PYTORCH_JIT", "1") == "0":
        return None
    try:
        with _compile_lock, _scripting({layer.kind for layer in layers}):
            return torch.jit.script(_Stack([_LAYER_MODULES[layer.kind](layer.args) for layer in layers]))
    except Exception as e:  # any refusal means: one call per layer
        log.debug("TorchScript did not compile the decode step's layers as one call (%s)", e)
        return None


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
    """The fast decode path of one :class:`~anyquant_runtime.native.NativeCausalLM` (see the module docstring).

    Built by :meth:`build` on the model's first decode step: per layer, the function of
    :data:`LAYER_FUNCTIONS` that computes it and its arguments (a one-kind function where every linear is of
    that kind, else the ``mixed`` ones), or ``None`` for a layer with a linear that is not cpu-fast (a layer a
    GPTQ ``dynamic`` rule left dense, a GGUF tensor dequantized to float32 where no bfloat16 prepacking runs, a
    bias ...), which runs through its module. ``build`` gives ``None`` when no layer qualifies (then the
    model never asks again)."""

    def __init__(self, model: Any, layers: list[_Layer | None], watched: list[tuple[Any, str, Any]]) -> None:
        self.layers = [None if layer is None else (compiled_layer(layer.kind), layer.args) for layer in layers]
        # every layer planned: all of them in one call (as long as ``layers`` is this list: a bench swaps it)
        self.stack = _stack([layer for layer in layers if layer is not None]) if None not in layers else None
        self._stacked = self.layers
        self._kv_shapes = [(layer.args[4], layer.args[5]) for layer in layers if layer is not None]
        self.modules = model.model.layers
        #: each layer's sliding window (``None``: full attention): a windowed layer's function is given the cache
        #: from the first position its window holds (its mask likewise), the keys and values the module path's
        #: attention sees (:meth:`~anyquant_runtime.native.Attention.attend`)
        self.windows: list[int | None] = [getattr(m.self_attn, "window", None) for m in self.modules]
        self._stack_windows = [w for w, layer in zip(self.windows, layers, strict=True) if layer is not None]
        self.windowed = any(w is not None for w in self._stack_windows)
        self.watched = watched
        # the modules whose hooks the module path would call (the model's own run either way; its
        # Decoder and ModuleList have no forward of their own); checked on every step, so as flat lists that
        # map() walks without a Python frame per module (a few hundred modules: ~0.5 ms a token otherwise)
        self.hookable = [child for _, _, child in watched[2:]]
        # their hook dicts (torch's register_* hook methods fill these in place; a module keeps its own for its
        # life) and instance dicts, gathered once: a step tests each for emptiness (a few hundred modules: the
        # attribute lookups took ~50 us a token)
        self._hook_dicts = [m._forward_hooks for m in self.hookable] + [m._forward_pre_hooks for m in self.hookable]
        self._instance_dicts = [vars(m) for m in self.hookable]
        self._parent_dicts = [parent._modules for parent, _, _ in watched]
        self._names = [name for _, name, _ in watched]
        self._children = [child for _, _, child in watched]
        self.small_rows = min(layer.small_rows for layer in layers if layer is not None)
        #: every layer in the one call, each attending by the kernel (scaling < 0: the planner's mark)
        self.rows_ready = self.stack is not None and all(layer is not None and layer.args[6] < 0 for layer in layers)

    @staticmethod
    def build(model: Any, uniform: bool = True) -> DecodeStep | None:
        """``uniform=False``: the ``mixed`` functions for every layer (for measuring them against the others)."""
        layers = [_plan_layer(layer, uniform) for layer in model.model.layers]
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
            if planned.kind in ("int4_moe", "mixed_moe"):
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
        # no hooks on a hookable module, nor a ``forward`` set on the instance (as accelerate's and similar
        # wrappers do), and each watched child still in its place
        if any(self._hook_dicts):
            return False
        if any(map(operator.contains, self._instance_dicts, itertools.repeat("forward"))):
            return False
        return all(map(operator.is_, map(dict.get, self._parent_dicts, self._names), self._children))

    def run(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, cache: Any
    ) -> torch.Tensor:
        """All layers for one new token per row, writing the cache (``h`` ``[b, 1, hidden]``)."""
        # a padding mask with sliding layers: each layer its own columns (one call per layer)
        if self.stack is not None and self.layers is self._stacked and not (self.windowed and mask is not None):
            return self._stacked_call(h, cos, sin, mask, [cache], h.shape[0])
        for i, (module, planned) in enumerate(zip(self.modules, self.layers, strict=True)):
            if planned is None:
                h = module(h, cos, sin, mask, cache)
                continue
            function, args = planned
            start = cache.lengths[i]
            keys, values = cache.reserve(i, start + 1, h.shape[0], args[4], args[5], h)  # kv_heads, head_dim
            first, layer_mask = _first(start, self.windows[i]), mask
            if first:
                keys, values = (
                    keys.narrow(2, first, keys.shape[2] - first),
                    values.narrow(2, first, values.shape[2] - first),
                )
                layer_mask = None if mask is None else mask[..., first:]
            h = function(h, cos, sin, [keys], [values], [start - first], layer_mask, *args)
            cache.lengths[i] = start + 1
        return h

    def rows_usable(self, h: torch.Tensor) -> bool:
        """Whether :meth:`run_rows` may step ``h``'s rows: :meth:`usable`, every layer planned into the one
        compiled call, each with the kernel's attention (one call over every row's own cache)."""
        return self.rows_ready and self.layers is self._stacked and self.usable(h)

    def run_rows(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[Any]) -> torch.Tensor:
        """All layers for one new token in each row of ``h`` (``[rows, 1, hidden]``), row ``i`` attending over its
        own ``caches[i]`` (written): :meth:`~anyquant_runtime.native.NativeCausalLM.decode_rows` in one compiled
        call, each row's numbers those of the module path's rows."""
        return self._stacked_call(h, cos, sin, None, caches, 1)

    def _stacked_call(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        caches: list[Any],
        rows: int,
    ) -> torch.Tensor:
        """Every layer in the one compiled call, ``h``'s rows taken by ``caches`` in order (``rows`` each): per layer,
        each cache's buffers from the first position its window holds and where the new position goes; then each
        cache one position longer in every layer."""
        keys, values, starts = [], [], []
        for i, (kv_heads, head_dim) in enumerate(self._kv_shapes):
            window = self._stack_windows[i]
            layer_k, layer_v, layer_s = [], [], []
            for cache in caches:
                start = cache.lengths[i]
                k, v = cache.reserve(i, start + 1, rows, kv_heads, head_dim, h)
                first = _first(start, window)
                layer_k.append(k.narrow(2, first, k.shape[2] - first) if first else k)
                layer_v.append(v.narrow(2, first, v.shape[2] - first) if first else v)
                layer_s.append(start - first)
            keys.append(layer_k)
            values.append(layer_v)
            starts.append(layer_s)
        h = self.stack(h, cos, sin, mask, keys, values, starts)  # type: ignore[misc] # called where it is compiled
        for cache in caches:
            cache.lengths[:] = [n + 1 for n in cache.lengths]
        return h


def _first(start: int, window: int | None) -> int:
    """The first cache position that the window of a query at position ``start`` holds (0: no window)."""
    return 0 if window is None else max(0, start - window + 1)


def _plain_norm(m: nn.Module) -> bool:
    return type(m) is RMSNorm and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"


def _plain_int4(m: nn.Module) -> bool:
    from .engine import FastInt4Linear

    return (
        isinstance(m, FastInt4Linear)
        and type(m).forward is FastInt4Linear.forward
        and m.perm is None
        and m.bias is None
        and m.padded_out == m.out_features
        and m.packed.device.type == "cpu"
    )


def _plain_bf16(m: nn.Module) -> bool:
    from .engine import PrepackedBf16Linear

    return type(m) is PrepackedBf16Linear and m.bias is None


def _plain_ggml(m: nn.Module) -> bool:
    from .kernels.linear import BlockLinear

    return isinstance(m, BlockLinear) and type(m).forward is BlockLinear.forward and m.bias is None


_NO_TENSOR = torch.empty(0)


def _linear_spec(m: Any) -> tuple[tuple[Any, ...], int] | None:
    """``(the Linear tuple of mixed_layer, its small_rows)`` for one cpu-fast linear or plain
    :class:`FusedInt4`, else ``None``."""
    if isinstance(m, FusedInt4):
        if not m.plain:
            return None
        return (0, m.packed, m.scales_and_zeros, m.kernel_group, sum(m.sizes), 0), m.small_rows
    if _plain_int4(m):
        if not m.scales_and_zeros.is_contiguous():  # used as it is
            return None
        return (0, m.packed, m.scales_and_zeros, m.kernel_group, m.out_features, 0), m.small_rows
    if _plain_bf16(m):
        return (1, m.packed, _NO_TENSOR, 0, m.out_features, 0), 2**62 if m.small_rows is None else m.small_rows
    if _plain_ggml(m):
        return (2, m.blocks, _NO_TENSOR, m.ggml_type, m.out_features, m.passes), m.small_rows
    return _table_spec(m)


def _table_spec(m: Any) -> tuple[tuple[Any, ...], int] | None:
    """:func:`_linear_spec` of a plain :class:`~anyquant_cpu.kernels.lut.Lut4Linear` or
    :class:`~anyquant_cpu.kernels.lut.E4M3Linear` (no bias, its forward the class's own), else ``None``."""
    from .kernels.lut import ROUND_CODES, E4M3Linear, Lut4Linear

    if type(m) is Lut4Linear and m.bias is None:
        table = m.table()
        if table is None:
            return None
        return (3, m.codes, table, m.group, m.out_features, ROUND_CODES[m.round_to]), m.small_rows
    if type(m) is E4M3Linear and m.bias is None and m.scales.is_contiguous():
        return (4, m.weight_bits, m.scales, m.group, m.out_features, ROUND_CODES[m.round_to]), m.small_rows
    return None


def _joint_specs(module: nn.Module, names: tuple[str, ...]) -> tuple[list[tuple[Any, ...]], int] | None:
    """The Linear tuples of ``module``'s linears ``names`` as the module path runs them
    (:func:`~anyquant_runtime.layers._joint`: their :class:`FusedInt4` where it has one, else each), and their
    least small_rows; ``None`` when one is not a cpu-fast linear."""
    fused = fusion(module, names)
    parts = [_linear_spec(fused)] if fused is not None else [_linear_spec(getattr(module, n)) for n in names]
    specs = [p for p in parts if p is not None]
    if len(specs) != len(parts):
        return None
    return [spec for spec, _ in specs], min(rows for _, rows in specs)


def _plan_layer(layer: Any, uniform: bool = True) -> _Layer | None:
    """How :class:`DecodeStep` runs ``layer``: ``None`` when some part of it is not the shape one of
    :data:`LAYER_FUNCTIONS` computes. ``uniform``: the one-kind functions where they apply (else always the
    ``mixed`` ones: for measuring them against each other)."""
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    if not (_plain_norm(norm1) and _plain_norm(norm2) and norm1.variance_epsilon == norm2.variance_epsilon):
        return None
    if norm1.kernel_rows != norm2.kernel_rows:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if getattr(attn, "kv_quant", None) is not None:  # a quantized KV cache: the module path applies it
        return None
    if not getattr(attn, "plain", True) or getattr(attn, "softcap", None) is not None:
        return None  # Gemma 2's and 3's four norms, soft-capping, two rotary tables: the module path
    rotary_dim = getattr(attn, "rotary_dim", attn.head_dim)
    if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")) or rotary_dim != attn.head_dim:
        return None  # Phi-3's fused qkv_proj or partial rotary embedding: the module path
    if getattr(mlp, "act_fn", F.silu) is not F.silu:
        return None  # Gemma's GELU: the functions compute SiLU MLPs
    eps = float(norm1.variance_epsilon)
    norms = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    qk_norms: tuple[Any, ...] = (None, None)
    if norms != [None, None]:
        if not all(m is not None and _plain_norm(m) and float(m.variance_epsilon) == eps for m in norms):
            return None
        # on the kernel with the hidden-state norms (up to as many tokens: kernel_rows counts their heads' rows)
        qk_rows = [0 if m is None else m.kernel_rows for m in norms]
        if qk_rows != [norm1.kernel_rows * attn.heads, norm1.kernel_rows * attn.kv_heads]:
            return None
        qk_norms = tuple(m.weight for m in norms if m is not None)
    # the kernel's norm (eps < 0: _rms), which the modules take up to kernel_rows rows: the step no further
    kernel_rows = int(norm1.kernel_rows)
    common: tuple[Any, ...] = (norm1.weight, norm2.weight, -eps if kernel_rows > 0 else eps)
    # the kernel's attention (scaling < 0: _attention) where the module decodes on it
    scaling = float(attn.scaling)
    common += (attn.heads, attn.kv_heads, attn.head_dim, -scaling if getattr(attn, "decode_kernel", False) else scaling)
    sparse = _sparse(mlp)
    if sparse is None and not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return None  # an MLP of another make
    planned = _plan_uniform(layer, common, qk_norms, sparse) if uniform else None
    if planned is None:
        planned = _plan_mixed(layer, common, qk_norms, sparse)
    if planned is not None and kernel_rows > 0:
        planned = planned._replace(small_rows=min(planned.small_rows, kernel_rows))
    return planned


def _plan_mixed(
    layer: Any, common: tuple[Any, ...], qk_norms: tuple[Any, ...], sparse: tuple[Any, ...] | None
) -> _Layer | None:
    """The ``mixed`` or ``mixed_moe`` plan of ``layer``: each linear (or fused int4 group) as its own kind."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o = _joint_specs(attn, ("q_proj", "k_proj", "v_proj")), _linear_spec(attn.o_proj)
    if qkv is None or o is None:
        return None
    attention: tuple[Any, ...] = (qkv[0], o[0], *qk_norms)
    small_rows = min(qkv[1], o[1])
    if sparse is not None:
        router, top_k, norm_topk, experts = sparse
        intermediate = experts[0].gate_proj.out_features
        gate_ups, downs = [], []
        for expert in experts:
            gate_up, down = _joint_specs(expert, ("gate_proj", "up_proj")), _linear_spec(expert.down_proj)
            if gate_up is None or down is None or expert.gate_proj.out_features != intermediate:
                return None  # one intermediate size: the function splits a fused gate/up at it
            gate_ups.append(gate_up[0])
            downs.append(down[0])
            small_rows = min(small_rows, gate_up[1], down[1])
        moe = (router, top_k, norm_topk, gate_ups, downs, intermediate, *_expert_blocks(experts, intermediate))
        return _Layer("mixed_moe", common + attention + moe, small_rows)
    gate_up, down = _joint_specs(mlp, ("gate_proj", "up_proj")), _linear_spec(mlp.down_proj)
    if gate_up is None or down is None:
        return None
    small_rows = min(small_rows, gate_up[1], down[1])
    dense = (gate_up[0], down[0], mlp.gate_proj.out_features)
    return _Layer("mixed", common + attention + dense, small_rows)


def _expert_blocks(experts: list[Any], intermediate: int) -> tuple[list[torch.Tensor], list[int], int]:
    """:func:`mixed_moe_layer`'s ``(expert_blocks, expert_kinds, expert_passes)``: every expert's gate, up and down
    blocks and types where all are plain GGUF-block linears of one activation passes count (gate and up
    ``intermediate`` rows, down back to the hidden size), else empty lists and 0."""
    linears = [m for e in experts for m in (e.gate_proj, e.up_proj, e.down_proj)]
    hidden = experts[0].gate_proj.in_features
    shapes = {(e.gate_proj.out_features, e.up_proj.out_features, e.down_proj.out_features) for e in experts}
    if not all(_plain_ggml(m) for m in linears) or len({m.passes for m in linears}) != 1:
        return [], [], 0
    if shapes != {(intermediate, intermediate, hidden)} or any(
        e.down_proj.in_features != intermediate for e in experts
    ):
        return [], [], 0
    return [m.blocks for m in linears], [m.ggml_type for m in linears], int(linears[0].passes)


def _plan_uniform(
    layer: Any, common: tuple[Any, ...], qk_norms: tuple[Any, ...], sparse: tuple[Any, ...] | None
) -> _Layer | None:
    """The plan of ``layer`` by one of the one-kind functions (``bf16``, ``ggml``, ``int4``, ``int4_moe``), else ``None``."""
    attn, mlp = layer.self_attn, layer.mlp
    attention = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    if sparse is None and all(_plain_bf16(m) for m in (*attention, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        linears = (*attention, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        packs = tuple(m.packed for m in linears)
        small_rows = min(2**62 if m.small_rows is None else m.small_rows for m in linears)
        return _Layer("bf16", common + packs + qk_norms, small_rows)
    blocked: tuple[Any, ...] = (*attention, mlp.gate_proj, mlp.up_proj, mlp.down_proj) if sparse is None else ()
    if blocked and all(_plain_ggml(m) for m in blocked) and len({m.passes for m in blocked}) == 1:
        ggml: tuple[Any, ...] = ([m.blocks for m in blocked], [m.ggml_type for m in blocked])
        ggml += ([m.out_features for m in blocked], blocked[0].passes)
        return _Layer("ggml", common + ggml + qk_norms, min(m.small_rows for m in blocked))
    qkv = fusion(attn, ("q_proj", "k_proj", "v_proj"))
    o = attn.o_proj
    if not (isinstance(qkv, FusedInt4) and qkv.plain and _plain_int4(o) and o.scales_and_zeros.is_contiguous()):
        return None  # the fused members: FusedInt4.build and .plain checked them; o's scales are used as they are
    int4: tuple[Any, ...] = (qkv.packed, qkv.scales_and_zeros, qkv.kernel_group)
    int4 += (o.packed, o.scales_and_zeros, o.kernel_group, *qk_norms)
    if sparse is not None:
        router, top_k, norm_topk, experts = sparse
        planned = [_plan_mlp(expert) for expert in experts]
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
    dense = _plan_mlp(mlp)
    if dense is None:
        return None
    gate_up, down = dense
    int4 += (gate_up.packed, gate_up.scales_and_zeros, gate_up.kernel_group)
    int4 += (down.packed, down.scales_and_zeros, down.kernel_group, mlp.gate_proj.out_features)
    small_rows = min(qkv.small_rows, gate_up.small_rows, o.small_rows, down.small_rows)
    return _Layer("int4", common + int4, small_rows)


def _plan_mlp(mlp: Any) -> tuple[FusedInt4, Any] | None:
    """The fused gate/up and the down linear of a SiLU-gated MLP (a dense layer's or one expert's) of cpu-fast
    int4 linears, or ``None``."""
    gate_up, down = fusion(mlp, ("gate_proj", "up_proj")), mlp.down_proj
    if not (isinstance(gate_up, FusedInt4) and gate_up.plain and _plain_int4(down)):
        return None
    if not down.scales_and_zeros.is_contiguous():  # used as it is
        return None
    return gate_up, down


def _sparse(mlp: Any) -> tuple[torch.Tensor, int, bool, list[Any]] | None:
    """``(router weight, top_k, norm_topk_prob, experts)`` of the native decoder's Qwen3-MoE block whose experts are
    :class:`~anyquant_runtime.experts.Experts` with SiLU (what :func:`int4_moe_layer` computes), else ``None``."""
    from anyquant_runtime.experts import FORWARDS, Expert, Experts

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
