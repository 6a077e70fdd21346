"""Shared peer-fixture specs: tiny Llama checkpoints quantized by GPTQModel.

Tests that need the same real checkpoints (dequant today; logits and greedy
tokens later) call these functions with the same params, so they share one
cached build (see :mod:`tests.peers.fixtures`).

Layout of a quantized fixture directory::

    manifest.json                          variants, per-module info, timings, library versions
    base/                                  the fp16 source model + byte-level tokenizer
    quantized/<variant>/                   the checkpoint exactly as GPTQModel saved it
    judges/<variant>/                      GPTQModel's outputs for it (kept out of the checkpoint):
        gptqmodel_dequant.safetensors      GPTQModel's dequantized weights, "<module>.weight", [in, out]
        gptqmodel_logits.safetensors       input_ids [1, 32], fp32 logits, greedy_tokens (8 prompt + 8 new)
        gptqmodel_dequant_bf16.safetensors only for the bf16 variant: reloaded with dtype=bfloat16
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.peers.fixtures import peer_fixture_or_skip

__all__ = [
    "FAMILIES",
    "FAMILY_VARIANTS",
    "GPTQMODEL_AWQ_VARIANTS",
    "GPTQ_BF16_VARIANT",
    "GPTQ_QUANT_VARIANTS",
    "TINY_LLAMA",
    "gptq_case_name",
    "gptqmodel_awq_quantized_dir",
    "gptqmodel_family_dir",
    "gptqmodel_gptq_quantized_dir",
]

TINY_LLAMA: dict[str, int] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
_COMMON: dict[str, Any] = {
    "mode": "quantized",
    "seed": 0,
    "model": TINY_LLAMA,
    "calibration_samples": 16,
    "calibration_chars": 400,
    "prompt_len": 32,
    "greedy_prompt_len": 8,
    "new_tokens": 8,
}
_PACKAGES = ("gptqmodel", "torch", "transformers")


def gptq_case_name(bits: int, group_size: int, sym: bool, desc_act: bool, fmt: str) -> str:
    """E.g. ``b4_g128_sym_nodesc_gptq``."""
    return f"b{bits}_g{group_size}_{'sym' if sym else 'asym'}_{'desc' if desc_act else 'nodesc'}_{fmt}"


def _gptq_variant(bits: int, group_size: int, sym: bool, desc_act: bool, fmt: str) -> dict[str, Any]:
    name = gptq_case_name(bits, group_size, sym, desc_act, fmt)
    return {"name": name, "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act, "format": fmt}


# Every bit width gets sym/asym, desc_act on/off, v1/v2 and four group sizes between its four variants.
GPTQ_QUANT_VARIANTS: list[dict[str, Any]] = [
    _gptq_variant(bits, group, sym, desc, fmt)
    for bits in (2, 3, 4, 8)
    for (group, sym, desc, fmt) in (
        (128, True, False, "gptq"),
        (32, False, True, "gptq"),
        (64, True, True, "gptq_v2"),
        (-1, False, False, "gptq_v2"),
    )
]
GPTQ_BF16_VARIANT = "b4_g128_sym_nodesc_gptq"

GPTQMODEL_AWQ_VARIANTS: list[dict[str, Any]] = [
    {"name": "awq_gemm_g32_zp", "bits": 4, "group_size": 32, "sym": False, "desc_act": False, "format": "gemm"},
    {"name": "awq_gemm_g64_sym", "bits": 4, "group_size": 64, "sym": True, "desc_act": False, "format": "gemm"},
]


def gptqmodel_gptq_quantized_dir() -> Path:
    """16 GPTQ checkpoints of the tiny Llama made by ``GPTQModel.quantize`` (skips if unavailable)."""
    params = {**_COMMON, "method": "gptq", "bf16_variant": GPTQ_BF16_VARIANT, "variants": GPTQ_QUANT_VARIANTS}
    return peer_fixture_or_skip("gptqmodel_worker", params, packages=_PACKAGES)


def gptqmodel_awq_quantized_dir() -> Path:
    """AWQ GEMM checkpoints of the tiny Llama made by GPTQModel (``AWQConfig``, ``BACKEND.AWQ_TORCH``)."""
    params = {**_COMMON, "method": "awq", "variants": GPTQMODEL_AWQ_VARIANTS}
    return peer_fixture_or_skip("gptqmodel_worker", params, packages=_PACKAGES)


#: tiny random models of the families beyond Llama (``transformers`` model types), as GPTQModel quantizes them
FAMILIES: dict[str, dict[str, Any]] = {
    # fused qkv_proj / gate_up_proj in transformers; GPTQModel 7.6 keeps qkv_proj whole, writes gate/up split
    "phi3": {"model_type": "phi3", **TINY_LLAMA},
    # per-expert linears mlp.experts.N.{gate,up,down}_proj; transformers 5 fuses them into 3-D parameters
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        **TINY_LLAMA,
        "head_dim": 32,
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    # Qwen2-MoE: a shared expert beside the routed ones, gated by a sigmoid (shared_expert_gate)
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        **TINY_LLAMA,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
    # Mixtral: router softmax then top-k renormalised; transformers 5 calls block_sparse_moe "mlp"
    "mixtral": {
        "model_type": "mixtral",
        **{**TINY_LLAMA, "intermediate_size": 64},
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
}
# DeepSeek-V3: multi-head latent attention, group-limited sigmoid routing, a shared expert, a dense first layer
FAMILIES["deepseek_v3"] = {
    "model_type": "deepseek_v3",
    **{**TINY_LLAMA, "num_key_value_heads": 4},
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}
# Qwen3: RMS norms on the queries and keys (transformers' class; anyquant's native decoder has none)
FAMILIES["qwen3"] = {"model_type": "qwen3", **TINY_LLAMA, "head_dim": 32}
# Gemma2/Gemma3: embedding scaled by sqrt(hidden), extra norms around attention and MLP, soft-capped logits,
# alternating sliding-window layers (a window of 4 tokens, so the 32-token prompt crosses it)
FAMILIES["gemma2"] = {"model_type": "gemma2", **TINY_LLAMA, "head_dim": 32, "sliding_window": 4}
FAMILIES["gemma3_text"] = {
    "model_type": "gemma3_text",
    **TINY_LLAMA,
    "head_dim": 32,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
    "final_logit_softcapping": 30.0,
}
#: one 4-bit variant per method (GPTQModel's AWQ cannot quantize Phi-3: KeyError 'q_zeros' in its AWQ packer)
FAMILY_VARIANTS: dict[str, dict[str, Any]] = {
    "gptq": {"name": "gptq_b4_g32", "bits": 4, "group_size": 32, "sym": True, "desc_act": False, "format": "gptq"},
    "awq": {"name": "awq_b4_g32", "bits": 4, "group_size": 32, "sym": False, "desc_act": False, "format": "gemm"},
}


def gptqmodel_family_dir(family: str, method: str) -> Path:
    """A tiny random ``family`` model quantized by GPTQModel with ``method`` (``gptq`` or ``awq``), its fp16
    source in ``base/``, GPTQModel's dequantized weights, logits and greedy tokens in ``judges/`` (skips if
    GPTQModel is unavailable)."""
    params = {**_COMMON, "model": FAMILIES[family], "method": method, "variants": [FAMILY_VARIANTS[method]]}
    return peer_fixture_or_skip("gptqmodel_worker", params, packages=_PACKAGES)
