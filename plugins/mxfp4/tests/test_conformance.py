"""The anyquant conformance kit, run on anyquant-mxfp4 (whose format has no fixture in the kit: its own, header-only,
as a gpt-oss-20b layer's tensors are named, with and without a quantization_config)."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

from anyquant.testing import PluginConformance
from anyquant.testing.fixtures import Fixture, write_safetensors

E, H, I = 4, 128, 64  # noqa: E741 - experts, hidden, expert intermediate
LAYER = "model.layers.0"


def _gptoss(root: Path, quantization_config: dict[str, Any] | None) -> Path:
    t: dict[str, tuple[str, list[int]]] = {
        "model.embed_tokens.weight": ("BF16", [256, H]),
        "lm_head.weight": ("BF16", [256, H]),
        "model.norm.weight": ("BF16", [H]),
        f"{LAYER}.input_layernorm.weight": ("BF16", [H]),
        f"{LAYER}.post_attention_layernorm.weight": ("BF16", [H]),
        f"{LAYER}.self_attn.q_proj.weight": ("BF16", [H, H]),
        f"{LAYER}.self_attn.sinks": ("BF16", [4]),
        f"{LAYER}.mlp.router.weight": ("BF16", [E, H]),
        f"{LAYER}.mlp.router.bias": ("BF16", [E]),
    }
    experts = f"{LAYER}.mlp.experts"
    for proj, out, inp in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
        t[f"{experts}.{proj}_blocks"] = ("U8", [E, out, inp // 32, 16])
        t[f"{experts}.{proj}_scales"] = ("U8", [E, out, inp // 32])
        t[f"{experts}.{proj}_bias"] = ("BF16", [E, out])
    root.mkdir(parents=True, exist_ok=True)
    write_safetensors(root / "model.safetensors", t, {"format": "pt"})
    config: dict[str, Any] = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": H,
        "intermediate_size": I,
        "num_local_experts": E,
        "num_hidden_layers": 1,
        "vocab_size": 256,
    }
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return root


def gptoss_mxfp4(root: Path) -> Path:
    return _gptoss(root, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]})


def gptoss_mxfp4_no_config(root: Path) -> Path:
    return _gptoss(root, None)


class TestConformance(PluginConformance):
    entry_point = "anyquant-mxfp4"
    package = "anyquant_mxfp4"
    formats = ("mxfp4",)
    own_fixtures = ()
    extra_fixtures = MappingProxyType(
        {
            "gptoss_mxfp4": Fixture("gptoss_mxfp4", "mxfp4", gptoss_mxfp4),
            "gptoss_mxfp4_no_config": Fixture("gptoss_mxfp4_no_config", "mxfp4", gptoss_mxfp4_no_config),
        }
    )
