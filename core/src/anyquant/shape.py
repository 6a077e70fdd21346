"""A decoder's shape from its ``config.json``: layers, heads, KV geometry, parameter counts (MoE experts included).

What ``anyquant estimate``/``advise`` size from, and what a loader reads for logical shapes (EXL3's inspect). Standard
library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import AnyquantError
from .report import EXPERTS_KEYS, EXPERTS_PER_TOKEN_KEYS

__all__ = ["NON_GATED", "ModelShape", "SizingError", "model_shape"]

#: model types whose MLP has two matrices (no gate)
NON_GATED = frozenset({"gpt2", "opt", "gpt_neox", "gptj", "bloom", "falcon", "phi", "starcoder", "gpt_bigcode", "mpt"})


class SizingError(AnyquantError):
    """The model's shape or the hardware could not be worked out from what was given."""


# ---------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts and attention geometry of a decoder-only model."""

    name: str
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tied: bool
    experts: int
    linear_params: int  # decoder linears: what a quantizer's ``bits`` applies to
    embed_params: int
    head_params: int  # 0 when tied to the embeddings
    other_params: int  # norms, routers
    kv_values_per_token: int  # K and V values per token over all layers
    notes: tuple[str, ...] = ()
    #: decoder linear weights one token reads (MoE: the routed experts per token and the shared ones)
    active_linear_params: int = 0
    #: decoder linear weights with every dimension padded to a multiple of 128 (EXL3's storage)
    padded_linear_params: int = 0
    max_context: int | None = None  # max_position_embeddings

    @property
    def parameters(self) -> int:
        return self.linear_params + self.embed_params + self.head_params + self.other_params


def _first(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return default


def _int(cfg: Mapping[str, Any], *keys: str, default: int | None = None, minimum: int = 0) -> int:
    v = _first(cfg, *keys, default=default)
    if isinstance(v, list) and v:  # per-layer values (some GGUF kv-head counts): the largest
        v = max(v, key=lambda x: x if isinstance(x, (int, float)) and not isinstance(x, bool) else -1)
    if (
        not isinstance(v, (int, float))
        or isinstance(v, bool)
        or not math.isfinite(v)
        or v != int(v)
        or v < minimum
        or v > 2**48
    ):
        want = "a positive integer" if minimum > 0 else "a non-negative integer"
        raise SizingError(f"config has no usable {'/'.join(keys)} (got {v!r}; needs {want}): cannot size the model")
    return int(v)


def _pad128(n: int) -> int:
    return -(-n // 128) * 128


def _linears(hidden: int, q: int, kv: int, inter: int, mlp_mats: int) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's attention and MLP linears (one expert's MLP for ``inter``)."""
    attn = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden)]
    return attn + [(hidden, inter)] * (mlp_mats - 1) + [(inter, hidden)]


def model_shape(config: Mapping[str, Any], name: str = "model") -> ModelShape:
    """A :class:`ModelShape` from a transformers ``config.json`` dict (``text_config`` is used when present)."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    assert isinstance(cfg, Mapping)
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers", minimum=1)
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model", minimum=1)
    heads = _int(cfg, "num_attention_heads", "n_head", minimum=1)
    kv_heads = _int(cfg, "num_key_value_heads", "num_kv_heads", default=heads, minimum=1)
    head_dim = _int(cfg, "head_dim", default=hidden // heads, minimum=1)
    vocab = _int(cfg, "vocab_size", minimum=1)
    notes: list[str] = []
    if _first(cfg, "intermediate_size", "ffn_dim", "n_inner") is None:
        notes.append(f"no intermediate_size in the config: assumed 4 x hidden = {4 * hidden} (GPT-2's rule)")
    intermediate = _int(cfg, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden, minimum=1)
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    tie = _first(cfg, "tie_word_embeddings", default=config.get("tie_word_embeddings", False))
    if tie is None:  # null in the config: as if absent
        tie = False
    if not isinstance(tie, bool):
        raise SizingError(f"config's tie_word_embeddings must be true or false, got {tie!r}")
    tied = tie
    experts = _int(cfg, *EXPERTS_KEYS, default=0)

    mlp_mats = 2 if model_type in NON_GATED else 3
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    dense_layer = _linears(hidden, q_out, kv_out, intermediate, mlp_mats)
    attn = sum(i * o for i, o in dense_layer[:4])
    attn_pad = sum(_pad128(i) * _pad128(o) for i, o in dense_layer[:4])
    if experts:
        expert_inter = _int(cfg, "moe_intermediate_size", default=intermediate, minimum=1)
        shared_inter = _int(cfg, "shared_expert_intermediate_size", default=0)
        shared_inter += _int(cfg, "n_shared_experts", default=0) * expert_inter
        per_token = _int(cfg, *EXPERTS_PER_TOKEN_KEYS, default=2, minimum=1)
        expert = sum(i * o for i, o in _linears(hidden, 0, 0, expert_inter, mlp_mats)[4:])
        expert_pad = sum(_pad128(i) * _pad128(o) for i, o in _linears(hidden, 0, 0, expert_inter, mlp_mats)[4:])
        shared = mlp_mats * hidden * shared_inter
        shared_pad = mlp_mats * _pad128(hidden) * _pad128(shared_inter) if shared_inter else 0
        mlp, mlp_active = experts * expert + shared, min(per_token, experts) * expert + shared
        mlp_pad = experts * expert_pad + shared_pad
        router = hidden * experts
        dense_first = min(_int(cfg, "first_k_dense_replace", default=0), layers)  # DeepSeek: first k layers dense
        notes.append(
            f"MoE: {experts} experts per layer, all counted (all must be in memory); {min(per_token, experts)} "
            "read per token (decode speed)" + (f"; the first {dense_first} layers dense" if dense_first else "")
        )
    else:
        mlp = mlp_active = mlp_mats * hidden * intermediate
        mlp_pad = sum(_pad128(i) * _pad128(o) for i, o in dense_layer[4:])
        router, dense_first = 0, 0
    dense_mlp = mlp_mats * hidden * intermediate
    dense_mlp_pad = sum(_pad128(i) * _pad128(o) for i, o in dense_layer[4:])
    moe_layers = layers - dense_first
    linear_params = layers * attn + moe_layers * mlp + dense_first * dense_mlp
    window = cfg.get("sliding_window")
    if (
        isinstance(window, int)
        and not isinstance(window, bool)
        and window > 0
        and cfg.get("use_sliding_window") is not False
    ):
        notes.append(
            f"sliding window of {window} tokens (on some or all layers): the KV cache is sized for the full context; "
            "engines that keep only the window on those layers need less"
        )
    max_ctx = cfg.get("max_position_embeddings")

    kv_per_layer = 2 * kv_heads * head_dim
    if cfg.get("kv_lora_rank"):
        kv_per_layer = _int(cfg, "kv_lora_rank") + _int(cfg, "qk_rope_head_dim", default=0)
        notes.append("MLA: the cache holds one compressed latent per token and layer; attention params approximate")
    return ModelShape(
        name=name,
        model_type=model_type,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        intermediate=intermediate,
        tied=tied,
        experts=experts,
        linear_params=linear_params,
        embed_params=vocab * hidden,
        head_params=0 if tied else vocab * hidden,
        other_params=moe_layers * router + layers * 2 * hidden + hidden,
        kv_values_per_token=layers * kv_per_layer,
        notes=tuple(notes),
        active_linear_params=layers * attn + moe_layers * mlp_active + dense_first * dense_mlp,
        padded_linear_params=layers * attn_pad + moe_layers * mlp_pad + dense_first * dense_mlp_pad,
        max_context=max_ctx if isinstance(max_ctx, int) and not isinstance(max_ctx, bool) and max_ctx > 0 else None,
    )
