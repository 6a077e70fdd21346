"""The native decoder's decode step as one compiled function per layer, for models whose linears are all
cpu-fast int4.

On a two-core CPU a SmolLM2-135M decode step spends about half its time outside the weight kernels: some
1,500 small ATen calls, each with Python's argument parsing, and the ``nn.Module`` calls around them
(measured in docs/benchmarks.md). When every layer is "RMSNorm, fused int4 q/k/v, rotary, KV write,
attention, int4 o, RMSNorm, fused int4 gate/up, SiLU, int4 down", this module runs that layer as one
TorchScript function (:func:`decoder_layer`), called with the layer's tensors: the same ATen ops in the same
order on the same tensors, so the logits are bitwise those of the module path (tests compare them), with
the Python between the ops gone.

:class:`DecodeStep` decides per call whether the fast path applies and falls back to the modules
otherwise: prompts (more than one new token), activations other than float32, and any forward hook or pre-hook on a layer or one of its submodules, or a global one (hooks keep
firing, because those steps go through the modules; the model's own hooks fire either way). A submodule replaced after the first decode step
takes every later step back to the modules (the step is built once, from the modules it found). Layers
that are not all cpu-fast int4 run through their modules inside a fast step. ``PYTORCH_JIT=0`` (torch's own switch) runs the same function as plain
Python; a torch without TorchScript does the same.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DecodeStep", "decoder_layer"]

log = logging.getLogger(__name__)


def decoder_layer(
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
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    scaling: float,
) -> torch.Tensor:
    """One decoder layer for one new token per sequence (``h`` ``[b, 1, hidden]`` float32), writing its key
    and value at position ``start`` of ``keys``/``values`` (``[b, kv_heads, room, head_dim]``); ``mask``:
    the native model's boolean ``[b, 1, 1, start + 1]`` for padded batches, else ``None``.

    The ops and their order are :class:`~anyquant.runtime.native.DecoderLayer`'s with
    :class:`~anyquant.runtime.native.FusedInt4` q/k/v and gate/up (``sin`` signed as for ``_rotary``)."""
    b = h.shape[0]
    hidden = h.shape[-1]
    x = F.rms_norm(h, [hidden], norm1, eps).view(b, hidden)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), qkv, qkv_group, qkv_scales).to(h.dtype)
    rotated = heads + kv_heads
    qk = y[:, : rotated * head_dim].view(b, 1, rotated, head_dim).transpose(1, 2)
    qk = qk * cos + torch.roll(qk, head_dim // 2, -1) * sin
    keys.narrow(2, start, 1).copy_(qk[:, heads:])
    values.narrow(2, start, 1).copy_(y[:, rotated * head_dim :].view(b, 1, kv_heads, head_dim).transpose(1, 2))
    out = F.scaled_dot_product_attention(
        qk[:, :heads],
        keys.narrow(2, 0, start + 1),
        values.narrow(2, 0, start + 1),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=kv_heads != heads,
    )
    a = out.transpose(1, 2).reshape(b, heads * head_dim).to(torch.bfloat16)
    h = h + torch.ops.aten._weight_int4pack_mm_for_cpu(a, o, o_group, o_scales).to(h.dtype).view(b, 1, hidden)
    x = F.rms_norm(h, [hidden], norm2, eps).view(b, hidden)
    gu = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), gate_up, gate_up_group, gate_up_scales)
    gu = gu.to(h.dtype)
    m = (F.silu(gu[:, :intermediate]) * gu[:, intermediate:]).to(torch.bfloat16)
    return h + torch.ops.aten._weight_int4pack_mm_for_cpu(m, down, down_group, down_scales).to(h.dtype).view(
        b, 1, hidden
    )


_compiled: Callable[..., torch.Tensor] | None = None
_compile_lock = threading.Lock()


def compiled_layer() -> Callable[..., torch.Tensor]:
    """:func:`decoder_layer` compiled by TorchScript once per process (the plain function where TorchScript is
    missing or refuses it; torch's ``PYTORCH_JIT=0`` gives the plain function too)."""
    global _compiled
    with _compile_lock:
        if _compiled is None:
            try:
                with warnings.catch_warnings():
                    # torch 2.9+ marks torch.jit.script deprecated; it is what runs a fixed op sequence
                    # without Python between the ops on every torch this project supports
                    warnings.simplefilter("ignore", DeprecationWarning)
                    _compiled = torch.jit.script(decoder_layer)
            except Exception as e:  # any refusal means: run the Python function
                log.debug("TorchScript did not compile the decode step (%s); running it as Python", e)
                _compiled = decoder_layer
        return _compiled


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _global_hooks() -> bool:
    from torch.nn.modules import module as module_mod

    return bool(
        getattr(module_mod, "_global_forward_hooks", None) or getattr(module_mod, "_global_forward_pre_hooks", None)
    )


class DecodeStep:
    """The fast decode path of one :class:`~anyquant.runtime.native.NativeCausalLM` (see the module docstring).

    Built by :meth:`build` on the model's first decode step: per layer, the arguments of
    :func:`decoder_layer`, or ``None`` for a layer that is not all cpu-fast int4 (a layer a GPTQ ``dynamic``
    rule left dense, a GGUF tensor in Q6_K ...), which runs through its module. ``build`` gives ``None``
    when no layer qualifies (then the model never asks again)."""

    def __init__(self, model: Any, layers: list[tuple[Any, ...] | None], watched: list[tuple[Any, str, Any]]) -> None:
        self.layers = layers
        self.modules = model.model.layers
        self.watched = watched
        # the modules whose hooks the module path would call (the model's own run either way; its
        # Decoder and ModuleList have no forward of their own)
        self.hookable = [child for _, _, child in watched[2:]]
        self.small_rows = min(args[-1] for args in layers if args is not None)
        self.layer = compiled_layer()

    @staticmethod
    def build(model: Any) -> DecodeStep | None:
        layers = [_layer_args(layer) for layer in model.model.layers]
        if all(args is None for args in layers):
            return None
        watched: list[tuple[Any, str, Any]] = [
            (model, "model", model.model),
            (model.model, "layers", model.model.layers),
        ]
        for index, (layer, args) in enumerate(zip(model.model.layers, layers, strict=True)):
            watched.append((model.model.layers, str(index), layer))
            if args is None:
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
        compiled = self.layer
        for i, (module, args) in enumerate(zip(self.modules, self.layers, strict=True)):
            if args is None:
                h = module(h, cos, sin, mask, cache)
                continue
            start = cache.lengths[i]
            keys, values = cache.reserve(i, start + 1, h.shape[0], args[16], args[17], h)
            h = compiled(h, cos, sin, keys, values, start, mask, *args[:-1])
            cache.lengths[i] = start + 1
        return h


def _layer_args(layer: Any) -> tuple[Any, ...] | None:
    """``layer``'s arguments to :func:`decoder_layer` after ``start`` (then the largest row count its kernels
    take), or ``None`` when some part of it is not the shape that function computes."""
    from .fastcpu import FastInt4Linear
    from .native import FusedInt4, RMSNorm, fusion

    def plain_int4(m: nn.Module) -> bool:
        return (
            isinstance(m, FastInt4Linear)
            and type(m).forward is FastInt4Linear.forward
            and m.perm is None
            and m.bias is None
            and m.padded_out == m.out_features
            and m.packed.device.type == "cpu"
        )

    def plain_norm(m: nn.Module) -> bool:
        return type(m) is RMSNorm and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"

    attn, mlp = layer.self_attn, layer.mlp
    qkv = fusion(attn, ("q_proj", "k_proj", "v_proj"))
    gate_up = fusion(mlp, ("gate_proj", "up_proj"))
    o, down = attn.o_proj, mlp.down_proj
    if not (
        isinstance(qkv, FusedInt4)
        and isinstance(gate_up, FusedInt4)
        and qkv.plain
        and gate_up.plain
        and all(plain_int4(m) for m in (*qkv.members, *gate_up.members, o, down))
        and o.scales_and_zeros.is_contiguous()  # fused members' are views; these are used as they are
        and down.scales_and_zeros.is_contiguous()
        and plain_norm(layer.input_layernorm)
        and plain_norm(layer.post_attention_layernorm)
        and layer.input_layernorm.variance_epsilon == layer.post_attention_layernorm.variance_epsilon
    ):
        return None
    return (
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        float(layer.input_layernorm.variance_epsilon),
        qkv.packed,
        qkv.scales_and_zeros,
        qkv.kernel_group,
        o.packed,
        o.scales_and_zeros,
        o.kernel_group,
        gate_up.packed,
        gate_up.scales_and_zeros,
        gate_up.kernel_group,
        down.packed,
        down.scales_and_zeros,
        down.kernel_group,
        attn.heads,
        attn.kv_heads,
        attn.head_dim,
        mlp.gate_proj.out_features,
        float(attn.scaling),
        min(qkv.small_rows, gate_up.small_rows, o.small_rows, down.small_rows),
    )
