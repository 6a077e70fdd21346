"""The native decoder's decode step as one compiled function per layer, for layers whose linears are all
cpu-fast: int4 (GPTQ, AWQ, GGUF Q4) or bfloat16 prepacked (EXL3, EXL2).

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

from .layers import FusedInt4, RMSNorm, _rotary, fusion  # _rotary: the module path's own, compiled in

__all__ = ["LAYER_FUNCTIONS", "DecodeStep", "bf16_layer", "int4_layer"]

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
) -> torch.Tensor:
    """Rotary embedding of the queries and keys ``qk`` (``[b, (heads + kv_heads) * head_dim]``: rotated
    together, elementwise, so bitwise the module path's separate q and k), the KV write at ``start``, and
    attention: ``[b, heads * head_dim]``."""
    b = qk.shape[0]
    rotated = heads + kv_heads
    qk = qk.view(b, 1, rotated, head_dim).transpose(1, 2)
    qk = _rotary(qk, cos, sin)
    keys.narrow(2, start, 1).copy_(qk[:, heads:])
    values.narrow(2, start, 1).copy_(v.view(b, 1, kv_heads, head_dim).transpose(1, 2))
    out = F.scaled_dot_product_attention(
        qk[:, :heads],
        keys.narrow(2, 0, start + 1),
        values.narrow(2, 0, start + 1),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=kv_heads != heads,
    )
    return out.transpose(1, 2).reshape(b, heads * head_dim)


def _int4(x: torch.Tensor, packed: torch.Tensor, group: int, scales: torch.Tensor) -> torch.Tensor:
    """:class:`~anyquant.runtime.fastcpu.FastInt4Linear`'s decode path on float32 rows ``x``."""
    y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group, scales)
    return y.to(x.dtype)


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
    else ``None``. The ops and their order are :class:`~anyquant.runtime.native.DecoderLayer`'s with
    :class:`~anyquant.runtime.layers.FusedInt4` q/k/v and gate/up (``sin`` signed as for :func:`~anyquant.runtime.layers._rotary`)."""
    b, hidden = h.shape[0], h.shape[-1]
    y = _int4(F.rms_norm(h, [hidden], norm1, eps).view(b, hidden), qkv, qkv_group, qkv_scales)
    rotated = (heads + kv_heads) * head_dim
    a = _attention(
        y[:, :rotated], y[:, rotated:], cos, sin, keys, values, start, mask, heads, kv_heads, head_dim, scaling
    )
    h = h + _int4(a, o, o_group, o_scales).view(b, 1, hidden)
    gu = _int4(F.rms_norm(h, [hidden], norm2, eps).view(b, hidden), gate_up, gate_up_group, gate_up_scales)
    m = F.silu(gu[:, :intermediate]) * gu[:, intermediate:]
    return h + _int4(m, down, down_group, down_scales).view(b, 1, hidden)


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
) -> torch.Tensor:
    """:func:`int4_layer` for layers of cpu-fast bfloat16 prepacked linears (EXL3, EXL2): seven oneDNN calls."""
    b, hidden = h.shape[0], h.shape[-1]
    x = F.rms_norm(h, [hidden], norm1, eps).view(b, hidden)
    qk = torch.cat([_bf16(x, q), _bf16(x, k)], 1)
    a = _attention(qk, _bf16(x, v), cos, sin, keys, values, start, mask, heads, kv_heads, head_dim, scaling)
    h = h + _bf16(a, o).view(b, 1, hidden)
    x = F.rms_norm(h, [hidden], norm2, eps).view(b, hidden)
    return h + _bf16(F.silu(_bf16(x, gate)) * _bf16(x, up), down).view(b, 1, hidden)


LAYER_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {"int4": int4_layer, "bf16": bf16_layer}
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
            for parent, names in (
                (layer, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")),
                (attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                (mlp, ("gate_proj", "up_proj", "down_proj")),
            ):
                watched += [(parent, name, parent._modules[name]) for name in names]
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

    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    if not (plain_norm(norm1) and plain_norm(norm2) and norm1.variance_epsilon == norm2.variance_epsilon):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    common: tuple[Any, ...] = (norm1.weight, norm2.weight, float(norm1.variance_epsilon))
    common += (attn.heads, attn.kv_heads, attn.head_dim, float(attn.scaling))
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if all(plain_bf16(m) for m in linears):
        return _Layer("bf16", common + tuple(m.packed for m in linears), 2**62)
    qkv = fusion(attn, ("q_proj", "k_proj", "v_proj"))
    gate_up = fusion(mlp, ("gate_proj", "up_proj"))
    o, down = attn.o_proj, mlp.down_proj
    if not (
        isinstance(qkv, FusedInt4)
        and isinstance(gate_up, FusedInt4)
        and qkv.plain
        and gate_up.plain
        and all(plain_int4(m) for m in (o, down))  # the fused members: FusedInt4.build and .plain checked them
        and o.scales_and_zeros.is_contiguous()  # fused members' are views; these are used as they are
        and down.scales_and_zeros.is_contiguous()
    ):
        return None
    int4: tuple[Any, ...] = (
        qkv.packed,
        qkv.scales_and_zeros,
        qkv.kernel_group,
        o.packed,
        o.scales_and_zeros,
        o.kernel_group,
    )
    int4 += (gate_up.packed, gate_up.scales_and_zeros, gate_up.kernel_group)
    int4 += (down.packed, down.scales_and_zeros, down.kernel_group, mlp.gate_proj.out_features)
    small_rows = min(qkv.small_rows, gate_up.small_rows, o.small_rows, down.small_rows)
    return _Layer("int4", common + int4, small_rows)
