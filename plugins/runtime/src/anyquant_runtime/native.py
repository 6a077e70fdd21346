"""anyquant's own Llama-family decoder (and Mixtral, Qwen2-MoE, Phi-3, Gemma 1-3, DeepSeek-V2/V3): the same modules and tensor names as
transformers', a leaner forward.

Built instead of transformers' class when ``load(..., runtime="native")`` asks for it (or ``"auto"`` picks
it: see :func:`native_runtime_reason`). It exists for speed on the CPU:

- **load**: no ``transformers.models.*`` import (about 2 s of a 3 s load measured on SmolLM2-135M: the
  modeling module pulls in ``torch.distributed.tensor``, hub kernels, the conversion machinery ...);
- **decode**: one Python frame per layer and no generic mask/cache machinery: per layer two norms, the
  q/k/v/o and gate/up/down linears (whatever modules the loader put there), rotary embedding, a KV-cache
  write and one ``scaled_dot_product_attention``; with the cpu-fast int4 linears, q/k/v and gate/up each
  run as one kernel call on the decode path (:class:`FusedInt4`), and a decode step runs each layer of
  cpu-fast linears as one TorchScript function (:mod:`anyquant_cpu.step`).

The module tree and parameter names are transformers' (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``,
``model.layers.N.mlp.gate_proj``, ``model.norm``, ``lm_head`` ...), so the loaders' linear factories, tensor
filling, head tying and cpu-fast head work unchanged. The arithmetic follows transformers' Llama/Qwen2/Mistral/Qwen3
code in the same order (RMSNorm in float32 then the weight, ``rotate_half`` rotary embedding (computed with a roll), causal attention
with the padding mask, SiLU-gated MLP): with float32 weights the logits equal transformers' to float rounding
(tests compare them). Supported: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (RMSNorm of each query and key
head before rotary), ``qwen3_moe`` (its sparse blocks: router softmax in float32, top-k, ``norm_topk_prob``,
``decoder_sparse_step``, ``mlp_only_layers``; a checkpoint's per-expert linears become
:class:`~anyquant_runtime.experts.Experts`, only the routed experts run), ``mixtral`` (Mistral's attention, every
layer a sparse block: top-k always renormalised and kept in float32 as its router leaves them; its experts under
transformers 5's names, ``mlp.gate`` and ``mlp.experts``, found in checkpoints as ``block_sparse_moe.experts.N.w1/w3/w2``
through transformers' renaming), ``qwen2_moe`` (q/k/v biases; its sparse blocks add a shared expert, a dense MLP
gated by ``sigmoid(shared_expert_gate(x))``), ``phi3`` (one ``qkv_proj`` and one ``gate_up_proj`` linear, as
transformers' modules hold them; a ``partial_rotary_factor`` turns only the first features of each head; LongRoPE,
:class:`LongRope`: the short or long factors as transformers chooses them for each forward, row by row here, cos and
sin scaled by its attention factor),
``gemma`` (RMSNorm scaled by ``1 + weight``, the embeddings by ``sqrt(hidden_size)`` in their own dtype, a GELU
(tanh) gated MLP, ``head_dim`` from the config), ``gemma2`` (Gemma's, with four norms a layer, the attention scaled
by ``query_pre_attn_scalar``, transformers' eager attention with its scores soft-capped, the logits soft-capped) and
``gemma3_text`` (Gemma 2's layers without soft-capped scores, q/k head norms, the sliding layers' own rotary base)
and ``deepseek_v3`` (multi-head latent attention, :class:`LatentAttention`; group-limited sigmoid routing with
its expert bias, a shared expert and dense first layers, :class:`GroupedMoe`) and ``deepseek_v2`` (the same attention
with its rotary pairs turned as complex numbers, softmax routing, :class:`SoftmaxRouter`)
configs with their activation and default (or ``llama3``; Phi-3: ``longrope``; Gemma 3: ``linear``; DeepSeek:
``yarn``) rotary scaling.
Sliding-window attention is each layer's as transformers' class decides it (:func:`layer_windows`): a sliding
layer's query at cache position ``p`` attends the keys at ``(p - window, p]``, in prompts (a mask), padded batches
and cached steps (the cache keeps every position; its :meth:`NativeCache.update` gives a sliding layer only those
its queries may see). Anything else (other rotary scalings such as dynamic NTK, YaRN outside DeepSeek, the multimodal Gemma 3 ...)
stays on transformers' class, with the reason :func:`native_runtime_reason` gives. The compiled decode step
(:mod:`anyquant_cpu.step`) computes the layers with separate q/k/v, a full rotary embedding, RMSNorm and SiLU
(Mixtral's sparse blocks and sliding windows included) from the ``cos``/``sin`` tables the model gives it (LongRoPE's
too: it computes none of its own); Phi-3's and the Gemmas' layers and Qwen2-MoE's sparse blocks run through their
modules.
:meth:`NativeCausalLM.decode_rows` steps several requests, each with its own cache, in one pass (a server's
batched decode step).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .layers import FusedExperts, RMSNorm, SparseMoe, _joint, _rotary

__all__ = [
    "GroupedMoe",
    "LatentAttention",
    "LongRope",
    "NativeCache",
    "NativeCausalLM",
    "NativeConfig",
    "layer_windows",
    "native_runtime_reason",
    "yarn_rope",
]

_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "qwen2_moe",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "deepseek_v2",
    "deepseek_v3",
)
#: DeepSeek's latent-attention families
_MLA = ("deepseek_v2", "deepseek_v3")
#: the families whose attention normalises each query and key head (RMSNorm over ``head_dim``) before rotary
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text")
#: the families with sparse MoE blocks
_MOE = ("qwen3_moe", "qwen2_moe", "mixtral")
#: the Gemmas: RMSNorm scaled by ``1 + weight``, embeddings scaled by ``sqrt(hidden_size)``, a GELU (tanh) MLP
_GEMMAS = ("gemma", "gemma2", "gemma3_text")
#: the Gemmas with four norms a layer (before and after the attention and the MLP), ``query_pre_attn_scalar``
#: and soft-capping
_SANDWICH = ("gemma2", "gemma3_text")
#: the Gemma the native decoder does not run, and why
_LATER_GEMMAS = {"gemma3": "the multimodal model (its text model, gemma3_text, runs natively)"}
#: the activations each family's MLP may name (Gemma's legacy ``gelu`` is the tanh approximation, as transformers'
#: config reads it; Gemma 2 reads ``hidden_activation`` as it is); the native decoder runs exactly these
_ACTIVATIONS = {
    "gemma": ("gelu_pytorch_tanh", "gelu"),
    "gemma2": ("gelu_pytorch_tanh",),
    "gemma3_text": ("gelu_pytorch_tanh",),
}
#: the config key of each family's MLP activation (where not ``hidden_act``)
_ACTIVATION_KEY = {"gemma2": "hidden_activation", "gemma3_text": "hidden_activation"}
#: ``sliding_window`` where a config leaves it out (the defaults of transformers' config classes)
_DEFAULT_WINDOW = {
    "mistral": 4096,
    "qwen2": 4096,
    "qwen3": 4096,
    "qwen2_moe": 4096,
    "qwen3_moe": 4096,
    "gemma2": 4096,
    "gemma3_text": 4096,
}


def layer_windows(config: Mapping[str, Any]) -> list[int | None] | str:
    """Each layer's sliding window (``None``: full attention) as transformers' class of ``config``'s family decides
    it, or why it cannot be said. A sliding layer's query at cache position ``p`` attends the keys at positions
    ``(p - window, p]`` (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``).

    Mistral, Mixtral and Phi-3 window every layer whenever ``sliding_window`` is set (Mistral's default 4096);
    Qwen3-MoE every layer with ``use_sliding_window``; Qwen2 and Qwen3 the layers that ``layer_types`` names
    ``sliding_attention`` (by default, with ``use_sliding_window``, those from ``max_window_layers`` on), Qwen2-MoE
    likewise (by default the even layers below ``max_window_layers``); Gemma 2 its ``layer_types`` (by default every
    other layer, from the first), Gemma 3 (text) its ``layer_types`` (by default five of each six layers, by
    ``sliding_window_pattern``); Llama and Gemma none (their classes read no window)."""
    model_type = config.get("model_type")
    n = int(config["num_hidden_layers"])
    window = config.get("sliding_window", _DEFAULT_WINDOW.get(str(model_type)))
    use = bool(config.get("use_sliding_window", False))
    if model_type in ("mistral", "mixtral", "phi3"):
        sliding = [window is not None] * n
    elif model_type == "qwen3_moe":
        window = window if use else None
        sliding = [window is not None] * n
    elif model_type in ("qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3_text"):
        if model_type == "qwen2_moe":
            window = window if use else 0
        elif model_type not in ("gemma2", "gemma3_text"):
            window = window if use else None
        types = config.get("layer_types")
        if types is None:
            first = config.get("max_window_layers", 28)
            if model_type == "qwen2_moe":
                sliding = [bool((i + 1) % 2) and i < first and use for i in range(n)]
            elif model_type == "gemma2":
                sliding = [bool((i + 1) % 2) for i in range(n)]
            elif model_type == "gemma3_text":
                pattern = config.get("sliding_window_pattern", 6)
                if type(pattern) is not int or pattern < 1:
                    return f"sliding_window_pattern {pattern!r} is not a positive integer"
                sliding = [bool((i + 1) % pattern) for i in range(n)]
            else:
                sliding = [window is not None and i >= first for i in range(n)]
        elif not isinstance(types, list) or len(types) != n:
            return f"layer_types {types!r} is not one type for each of the {n} layers"
        elif not set(types) <= {"full_attention", "sliding_attention"}:
            return f"layer_types {sorted(set(types))} name a kind of layer other than full or sliding attention"
        else:
            sliding = [kind == "sliding_attention" for kind in types]
    else:
        return [None] * n  # Llama's and Gemma's classes read no window
    if any(sliding) and (type(window) is not int or window < 1):
        return f"sliding_window {window!r} is not a positive number of positions"
    return [int(window) if slides else None for slides in sliding]


def _rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("model_type") == "gemma3_text":
        return _gemma3_rope(cfg)["full_attention"]
    if cfg.get("model_type") == "phi3":  # its config class takes rope_scaling over rope_parameters where both are given
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    else:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return dict(rope) if isinstance(rope, Mapping) else {}


def _gemma3_rope(cfg: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Gemma 3's rotary parameters of its full and its sliding layers, as its config class reads them: its
    ``rope_parameters`` per layer type, or the old ``rope_theta`` (default 1e6) with ``rope_scaling`` for the full
    layers and ``rope_local_base_freq`` (default 1e4) for the sliding ones."""
    given = cfg.get("rope_parameters")
    if isinstance(given, Mapping) and ("full_attention" in given or "sliding_attention" in given):
        full, local = dict(given.get("full_attention") or {}), dict(given.get("sliding_attention") or {})
    else:
        full = dict(given) if isinstance(given, Mapping) else {}
        scaling = cfg.get("rope_scaling")
        if isinstance(scaling, Mapping):
            full.update(scaling)
        local = {}
    full.setdefault("rope_type", "default")
    local.setdefault("rope_type", "default")
    theta = cfg.get("rope_theta", 1_000_000.0)
    if isinstance(theta, Mapping):  # as transformers 5 may write it: {"global": ..., "local": ...}
        full.setdefault("rope_theta", theta.get("global", 1_000_000.0))
        local.setdefault("rope_theta", theta.get("local", cfg.get("rope_local_base_freq", 10_000.0)))
    full.setdefault("rope_theta", theta)
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    return {"full_attention": full, "sliding_attention": local}


def _rope_type(rope: Mapping[str, Any]) -> str:
    return str(rope.get("rope_type", rope.get("type", "default")))


#: Phi-3's names of LongRoPE (its config class renames the legacy ``su`` and ``yarn`` to ``longrope``)
_LONGROPE = ("longrope", "su", "yarn")


@dataclass(frozen=True)
class LongRope:
    """Phi-3's LongRoPE as transformers 5.24's ``Phi3RotaryEmbedding`` runs it (``_compute_longrope_parameters`` and
    the ``longrope`` branch of ``dynamic_rope_update``).

    - The inverse frequencies are ``1 / (factors * theta ** (arange(0, d, 2) / d))`` over the ``d`` rotary features,
      with the ``short_factor`` or the ``long_factor`` of the rotary parameters.
    - Which set: each forward, the long one when ``max(position_ids) + 1 > original_max_position_embeddings``, else the
      short one, for every position of that forward. So a prompt longer than the original context turns all its
      positions (the first ones too) by the long factors; and a generation that crosses the threshold keeps the keys
      already cached as they were turned (the short factors) while the new positions' queries and keys take the long
      ones: transformers never turns a cached key again, and neither does this.
    - transformers' class takes ``max`` over the whole batch's ``position_ids``: a padded batch with one row past the
      threshold turns the other rows by the long factors too. The native decoder chooses row by row (each row's own
      largest position), which is what each row gets from transformers' class alone: the batch's rows do not change
      each other's numbers (:meth:`NativeCausalLM.rotary`).
    - cos and sin are scaled by ``attention_factor`` (where the parameters leave it out: 1 when ``factor`` is at most
      1, else ``sqrt(1 + log(factor) / log(original_max_position_embeddings))``, ``factor`` defaulting to
      ``max_position_embeddings / original_max_position_embeddings``), in float32 before the cast to the activations'
      dtype.
    - ``original_max_position_embeddings`` is the config's own key (4096 where it leaves it out): transformers'
      ``Phi3Config`` writes it into the rotary parameters over any value they hold."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _longrope(config: Mapping[str, Any]) -> LongRope | str:
    """Phi-3's LongRoPE parameters (:class:`LongRope`) as its config class reads ``config``, or why the native decoder
    cannot run them."""
    rope = _rope(config)
    name = _rope_type(rope)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    half = int(head_dim * _partial_rotary(config)) // 2
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = rope.get(key)
        if not isinstance(value, list) or len(value) != half or not all(_number(x) for x in value):
            return f"rotary scaling {name!r}: {key} {value!r} is not a list of {half} numbers (one per rotary pair)"
        factors[key] = tuple(float(x) for x in value)
    if name != "longrope" and "original_max_position_embeddings" not in rope:
        # Phi3Config renames them after moving its original context in: the parameters lack it, and it refuses them
        return f"rotary scaling {name!r} without original_max_position_embeddings in its parameters"
    original = config.get("original_max_position_embeddings", 4096)
    if type(original) is not int or original < 2:
        return f"rotary scaling {name!r}: original_max_position_embeddings {original!r} is not an integer above 1"
    factor = rope.get("factor")
    if factor is None:
        longest = config.get("max_position_embeddings", 4096)
        if not _number(longest):
            return f"rotary scaling {name!r}: max_position_embeddings {longest!r} is not a number"
        factor = longest / original
    if not _number(factor):
        return f"rotary scaling {name!r}: factor {factor!r} is not a number"
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if not _number(attention):
        return f"rotary scaling {name!r}: attention_factor {attention!r} is not a number"
    return LongRope(factors["short_factor"], factors["long_factor"], original, float(attention))


def _partial_rotary(config: Mapping[str, Any]) -> float:
    """The fraction of each head the rotary embedding turns (``partial_rotary_factor`` where transformers reads it:
    in the rotary parameters, else the config; 1.0 when neither has it)."""
    factor = _rope(config).get("partial_rotary_factor", config.get("partial_rotary_factor"))
    return 1.0 if factor is None else float(factor)


def native_runtime_reason(config: Mapping[str, Any]) -> str | None:
    """``None`` when the native decoder can run ``config``, else why not."""
    model_type = config.get("model_type")
    if model_type in _LATER_GEMMAS:
        return f"model_type {model_type!r}: {_LATER_GEMMAS[model_type]} are not supported"
    if model_type not in _TYPES:
        return f"model_type {model_type!r} is not one of {_TYPES}"
    acts = _ACTIVATIONS.get(model_type, ("silu",))
    act_key = _ACTIVATION_KEY.get(model_type, "hidden_act")
    if config.get(act_key, acts[0]) not in acts:
        return f"{act_key} {config.get(act_key)!r} is not {' or '.join(acts)}"
    rope_type = _rope_type(_rope(config))
    allowed = {
        "phi3": ("default", *_LONGROPE),
        "gemma3_text": ("default", "linear"),
        "deepseek_v2": ("default", "yarn"),
        "deepseek_v3": ("default", "yarn"),
    }.get(model_type, ("default", "llama3"))
    if rope_type not in allowed:
        return f"rotary scaling {rope_type!r} is not supported"
    if model_type == "gemma3_text" and _rope_type(_gemma3_rope(config)["sliding_attention"]) != "default":
        return f"rotary scaling {_rope_type(_gemma3_rope(config)['sliding_attention'])!r} of the sliding layers is not supported"
    if model_type == "phi3":
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rotary = int(head_dim * _partial_rotary(config))
        if not 0 < rotary <= head_dim or rotary % 2:
            return f"partial_rotary_factor {_partial_rotary(config)} turns {rotary} of {head_dim} features: not even"
        longrope = _longrope(config) if rope_type in _LONGROPE else None
        if isinstance(longrope, str):
            return longrope
    if config.get("use_bidirectional_attention"):
        return "bidirectional attention is not supported"
    windows = layer_windows(config)
    if isinstance(windows, str):
        return windows
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        value = config.get(key) if model_type in _SANDWICH else None
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            return f"{key} {value!r} is not a positive number"
    if config.get("pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1 is not supported"
    if model_type in _MOE:
        return _moe_reason(config)
    if model_type in _MLA:
        return _deepseek_reason(config)
    return None


def _deepseek_reason(config: Mapping[str, Any]) -> str | None:
    """Why the native decoder cannot run a DeepSeek-V2 or -V3 ``config`` (``None``: it can): its latent attention's
    and router's sizes must be positive integers that fit together, and the routing transformers' class computes
    (V3: sigmoid scores, ``noaux_tc``; V2: softmax scores, ``greedy`` or ``group_limited_greedy``)."""
    v2 = config.get("model_type") == "deepseek_v2"
    method = config.get("topk_method", "greedy") if v2 else "noaux_tc"
    if v2 and method not in ("greedy", "group_limited_greedy"):
        return f"topk_method {method!r} is not 'greedy' or 'group_limited_greedy' (what transformers' DeepseekV2 class computes)"
    sizes = ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size"]
    sizes += ["num_experts_per_tok"] + (["n_group", "topk_group"] if method != "greedy" else [])
    values = {key: config.get(key) for key in sizes}
    values["n_routed_experts"] = _routed_experts(config)
    if config.get("q_lora_rank") is not None:
        values["q_lora_rank"] = config["q_lora_rank"]
    for key, value in values.items():
        if type(value) is not int or value < 1:
            return f"{key} {value!r} is not one positive integer"
    sized = cast(dict[str, int], values)
    shared, first = config.get("n_shared_experts", 0), config.get("first_k_dense_replace", 0)
    for key, value in (("n_shared_experts", shared), ("first_k_dense_replace", first)):
        if type(value) is not int or value < 0:
            return f"{key} {value!r} is not a non-negative integer"
    experts = sized["n_routed_experts"]
    if method == "greedy":
        if sized["num_experts_per_tok"] > experts:
            return "num_experts_per_tok is larger than n_routed_experts"
    else:
        groups = sized["n_group"]
        # V3 scores a group by its two best experts, V2 by its best
        if experts % groups or sized["topk_group"] > groups or experts // groups < (1 if v2 else 2):
            return f"n_group {groups} and topk_group {sized['topk_group']} do not split {experts} routed experts"
        if sized["num_experts_per_tok"] > sized["topk_group"] * (experts // groups):
            return "num_experts_per_tok is larger than the experts of the chosen groups"
    if sized["qk_rope_head_dim"] % 2:
        return f"qk_rope_head_dim {sized['qk_rope_head_dim']} is odd"
    family = "DeepseekV2" if v2 else "DeepseekV3"
    for key, want in (("scoring_func", "softmax" if v2 else "sigmoid"),) + (
        () if v2 else (("topk_method", "noaux_tc"),)
    ):
        if config.get(key, want) != want:
            return f"{key} {config.get(key)!r} is not {want!r} (what transformers' {family} class computes)"
    factor = config.get("routed_scaling_factor", 1.0)
    if not _number(factor):
        return f"routed_scaling_factor {factor!r} is not a number"
    if _rope_type(_rope(config)) == "yarn":
        rope = _rope(config)
        if not _number(rope.get("factor")) or not _number(rope.get("original_max_position_embeddings")):
            return "yarn rotary parameters without a numeric factor and original_max_position_embeddings"
    return None


def _routed_experts(config: Mapping[str, Any]) -> Any:
    """A DeepSeek config's routed expert count: ``n_routed_experts``, else the name transformers' attribute map gives
    it (V3: ``num_local_experts``, V2: ``num_experts``)."""
    alias = "num_experts" if config.get("model_type") == "deepseek_v2" else "num_local_experts"
    return config.get("n_routed_experts") or config.get(alias)


def _num_experts(config: Mapping[str, Any]) -> Any:
    """A MoE config's expert count: ``num_experts`` in Qwen's configs, ``num_local_experts`` in Mixtral's and as
    transformers 5 saves Qwen3-MoE's (its attribute map's name); ``None`` when both are there and disagree."""
    found = {config.get(k) for k in ("num_experts", "num_local_experts")} - {None}
    return found.pop() if len(found) == 1 else None


def _moe_reason(config: Mapping[str, Any]) -> str | None:
    """Why the native decoder cannot run a MoE ``config`` (Qwen3-MoE, Qwen2-MoE, Mixtral; ``None``: it can)."""
    experts = _num_experts(config)
    mixtral = config.get("model_type") == "mixtral"
    sizes: tuple[str, ...] = ("intermediate_size",) if mixtral else ("moe_intermediate_size",)
    if config.get("model_type") == "qwen2_moe":
        sizes += ("shared_expert_intermediate_size",)
    for key, value in (
        ("num_experts", experts),
        ("num_experts_per_tok", config.get("num_experts_per_tok")),
        *((size, config.get(size)) for size in sizes),
    ):
        if type(value) is not int or value < 1:
            return f"{key} {value!r} is not one positive integer"
    if config["num_experts_per_tok"] > experts:
        return "num_experts_per_tok is larger than num_experts"
    if mixtral:
        return None  # every layer sparse: no decoder_sparse_step / mlp_only_layers
    step = config.get("decoder_sparse_step", 1)
    if type(step) is not int or step < 1:
        return f"decoder_sparse_step {step!r} is not a positive integer"
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(type(i) is int for i in only):
        return f"mlp_only_layers {only!r} is not a list of layer indices"
    return None


@dataclass
class NativeConfig:
    """The config values the decoder reads (``config.json`` as is; ``to_dict`` gives it back)."""

    raw: dict[str, Any]

    def __post_init__(self) -> None:
        c = self.raw
        self.model_type: str = c["model_type"]
        self.vocab_size: int = int(c["vocab_size"])
        self.hidden_size: int = int(c["hidden_size"])
        self.intermediate_size: int = int(c["intermediate_size"])
        self.num_hidden_layers: int = int(c["num_hidden_layers"])
        self.num_attention_heads: int = int(c["num_attention_heads"])
        self.num_key_value_heads: int = int(c.get("num_key_value_heads") or self.num_attention_heads)
        self.head_dim: int = int(c.get("head_dim") or self.hidden_size // self.num_attention_heads)
        self.rms_norm_eps: float = float(c.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings: bool = bool(c.get("tie_word_embeddings", False))
        qwen2 = self.model_type in ("qwen2", "qwen2_moe")
        if self.model_type == "qwen2_moe":  # its config's own switch (True unless a config says otherwise)
            qkv_bias = bool(c.get("qkv_bias", True))
        else:
            qkv_bias = self.model_type == "qwen2" or bool(c.get("attention_bias", False))
        self.qkv_bias: bool = qkv_bias
        self.o_bias: bool = not qwen2 and bool(c.get("attention_bias", False))
        self.mlp_bias: bool = bool(c.get("mlp_bias", False))
        self.rope: dict[str, Any] = _rope(c)
        self.rope_theta: float = float(self.rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        #: Gemma 3: the sliding layers' own rotary parameters (its ``rope_local_base_freq``); else ``None``
        self.local_rope: dict[str, Any] | None = (
            _gemma3_rope(c)["sliding_attention"] if self.model_type == "gemma3_text" else None
        )
        self.qk_norm: bool = self.model_type in _QK_NORM
        #: the features of each head the rotary embedding turns (Phi-3's ``partial_rotary_factor``; else all)
        self.rotary_dim: int = int(self.head_dim * _partial_rotary(c))
        #: Phi-3's LongRoPE (:class:`LongRope`); else ``None``
        longrope = _longrope(c) if self.model_type == "phi3" and _rope_type(self.rope) in _LONGROPE else None
        self.longrope: LongRope | None = longrope if isinstance(longrope, LongRope) else None
        #: Gemma: RMSNorm scaled by ``1 + weight``, the embeddings by ``sqrt(hidden_size)``, a GELU (tanh) MLP
        self.gemma: bool = self.model_type in _GEMMAS
        #: Gemma 2: four norms a layer (before and after the attention, before and after the MLP)
        self.sandwich: bool = self.model_type in _SANDWICH
        #: the attention's scale (Gemma 2: ``query_pre_attn_scalar ** -0.5``; else ``head_dim ** -0.5``)
        scalar = c.get("query_pre_attn_scalar", 256) if self.sandwich else None
        self.scaling: float = (self.head_dim if scalar is None else scalar) ** -0.5
        #: Gemma 2's soft-capping of the attention scores, and Gemma 2's and 3's of the logits (``None``: none;
        #: transformers' Gemma 3 class keeps its ``attn_logit_softcapping`` but never applies it: nor does this)
        gemma2 = self.model_type == "gemma2"
        attn_cap = c.get("attn_logit_softcapping", 50.0) if gemma2 else None
        final_cap = c.get("final_logit_softcapping", 30.0 if gemma2 else None) if self.sandwich else None
        self.attn_logit_softcapping: float | None = None if attn_cap is None else float(attn_cap)
        self.final_logit_softcapping: float | None = None if final_cap is None else float(final_cap)
        #: each layer's sliding window (``None``: full attention), :func:`layer_windows`
        windows = layer_windows(c)
        self.windows: list[int | None] = [None] * self.num_hidden_layers if isinstance(windows, str) else windows
        #: Phi-3: one ``qkv_proj`` and one ``gate_up_proj`` linear, as transformers' modules hold them
        self.fused_projections: bool = self.model_type == "phi3"
        # MoE families: which layers hold a sparse MoE block, as transformers decides it
        mixtral = self.model_type == "mixtral"
        self.num_experts: int = int(_num_experts(c) or 0) if self.model_type in _MOE else 0
        self.num_experts_per_tok: int = int(c.get("num_experts_per_tok") or 0)
        size = c.get("intermediate_size") if mixtral else c.get("moe_intermediate_size")
        self.moe_intermediate_size: int = int(size or 0)
        # Mixtral: the top-k weights always renormalised, and kept in float32 (its router does not cast them back)
        self.norm_topk_prob: bool = mixtral or bool(c.get("norm_topk_prob", False))
        self.router_float: bool = mixtral
        self.decoder_sparse_step: int = 1 if mixtral else int(c.get("decoder_sparse_step") or 1)
        self.mlp_only_layers: list[int] = [] if mixtral else list(c.get("mlp_only_layers") or [])
        # Qwen2-MoE: a shared expert (a dense MLP of this size) in every sparse block, gated by a sigmoid
        shared = c.get("shared_expert_intermediate_size") if self.model_type == "qwen2_moe" else None
        self.shared_expert_intermediate_size: int = int(shared or 0)
        #: DeepSeek-V3: multi-head latent attention and group-limited sigmoid routing (:class:`LatentAttention`,
        #: :class:`GroupedMoe`)
        self.mla: bool = self.model_type in _MLA
        #: DeepSeek-V2: softmax routing (:class:`SoftmaxRouter`), its rotary embedding as complex products of
        #: interleaved pairs
        self.deepseek_v2: bool = self.model_type == "deepseek_v2"
        self.first_k_dense_replace = 0
        if self.mla:
            self._deepseek(c)

    def _deepseek(self, c: dict[str, Any]) -> None:
        """DeepSeek-V2's and -V3's sizes: the query and key heads ``qk_nope_head_dim + qk_rope_head_dim`` wide (the rotary
        embedding turns the last ``qk_rope_head_dim``), the value heads ``v_head_dim``; the attention's scale
        ``head_dim ** -0.5`` times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN (transformers'
        ``yarn_apply_mscale``); a MoE block from layer ``first_k_dense_replace`` on."""
        q_lora = c.get("q_lora_rank")
        self.q_lora_rank: int | None = None if q_lora is None else int(q_lora)
        self.kv_lora_rank = int(c["kv_lora_rank"])
        self.qk_nope_head_dim, self.qk_rope_head_dim = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"])
        self.v_head_dim = int(c["v_head_dim"])
        self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.num_key_value_heads = self.num_attention_heads  # the latent expands to every head
        self.rotary_dim = self.qk_rope_head_dim
        self.rope_interleave = bool(c.get("rope_interleave", True))  # V3's switch; V2's pairs are always interleaved
        self.attention_bias = bool(c.get("attention_bias", False))
        self.scaling = self.head_dim**-0.5
        if _rope_type(self.rope) != "default" and self.rope.get("mscale_all_dim"):
            scale = _yarn_mscale(float(self.rope["factor"]), float(self.rope["mscale_all_dim"]))
            self.scaling = self.scaling * scale * scale
        v2 = self.deepseek_v2
        self.num_experts = int(_routed_experts(c))
        self.moe_intermediate_size = int(c["moe_intermediate_size"])
        self.n_shared_experts = int(c.get("n_shared_experts", 2 if v2 else 0))
        #: V2's ``topk_method`` (``greedy`` or ``group_limited_greedy``); V3's is ``noaux_tc``
        self.topk_method = str(c.get("topk_method", "greedy")) if v2 else "noaux_tc"
        grouped = self.topk_method != "greedy"
        self.n_group = int(c["n_group"]) if grouped else 1
        self.topk_group = int(c["topk_group"]) if grouped else 1
        self.routed_scaling_factor = float(c.get("routed_scaling_factor", 1.0))
        self.norm_topk_prob = bool(c.get("norm_topk_prob", True)) and not v2  # V2's router never renormalises
        self.first_k_dense_replace = int(c.get("first_k_dense_replace", 0))

    def sparse(self, index: int) -> bool:
        """Whether layer ``index`` has a MoE block (Qwen3-MoE's rule; DeepSeek's: from ``first_k_dense_replace`` on)
        rather than a dense MLP."""
        if self.mla:
            return index >= self.first_k_dense_replace
        return (
            self.num_experts > 0 and index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)


def rope_inv_freq(config: NativeConfig, rope: Mapping[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies as transformers computes them (default, linear scaling, Llama 3's
    frequency-dependent scaling, or Phi-3's LongRoPE short factors: :func:`longrope_inv_freq`), for the ``rotary_dim``
    features of a head that turn. ``rope``: other rotary parameters than the config's (Gemma 3's sliding layers':
    :attr:`NativeConfig.local_rope`)."""
    dim = config.rotary_dim
    rope = config.rope if rope is None else rope
    theta = config.rope_theta if rope is config.rope else float(rope["rope_theta"])
    if rope is config.rope and config.longrope is not None:
        return longrope_inv_freq(config, config.longrope.short_factor)
    if _rope_type(rope) == "yarn":
        return yarn_rope(config)[0]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if _rope_type(rope) == "linear":
        inv /= float(rope["factor"])
        return inv
    if _rope_type(rope) != "llama3":
        return inv
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_rope(config: NativeConfig) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and the factor cos and sin are scaled by, in transformers' order of ops
    (``_compute_yarn_parameters``): each frequency blended between ``theta ** -(i / d)`` and that over ``factor`` by
    a linear ramp over the correction range of ``beta_fast``/``beta_slow`` (32, 1) rotations in
    ``original_max_position_embeddings`` (the range's ends floored and ceiled unless ``truncate`` is false); the
    factor ``attention_factor``, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` where both are
    given, else ``mscale(factor)``, with ``mscale(s, m) = 0.1 * m * ln(s) + 1`` (1 for ``s <= 1``)."""
    rope, dim, base = config.rope, config.rotary_dim, config.rope_theta
    factor = float(rope["factor"])
    old = float(rope["original_max_position_embeddings"])
    attention = rope.get("attention_factor")
    if attention is None:
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
        else:
            attention = _yarn_mscale(factor)
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction(fast), correction(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers': no division by zero
    # on the CPU, as rope_inv_freq's: a real tensor also while the skeleton is built on the meta device
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv, float(attention)


def longrope_inv_freq(config: NativeConfig, factors: tuple[float, ...]) -> torch.Tensor:
    """Phi-3's LongRoPE inverse frequencies for ``factors`` (its short or long ones), in transformers' order of ops
    (``_compute_longrope_parameters``): ``1 / (factors * theta ** (arange(0, d, 2) / d))``."""
    dim = config.rotary_dim
    ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (ext * config.rope_theta**shape)


class NativeCache:
    """Per layer, the keys and values seen so far ``[batch, kv_heads, tokens, head_dim]``.

    Stored in buffers with spare room, so a decode step writes one position instead of concatenating the
    whole history. With ``capacity`` (the positions the caller will use: prompt plus new tokens) the first
    buffer holds all of them and is never copied; without it a full buffer is doubled.

    ``dtype``: what the buffers hold (``None``: the activations' dtype, as written). A narrower one (the
    ``cpu-fast`` backend's float16, :data:`anyquant_cpu.engine.KV_CACHE_DTYPES`) halves the cache: keys and values are rounded to
    it when written, and :meth:`update` gives attention the positions of earlier forwards read back in the
    activations' dtype followed by this forward's own exact ones (so a prompt of one prefill chunk attends
    exactly as with a float32 cache; the compiled decode step does the same).

    ``windows``: each layer's sliding window (:func:`layer_windows`; ``None``: none). The cache keeps every
    position of a sliding layer too (so it crops and copies as any other), but :meth:`update` gives attention only
    the positions a query of that forward may see: the last ``window`` for one new token (so that attention
    over what it returns, with no mask, is the sliding window's, as transformers' sliding cache layer returns it),
    the last ``new + window - 1`` for more."""

    def __init__(
        self,
        layers: int,
        capacity: int | None = None,
        dtype: torch.dtype | None = None,
        windows: list[int | None] | None = None,
    ) -> None:
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.lengths = [0] * layers
        self.capacity = capacity
        self.dtype = dtype
        self.windows: list[int | None] = list(windows) if windows is not None else [None] * layers

    def get_seq_length(self, layer: int = 0) -> int:
        return self.lengths[layer]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer (the buffers stay: the next forward writes from
        position ``length`` on, over what was there)."""
        if length < 0:
            raise ValueError(f"crop({length}): expected a length >= 0")
        self.lengths = [min(n, length) for n in self.lengths]

    def copy(self, length: int | None = None) -> NativeCache:
        """A cache of its own holding this one's first ``length`` positions of every layer (default: all it holds),
        in buffers of exactly that size and this cache's ``dtype`` (the values as stored: a narrower ``dtype``'s
        rounding included). The copy grows as any cache does when written past them."""
        layers = len(self.lengths)
        out = NativeCache(layers, None, self.dtype, self.windows)
        for i in range(layers):
            kb, vb = self.keys[i], self.values[i]
            n = self.lengths[i] if length is None else min(self.lengths[i], length)
            if kb is None or vb is None or n == 0:
                continue
            out.keys[i] = kb.narrow(2, 0, n).clone()
            out.values[i] = vb.narrow(2, 0, n).clone()
            out.lengths[i] = n
        return out

    def nbytes(self) -> int:
        """Bytes of the buffers held (their spare room included)."""
        return sum(int(b.nbytes) for b in (*self.keys, *self.values) if b is not None)

    def reserve(
        self,
        layer: int,
        end: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        like: torch.Tensor,
        value_dim: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s key and value buffers with room for ``end`` positions (grown, keeping what they hold,
        when short; new ones take the cache's ``dtype`` (else ``like``'s) and ``like``'s device). ``value_dim``: the
        value heads' width where it is not the keys' (DeepSeek's latent attention)."""
        kb, vb = self.keys[layer], self.values[layer]
        if kb is None or vb is None or kb.shape[2] < end:
            start = self.lengths[layer]
            held = kb.shape[2] if kb is not None else 0
            room = max(end, self.capacity) if self.capacity is not None and held == 0 else max(end, 2 * held, 64)
            dtype = self.dtype or like.dtype
            grown_k = like.new_empty((batch, kv_heads, room, head_dim), dtype=dtype)
            grown_v = like.new_empty((batch, kv_heads, room, value_dim or head_dim), dtype=dtype)
            if kb is not None and vb is not None and start:
                grown_k[:, :, :start] = kb[:, :, :start]
                grown_v[:, :, :start] = vb[:, :, :start]
            kb, vb = self.keys[layer], self.values[layer] = grown_k, grown_v
        return kb, vb

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, new = self.lengths[layer], k.shape[2]
        end = start + new
        kb, vb = self.reserve(layer, end, k.shape[0], k.shape[1], k.shape[3], k, v.shape[3])
        kb.narrow(2, start, new).copy_(k)  # narrow: cheaper per call than slice assignment
        vb.narrow(2, start, new).copy_(v)
        self.lengths[layer] = end
        window = self.windows[layer] if layer < len(self.windows) else None
        # a sliding layer: from the first position this forward's first query sees
        first = 0 if window is None else max(0, start - window + 1)
        if kb.dtype == k.dtype:
            return kb.narrow(2, first, end - first), vb.narrow(2, first, end - first)
        if start == first:
            return k, v
        # the earlier positions read back in k's dtype (one converted copy), this forward's exact
        return (
            torch.cat([kb.narrow(2, first, start - first).to(k.dtype), k], 2),
            torch.cat([vb.narrow(2, first, start - first).to(v.dtype), v], 2),
        )


@dataclass
class NativeOutput:
    logits: torch.Tensor
    cache: NativeCache | None = None

    @property
    def past_key_values(self) -> NativeCache | None:
        return self.cache


class Attention(nn.Module):
    #: a decode step's attention (one new position per row, no padding mask) by the compiled kernel's
    #: ``anyquant::decode_attention``, which also writes the new keys and values into the cache: set by cpu-fast
    #: where the kernel is loaded (:func:`anyquant_cpu.engine.kernel_attention`); the compiled decode step does the
    #: same, so a row's numbers are the same on either path and whatever other rows share the step
    decode_kernel = False

    def __init__(self, c: NativeConfig, index: int) -> None:
        super().__init__()
        self.index, self.heads, self.kv_heads, self.head_dim = (
            index,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.scaling = c.scaling
        self.rotary_dim = c.rotary_dim
        #: this layer's sliding window (``None``: full attention); Gemma 2's soft-capping of the scores
        self.window: int | None = c.windows[index]
        self.softcap: float | None = c.attn_logit_softcapping
        #: transformers' eager attention (Gemma 2's class has no other): the scores, soft-capped, the softmax in
        #: float32
        self.eager = c.model_type == "gemma2"
        #: attention as a caller of :meth:`project` computes it by itself (plain SDPA, the Llama layer around it)
        self.plain = not c.sandwich
        #: Gemma 3: which half of the rotary tables this layer turns by (0: the full layers', 1: the sliding
        #: layers', :meth:`NativeCausalLM.rotary`); ``None``: the tables are one
        self.rope_part: int | None = None if c.local_rope is None else int(self.window is not None)
        # nn.Module, not nn.Linear: loaders swap in their quantized linears
        self.q_proj: nn.Module = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj: nn.Module = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj: nn.Module = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj: nn.Module = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        # Qwen3: RMSNorm over each query and key head before the rotary embedding
        self.q_norm: nn.Module | None = _norm(c, c.head_dim) if c.qk_norm else None
        self.k_norm: nn.Module | None = _norm(c, c.head_dim) if c.qk_norm else None
        #: a format's quantization of the keys and values as its cache holds them (after the rotary embedding, before
        #: the cache: compressed-tensors' ``kv_cache_scheme``): ``(k, v) -> (k, v)``; the compiled step skips such layers
        self.kv_quant: nn.Module | None = None

    def qkv(self, h: torch.Tensor) -> list[torch.Tensor]:
        """The query, key and value projections of ``h`` ``[b, t, hidden]``."""
        return _joint(self, ("q_proj", "k_proj", "v_proj"), h)

    def project(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``[b, heads, t, head_dim]`` of ``h``: projected, the query and key heads
        normalised (Qwen3), rotated, the keys and values quantized as the cache holds them (``kv_quant``).
        ``sin``: with the sign of its first half flipped (see :func:`_rotary`).

        For a caller that attends by itself (plain ``scaled_dot_product_attention`` over what the cache's ``update``
        gives): refused where that is not this layer's attention (Gemma 2's eager, soft-capped scores), which
        :meth:`attend` and :meth:`NativeCausalLM.decode_rows` compute."""
        if not self.plain:
            raise NotImplementedError(
                "this layer is not attention by plain scaled_dot_product_attention in a Llama layer (Gemma 2 and 3: "
                "soft-capped scores, four norms a layer, two rotary tables): step rows with NativeCausalLM.decode_rows"
            )
        return self._project(h, cos, sin)

    def _project(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = h.shape
        q, k, v = self.qkv(h)
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.rope_part is not None:  # this layer's half of the tables
            d = cos.shape[-1] // 2
            first = self.rope_part * d
            cos, sin = cos[..., first : first + d], sin[..., first : first + d]
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = self.rotate(q, cos, sin)
        k = self.rotate(k, cos, sin)
        if self.kv_quant is not None:
            k, v = self.kv_quant(k, v)
        return q, k, v

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary embedding of ``x``'s first ``rotary_dim`` features, the rest passed through (Phi-3's partial
        rotary: transformers' ``torch.cat([rotated, x_pass], -1)``)."""
        if self.rotary_dim == self.head_dim:
            return _rotary(x, cos, sin)
        d = self.rotary_dim
        return torch.cat([_rotary(x[..., :d], cos, sin), x[..., d:]], dim=-1)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: NativeCache | None,
    ) -> torch.Tensor:
        """``sin``: with the sign of its first half flipped (see :func:`_rotary`)."""
        b, t, _ = h.shape
        q, k, v = self._project(h, cos, sin)
        if t == 1 and mask is None and isinstance(cache, NativeCache) and self.kernel_decodes(q):
            return self.o_proj(self.decode(q, k, v, [cache]).view(b, 1, -1))  # type: ignore[no-any-return]
        if cache is not None:
            k, v = cache.update(self.index, k, v)
        y: torch.Tensor = self.o_proj(self.attend(q, k, v, mask).transpose(1, 2).reshape(b, t, -1))
        return y

    def kernel_decodes(self, q: torch.Tensor) -> bool:
        """Whether a decode step's queries ``q`` attend by :meth:`decode` (the kernel marked, float32 on the CPU,
        no soft-capping)."""
        return self.decode_kernel and not self.eager and q.dtype == torch.float32 and q.device.type == "cpu"

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[NativeCache]) -> torch.Tensor:
        """One new position per row (``q`` ``[rows, heads, 1, head_dim]``, ``k``/``v`` its keys and values), the rows
        taken by ``caches`` in order (each cache its batch's rows): the keys and values written at each cache's next
        position and the attention over its positions (a sliding layer's window), ``[rows, heads, v_head_dim]``,
        by one ``anyquant::decode_attention`` call."""
        keys, values, starts = [], [], []
        index, kv_heads, dk, dv = self.index, k.shape[1], k.shape[-1], v.shape[-1]
        for cache in caches:
            start, held = cache.lengths[index], cache.keys[index]
            rows = held.shape[0] if held is not None else k.shape[0] // len(caches)
            kb, vb = cache.reserve(index, start + 1, rows, kv_heads, dk, k, dv)
            keys.append(kb)
            values.append(vb)
            starts.append(start)
        out: torch.Tensor = torch.ops.anyquant.decode_attention(
            q.squeeze(2), k.squeeze(2), v.squeeze(2), keys, values, starts, self.window or 0, self.scaling
        )
        for cache, start in zip(caches, starts, strict=True):
            cache.lengths[index] = start + 1
        return out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention ``[b, heads, t, head_dim]`` of the queries ``q`` (the last ``t`` positions) over the keys and
        values ``k``, ``v`` of the positions up to theirs (all of them, or the last ones: as :meth:`NativeCache.update`
        gives a sliding layer's). ``mask``: boolean ``[b, 1, t, positions]`` over every position so far (True:
        attend; its last columns are ``k``'s), or ``None``: causal. A sliding layer attends only its window."""
        t, n = q.shape[2], k.shape[2]
        if mask is not None and mask.shape[-1] != n:
            mask = mask[..., -n:]
        window = self.window
        if window is not None:
            keep = t + window - 1  # the positions that the first query's window starts with, and on
            if n > keep:
                k, v, n = k[:, :, -keep:], v[:, :, -keep:], keep
                mask = None if mask is None else mask[..., -keep:]
            if t > 1 and n > window:  # a query that would see past its window: mask those keys
                query = torch.arange(n - t, n, device=q.device)[:, None]
                key = torch.arange(n, device=q.device)[None, :]
                inside = key > query - window
                mask = (inside & (key <= query))[None, None] if mask is None else mask & inside
        if self.eager:
            return self._eager(q, k, v, mask)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            scale=self.scaling,
            is_causal=mask is None and t > 1,
            enable_gqa=self.kv_heads != self.heads,
        )

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """transformers' ``eager_attention_forward`` (Gemma 2's): the repeated key/value heads, the scaled scores
        soft-capped (``tanh(x / cap) * cap``), the boolean mask as transformers' additive one (0, or the dtype's
        least value), the softmax in float32 back to the queries' dtype."""
        t, n = q.shape[2], k.shape[2]
        groups = self.heads // self.kv_heads
        if groups > 1:
            b, kv, _, d = k.shape
            k = k[:, :, None].expand(b, kv, groups, n, d).reshape(b, kv * groups, n, d)
            v = v[:, :, None].expand(b, kv, groups, n, d).reshape(b, kv * groups, n, d)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if self.softcap is not None:
            scores = scores / self.softcap
            scores = torch.tanh(scores)
            scores = scores * self.softcap
        if mask is None and t > 1:
            query = torch.arange(n - t, n, device=q.device)[:, None]
            mask = (torch.arange(n, device=q.device)[None, :] <= query)[None, None]
        if mask is not None:
            zero = torch.zeros((), device=q.device, dtype=scores.dtype)
            scores = scores + torch.where(mask, zero, torch.finfo(scores.dtype).min)
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v)


class FusedAttention(Attention):
    """Phi-3's attention: one ``qkv_proj`` linear (query rows, then key rows, then value rows), as transformers'
    module holds it."""

    def __init__(self, c: NativeConfig, index: int) -> None:
        super().__init__(c, index)
        del self.q_proj, self.k_proj, self.v_proj
        size = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        self.qkv_proj: nn.Module = nn.Linear(c.hidden_size, size, bias=False)
        self.q_size, self.kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

    def qkv(self, h: torch.Tensor) -> list[torch.Tensor]:
        qkv = self.qkv_proj(h)
        q, kv = self.q_size, self.kv_size
        return [qkv[..., :q], qkv[..., q : q + kv], qkv[..., q + kv :]]


class LatentAttention(Attention):
    """DeepSeek-V2's and -V3's multi-head latent attention (MLA), transformers' ``DeepseekV2Attention`` /
    ``DeepseekV3Attention`` arithmetic.

    The queries from ``q_proj`` (or ``q_b_proj(q_a_layernorm(q_a_proj(h)))`` with a ``q_lora_rank``); one
    ``kv_a_proj_with_mqa`` gives the latent (``kv_lora_rank`` features, normalised by ``kv_a_layernorm``) and one
    rotary key shared by every head (``qk_rope_head_dim``); ``kv_b_proj`` expands the latent to each head's
    non-rotary key and its value. The rotary embedding turns the last ``qk_rope_head_dim`` features of the queries
    and that shared key: with V3's ``rope_interleave`` (the default) as pairs ``(x0, x1), (x2, x3) ...``, their results
    written as transformers writes them (the pairs' first members, then their second: the same for queries and keys,
    so the scores are unchanged); V2's pairs as complex numbers, left in place (:meth:`rotate`). The cache holds each head's expanded keys and values (``v_head_dim`` wide), so a
    decode step expands only its new position (transformers' class caches the latent and expands every cached
    position again at every step). No ``kv_quant``: a quantized KV-cache scheme is refused for these layers by the
    loaders that apply one."""

    def __init__(self, c: NativeConfig, index: int) -> None:
        nn.Module.__init__(self)
        self.index, self.heads, self.kv_heads, self.head_dim = (
            index,
            c.num_attention_heads,
            c.num_attention_heads,
            c.head_dim,
        )
        self.nope, self.rotary_dim, self.v_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank, self.interleave = c.kv_lora_rank, c.rope_interleave
        #: DeepSeek-V2: its pairs turned as complex numbers (the table a complex ``cos``), left interleaved
        self.complex_pairs = c.deepseek_v2
        self.scaling = c.scaling
        self.window, self.softcap, self.eager, self.plain, self.rope_part = None, None, False, True, None
        heads, bias = c.num_attention_heads, c.attention_bias
        if c.q_lora_rank is None:
            self.q_proj: nn.Module = nn.Linear(c.hidden_size, heads * c.head_dim, bias=False)
        else:
            self.q_a_proj: nn.Module = nn.Linear(c.hidden_size, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)  # transformers' default eps, not rms_norm_eps
            self.q_b_proj: nn.Module = nn.Linear(c.q_lora_rank, heads * c.head_dim, bias=False)
        self.kv_a_proj_with_mqa: nn.Module = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj: nn.Module = nn.Linear(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj: nn.Module = nn.Linear(heads * c.v_head_dim, c.hidden_size, bias=bias)

    def _project(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = h.shape
        if "q_proj" in self._modules:
            q = self.q_proj(h)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.nope, self.rotary_dim], dim=-1)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(h), [self.kv_lora_rank, self.rotary_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rot = self.rotate(k_rot.view(b, 1, t, self.rotary_dim), cos, sin)
        q = torch.cat((q_pass, self.rotate(q_rot, cos, sin)), dim=-1)
        kv = self.kv_b_proj(latent).view(b, t, self.heads, self.nope + self.v_head_dim).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.nope, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(b, self.heads, t, self.rotary_dim)), dim=-1)
        return q, k, v

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary embedding of ``x`` (all its features: the rotary part of a head); interleaved pairs taken
        apart first (``cat(x[0::2], x[1::2])``, then ``rotate_half``'s arithmetic: bitwise transformers'
        ``apply_rotary_pos_emb_interleave``). DeepSeek-V2: each pair a complex number times ``cos``, the complex
        table :meth:`NativeCausalLM.rotary` gives it, the result's pairs in place (transformers' ``apply_rotary_emb``)."""
        if self.complex_pairs:
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * cos).flatten(-2).type_as(x)
        if self.interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return _rotary(x, cos, sin)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh`` (Gemma's activation)."""
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    def __init__(self, c: NativeConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = c.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj: nn.Module = nn.Linear(c.hidden_size, size, bias=c.mlp_bias)
        self.up_proj: nn.Module = nn.Linear(c.hidden_size, size, bias=c.mlp_bias)
        self.down_proj: nn.Module = nn.Linear(size, c.hidden_size, bias=c.mlp_bias)
        #: SiLU, or Gemma's GELU (tanh); the compiled decode step runs SiLU MLPs only
        self.act_fn = _gelu_tanh if c.gemma else F.silu

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = _joint(self, ("gate_proj", "up_proj"), h)
        y: torch.Tensor = self.down_proj(self.act_fn(gate) * up)
        return y


class FusedMLP(nn.Module):
    """Phi-3's MLP: one ``gate_up_proj`` (gate rows, then up rows) and ``down_proj``, transformers' order of ops."""

    def __init__(self, c: NativeConfig) -> None:
        super().__init__()
        self.gate_up_proj: nn.Module = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj: nn.Module = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        y: torch.Tensor = self.down_proj(up * F.silu(gate))
        return y


class SharedExpertMoe(SparseMoe):
    """Qwen2-MoE's sparse block: :class:`~anyquant_runtime.layers.SparseMoe`'s routed experts plus a shared expert
    (a dense MLP) on every token, gated by ``sigmoid(shared_expert_gate(x))`` (transformers' order of ops)."""

    def __init__(self, c: NativeConfig) -> None:
        super().__init__(c.num_experts, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok, c.norm_topk_prob)
        self.shared_expert = MLP(c, c.shared_expert_intermediate_size)
        self.shared_expert_gate: nn.Module = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])
        shared = self.shared_expert(x)
        weights, index = self.gate(x)
        routed = self.experts(x, index, weights)
        shared = F.sigmoid(self.shared_expert_gate(x)) * shared
        out: torch.Tensor = (routed + shared).view(h.shape)
        return out


class GroupedRouter(nn.Module):
    """DeepSeek-V3's router (``DeepseekV3TopkRouter``): ``weight`` ``[experts, hidden]`` and the expert bias
    ``e_score_correction_bias`` used only to choose, both read in float32."""

    def __init__(self, c: NativeConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size))
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.zeros(c.num_experts))
        self.top_k, self.n_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = c.norm_topk_prob, c.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(top_k_weights, top_k_index)`` of rows ``x`` ``[T, hidden]``, transformers' arithmetic: sigmoid scores
        in float32; each group scored by its two best biased scores; the ``topk_group`` best groups' experts the only
        candidates; the ``top_k`` best biased candidates chosen, weighted by their unbiased scores (renormalised
        when ``norm_topk_prob``, plus 1e-20), times ``routed_scaling_factor``; the weights stay float32."""
        experts = self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        per_group = experts // self.n_group
        groups = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        chosen = torch.topk(groups, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(groups).scatter_(1, chosen, 1)
        mask = mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, experts)
        choice = choice.masked_fill(~mask.bool(), float("-inf"))
        index = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * self.routed_scaling_factor, index


class SoftmaxRouter(nn.Module):
    """DeepSeek-V2's router (``DeepseekV2TopkRouter``): ``weight`` ``[experts, hidden]`` read in float32."""

    def __init__(self, c: NativeConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size))
        self.top_k, self.n_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.greedy, self.routed_scaling_factor = c.topk_method == "greedy", c.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(top_k_weights, top_k_index)`` of rows ``x`` ``[T, hidden]``, transformers' arithmetic: the softmax of
        the float32 logits; ``greedy``: the ``top_k`` best; ``group_limited_greedy``: each group scored by its best,
        the ``topk_group`` best groups' experts the only candidates (the others' scores 0); the chosen scores, not
        renormalised, times ``routed_scaling_factor``, in float32."""
        experts = self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).softmax(dim=-1, dtype=torch.float32)
        if not self.greedy:
            per_group = experts // self.n_group
            groups = scores.view(-1, self.n_group, per_group).max(dim=-1).values
            chosen = torch.topk(groups, k=self.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(groups).scatter_(1, chosen, 1)
            mask = mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, experts)
            scores = scores.masked_fill(~mask.bool(), 0.0)
        weights, index = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.routed_scaling_factor, index


class GroupedMoe(nn.Module):
    """DeepSeek-V2's and -V3's MoE block: :class:`SoftmaxRouter`'s or :class:`GroupedRouter`'s experts (``experts``, one linear each once loaded) plus
    ``shared_experts``, a dense MLP of ``n_shared_experts * moe_intermediate_size`` on every token, added after."""

    def __init__(self, c: NativeConfig) -> None:
        super().__init__()
        self.gate: nn.Module = SoftmaxRouter(c) if c.deepseek_v2 else GroupedRouter(c)
        self.experts: nn.Module = FusedExperts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.shared_experts = MLP(c, c.moe_intermediate_size * c.n_shared_experts) if c.n_shared_experts else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])
        weights, index = self.gate(x)
        out: torch.Tensor = self.experts(x, index, weights).view(h.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        return out


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: in float32, scaled by ``1 + weight`` (its weights are stored as offsets from 1), then back to
    the input's dtype (transformers' order: the product before the cast)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def _norm(c: NativeConfig, size: int) -> nn.Module:
    return GemmaRMSNorm(size, c.rms_norm_eps) if c.gemma else RMSNorm(size, c.rms_norm_eps)


def _mlp(c: NativeConfig, index: int) -> nn.Module:
    if c.mla:
        return GroupedMoe(c) if c.sparse(index) else MLP(c)
    if c.sparse(index):
        if c.shared_expert_intermediate_size:
            return SharedExpertMoe(c)
        moe = SparseMoe(c.num_experts, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok, c.norm_topk_prob)
        moe.gate.keep_float = c.router_float
        return moe
    return FusedMLP(c) if c.fused_projections else MLP(c)


class DecoderLayer(nn.Module):
    def __init__(self, c: NativeConfig, index: int) -> None:
        super().__init__()
        kind = LatentAttention if c.mla else FusedAttention if c.fused_projections else Attention
        self.self_attn: Attention = kind(c, index)
        self.mlp: nn.Module = _mlp(c, index)
        self.input_layernorm = _norm(c, c.hidden_size)
        self.post_attention_layernorm = _norm(c, c.hidden_size)
        #: Gemma 2: the attention's output normalised (``post_attention_layernorm``) before the residual sum, and
        #: the MLP's input and output by these two
        self.sandwich = c.sandwich
        if c.sandwich:
            self.pre_feedforward_layernorm = _norm(c, c.hidden_size)
            self.post_feedforward_layernorm = _norm(c, c.hidden_size)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: NativeCache | None,
    ) -> torch.Tensor:
        return self.finish(h, self.self_attn(self.input_layernorm(h), cos, sin, mask, cache))

    def finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the layer once its attention (``o_proj`` included) gave ``attended``: the residual sums and
        the MLP or MoE block, with their norms."""
        if self.sandwich:
            h = h + self.post_attention_layernorm(attended)
            out: torch.Tensor = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
            return out
        h = h + attended
        out = h + self.mlp(self.post_attention_layernorm(h))
        return out

    def rows(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[NativeCache]) -> torch.Tensor:
        """The layer for one new token in each row of ``h`` ``[rows, 1, hidden]``, row ``i`` attending over its own
        ``caches[i]`` (no padding, no mask): the projections, norms and MLP of all rows in one pass, the attention
        one :meth:`Attention.decode` call (``decode_kernel``) or torch's row by row."""
        attn = self.self_attn
        q, k, v = attn._project(self.input_layernorm(h), cos, sin)
        if attn.kernel_decodes(q):
            return self.finish(h, attn.o_proj(attn.decode(q, k, v, caches).view(h.shape[0], 1, -1)))
        out = []
        for i, cache in enumerate(caches):
            keys, values = cache.update(attn.index, k[i : i + 1], v[i : i + 1])
            out.append(attn.attend(q[i : i + 1], keys, values, None))
        attended = attn.o_proj(torch.cat(out).transpose(1, 2).reshape(h.shape[0], 1, -1))
        return self.finish(h, attended)


class Decoder(nn.Module):
    def __init__(self, c: NativeConfig) -> None:
        super().__init__()
        # ``_weight``: no random initialisation (the loader fills the table; on the meta device ``normal_``
        # would import torch._dynamo, ~1 s)
        self.embed_tokens: nn.Module = nn.Embedding(
            c.vocab_size, c.hidden_size, _weight=torch.empty(c.vocab_size, c.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = _norm(c, c.hidden_size)


class NativeCausalLM(nn.Module):
    """A Llama-family causal LM with transformers' names and call convention (``cache=`` / ``past_key_values=``,
    ``attention_mask``, ``position_ids``; returns ``.logits`` and ``.cache``)."""

    runtime_name = "native"
    #: what the KV caches this model makes hold (:class:`NativeCache`'s ``dtype``; ``None``: the activations'
    #: dtype). The loaders set it on ``cpu-fast`` (load option ``cpu_fast_kv_cache``); the exact backends keep
    #: ``None``
    kv_cache_dtype: torch.dtype | None = None

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        reason = native_runtime_reason(config)
        if reason is not None:
            raise ValueError(f"the native decoder cannot run this model: {reason}")
        self.config = NativeConfig(dict(config))
        self.model = Decoder(self.config)
        self.lm_head: nn.Module = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(self.config), persistent=False)
        #: what cos and sin are scaled by (YaRN's attention factor; else 1)
        self.rope_scale = yarn_rope(self.config)[1] if _rope_type(self.config.rope) == "yarn" else 1.0
        #: Gemma 3: the sliding layers' inverse frequencies (their own rotary base); else ``None``
        self.local_inv_freq: torch.Tensor | None
        local = self.config.local_rope
        self.register_buffer(
            "local_inv_freq", None if local is None else rope_inv_freq(self.config, local), persistent=False
        )
        #: Phi-3's LongRoPE: the long factors' inverse frequencies (``inv_freq`` holds the short ones); else ``None``
        self.long_inv_freq: torch.Tensor | None
        longrope = self.config.longrope
        self.register_buffer(
            "long_inv_freq",
            None if longrope is None else longrope_inv_freq(self.config, longrope.long_factor),
            persistent=False,
        )

    # transformers' accessors, used by the loader (head tying) and the cpu-fast head
    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.model.embed_tokens = module

    def set_output_embeddings(self, module: nn.Module) -> None:
        self.lm_head = module

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids`` (Gemma's scaled by ``sqrt(hidden_size)`` in their own dtype, as
        transformers' scaled embedding computes it)."""
        h: torch.Tensor = self.model.embed_tokens(input_ids)
        if self.config.gemma:
            h = h * torch.tensor(self.config.hidden_size**0.5).to(h.dtype)
        return h

    def rotary(
        self, position_ids: torch.Tensor, h: torch.Tensor, horizon: torch.Tensor | int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[b, 1, t, rotary_dim]`` of ``position_ids`` in ``h``'s dtype, ``sin`` with the sign of its
        first half flipped (see :func:`~anyquant_runtime.layers._rotary`). Gemma 3: ``[b, 1, t, 2 * rotary_dim]``,
        the full layers' tables then the sliding layers' (each layer takes its half: ``Attention.rope_part``).

        Phi-3's LongRoPE (:class:`LongRope`): each row of ``position_ids`` by the long factors when its largest position
        is at or past ``original_max_position_embeddings``, else by the short ones (transformers' rule, taken row by
        row: what each row gets from transformers' class alone), cos and sin scaled by ``attention_factor``.
        ``horizon``: each row's length once this forward's sequence is in (``[b]``, or one number), for a prompt
        prefilled in several forwards: the choice is then the one a single forward over the whole prompt makes
        (:meth:`rope_regime`), for every chunk."""
        inv_freq, scale = self.inv_freq, self.rope_scale
        if self.config.deepseek_v2:  # the complex table, as transformers' DeepseekV2RotaryEmbedding makes it
            freqs = position_ids[..., None].float() * inv_freq.to(device=h.device, dtype=torch.float)
            table = (torch.polar(torch.ones_like(freqs), freqs) * scale)[:, None]
            return table, table
        longrope, long_inv_freq = self.config.longrope, self.long_inv_freq
        if longrope is not None and long_inv_freq is not None and position_ids.numel():
            scale = longrope.attention_factor
            reach = position_ids.amax(-1) + 1  # [b]
            if horizon is not None:
                reach = torch.maximum(reach, torch.as_tensor(horizon, device=reach.device))
            past = reach > longrope.original_max_position_embeddings
            inv_freq = torch.where(past.to(h.device)[:, None, None], long_inv_freq.to(h.device), inv_freq.to(h.device))
        cos, sin = self._tables(position_ids, inv_freq, h, scale)
        if self.local_inv_freq is not None:
            local_cos, local_sin = self._tables(position_ids, self.local_inv_freq, h)
            cos, sin = torch.cat((cos, local_cos), dim=-1), torch.cat((sin, local_sin), dim=-1)
        return cos, sin

    @staticmethod
    def _tables(
        position_ids: torch.Tensor, inv_freq: torch.Tensor, h: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``inv_freq``: ``[rotary_dim / 2]``, or ``[b, 1, rotary_dim / 2]`` (a row's own, LongRoPE's); ``scale``: cos
        and sin multiplied by it in float32 (LongRoPE's ``attention_factor``; transformers' order: before the cast)."""
        freqs = position_ids[..., None].float() * inv_freq.to(h.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos()
        half_sin = freqs.sin()
        if scale != 1.0:
            cos, half_sin = cos * scale, half_sin * scale
        sin = torch.cat((-half_sin, half_sin), dim=-1).to(h.dtype)[:, None]  # signed for _rotary
        return cos.to(h.dtype)[:, None], sin

    def _mask(self, attention_mask: torch.Tensor | None, b: int, t: int, past: int, device: torch.device) -> Any:
        """Boolean ``[b, 1, t, past + t]`` (True = attend), or ``None`` for plain causal attention."""
        total = past + t
        padded = attention_mask is not None and not bool(attention_mask[:, :total].all())
        if not padded and (t == 1 or past == 0):
            return None  # one new token sees every key; or the prompt alone: is_causal
        query = torch.arange(past, total, device=device)[:, None]
        key = torch.arange(total, device=device)[None, :]
        mask = (key <= query)[None, None].expand(b, 1, t, total)
        if padded:
            assert attention_mask is not None
            valid = attention_mask[:, None, None, :total].bool()
            # a padding query sees itself: no fully masked row (NaN in SDPA), no effect on real tokens
            mask = mask & (valid | (key == query)[None, None])
        return mask

    def rope_regime(self, length: int) -> bool:
        """Whether a sequence of ``length`` positions is turned by LongRoPE's long factors (always ``False`` without
        LongRoPE): a cache of a prompt's first positions serves another prompt only where the two agree."""
        longrope = self.config.longrope
        return longrope is not None and length > longrope.original_max_position_embeddings

    def new_cache(self, capacity: int | None = None) -> NativeCache:
        """An empty cache for ``capacity`` positions (prompt plus new tokens; see :class:`NativeCache`), holding
        :attr:`kv_cache_dtype`."""
        windows = self.config.windows if any(w is not None for w in self.config.windows) else None
        return NativeCache(self.config.num_hidden_layers, capacity, self.kv_cache_dtype, windows)

    def unload(self) -> None:
        """Drop the compiled decode step (it refers back to this module: without this, ``LoadedModel.close()``
        would leave the pair to the cycle collector; it is rebuilt on the next decode step)."""
        self.__dict__.pop("_step", None)

    def _decode_step(self) -> Any:
        """The :class:`~anyquant_cpu.step.DecodeStep` of this model (built on its first decode step;
        ``None`` when no layer is made of cpu-fast linears)."""
        step = self.__dict__.get("_step", False)
        if step is False:
            from .cpu import decode_step

            step = self.__dict__["_step"] = decode_step(self)
        return step

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: NativeCache | None = None,
        use_cache: bool = False,
        past_key_values: NativeCache | None = None,
        logits_to_keep: int = 0,
        rope_horizon: torch.Tensor | int | None = None,
        **_: Any,
    ) -> NativeOutput:
        """``logits_to_keep``: logits for the last that many positions only (0: every position), as
        transformers' models take it: a generator's prefill asks for 1 (an 8,000-token prompt's logits would
        be 8,000 x the vocabulary in float32, 1.6 GB for SmolLM2). ``rope_horizon``: the prompt's length (each row's,
        ``[b]``) when this forward is one chunk of its prefill (see :meth:`rotary`: LongRoPE's choice of factors)."""
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = self.new_cache()
        b, t = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device)[None].expand(b, t)
        h = self.embed(input_ids)
        cos, sin = self.rotary(position_ids, h, rope_horizon)
        mask = self._mask(attention_mask, b, t, past, h.device)
        step = self._decode_step() if t == 1 and isinstance(cache, NativeCache) else None
        if step is not None and step.usable(h):
            h = step.run(h, cos, sin, mask, cache)
        else:
            for layer in self.model.layers:
                h = layer(h, cos, sin, mask, cache)
        if logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        return NativeOutput(logits=self.logits(h), cache=cache if use_cache else None)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The logits of the last layer's hidden states ``h``: the final norm, the head, Gemma 2's soft-capping."""
        logits: torch.Tensor = self.lm_head(self.model.norm(h))
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        return logits

    def decode_rows(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, caches: list[NativeCache]
    ) -> torch.Tensor:
        """One new token for each of several requests, each with its own cache: ``input_ids`` and ``position_ids``
        ``[rows, 1]``, ``caches[i]`` row ``i``'s (written). The next-token logits ``[rows, vocab]``.

        The linears, norms and MLP or MoE blocks run once over all rows (their weights read once); each row attends
        over its own cache, with no padding and no mask (:meth:`DecoderLayer.rows`; with ``decode_kernel``, one
        kernel call a layer for every row): a row's numbers do not depend on the others. Where the compiled decode
        step plans every layer and they attend on the kernel, the whole step is its one call
        (:meth:`~anyquant_cpu.step.DecodeStep.run_rows`), bitwise the modules' rows. What a server's shared decode
        step calls."""
        h = self.embed(input_ids)
        cos, sin = self.rotary(position_ids, h)
        step = self._decode_step()
        if step is not None and step.rows_usable(h):
            h = step.run_rows(h, cos, sin, caches)
        else:
            for layer in self.model.layers:
                h = cast(DecoderLayer, layer).rows(h, cos, sin, caches)
        return self.logits(h)[:, -1]

    def save_pretrained(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the native runtime does not save checkpoints; load with runtime='transformers'")
