"""The native decoder's Mixtral, Qwen2-MoE, Phi-3, Gemma (1, 2 and 3) and sliding windows: which of their configs
it takes (the rest keep a reason and stay on transformers' class), which layers slide, and the server's shared decode
pass over tiny models of each: one pass for every request of a step, the same numbers as each request stepped alone.
(Their logits against transformers' classes: ``test_native_runtime.py``'s variants.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import anyquant
from anyquant.testing.tiny import make_tiny_dense, tiny_llama_config
from anyquant_runtime.build import choose_runtime
from anyquant_runtime.native import NativeCausalLM, layer_windows, native_runtime_reason
from plugins.runtime.tests.test_native_runtime import VARIANTS

FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {
        "model_type": "mixtral",
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
    },
    "phi3": {
        "model_type": "phi3",
        "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    "gemma": {"model_type": "gemma", "head_dim": 48, "tie_word_embeddings": True},
    "gemma2": {"model_type": "gemma2", "head_dim": 48, "sliding_window": 6, "tie_word_embeddings": True},
    "gemma3_text": {
        "model_type": "gemma3_text",
        "head_dim": 32,
        "sliding_window": 5,
        "sliding_window_pattern": 2,
        "tie_word_embeddings": True,
    },
}


def test_which_family_configs_run_natively() -> None:
    for family, overrides in FAMILIES.items():
        cfg = tiny_llama_config(**overrides)
        assert native_runtime_reason(cfg) is None, family
        assert choose_runtime(cfg, "auto") == "native"
    mixtral, qwen2_moe, phi3, gemma, gemma2, gemma3 = (tiny_llama_config(**FAMILIES[f]) for f in FAMILIES)
    # sliding windows run natively (which layers slide: test_which_layers_slide); a window that is no window does not
    assert native_runtime_reason({**mixtral, "sliding_window": 4096}) is None
    assert native_runtime_reason({**phi3, "sliding_window": 2047}) is None
    assert native_runtime_reason({**qwen2_moe, "sliding_window": 4096, "use_sliding_window": True}) is None
    assert "sliding_window 0" in str(native_runtime_reason({**qwen2_moe, "layer_types": ["sliding_attention"] * 2}))
    assert "layer_types" in str(native_runtime_reason({**gemma2, "layer_types": ["sliding_attention"]}))
    assert "layer_types" in str(native_runtime_reason({**gemma2, "layer_types": ["chunked_attention"] * 2}))
    # MoE sizes
    assert "num_experts" in str(native_runtime_reason({**mixtral, "num_local_experts": None}))
    assert "shared_expert" in str(native_runtime_reason({**qwen2_moe, "shared_expert_intermediate_size": None}))
    assert "larger" in str(native_runtime_reason({**mixtral, "num_experts_per_tok": 5}))
    # Phi-3: LongRoPE (longrope, legacy su) without its factors is refused naming the type (a full config runs natively:
    # tests/test_native_longrope.py); llama3 scaling is not Phi-3's; an even partial rotary
    for rope_type in ("longrope", "su", "llama3"):
        assert rope_type in str(native_runtime_reason({**phi3, "rope_parameters": {"rope_type": rope_type}}))
    assert "partial_rotary_factor" in str(
        native_runtime_reason({**phi3, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.3}})
    )
    # Gemma: GELU (tanh; "gelu" is its legacy name), causal attention
    assert native_runtime_reason({**gemma, "hidden_act": "gelu"}) is None
    assert "hidden_act" in str(native_runtime_reason({**gemma, "hidden_act": "silu"}))
    assert "hidden_act" in str(native_runtime_reason({**mixtral, "hidden_act": "gelu_pytorch_tanh"}))
    assert "bidirectional" in str(native_runtime_reason({**gemma, "use_bidirectional_attention": True}))
    # Gemma 2 and 3 read hidden_activation; their soft-capping must be a number
    assert "hidden_activation" in str(native_runtime_reason({**gemma2, "hidden_activation": "gelu"}))
    assert "attn_logit_softcapping" in str(native_runtime_reason({**gemma2, "attn_logit_softcapping": "x"}))
    assert native_runtime_reason({**gemma2, "attn_logit_softcapping": None, "final_logit_softcapping": None}) is None
    assert "bidirectional" in str(native_runtime_reason({**gemma3, "use_bidirectional_attention": True}))
    assert "'yarn'" in str(native_runtime_reason({**gemma3, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))
    # the multimodal Gemma 3 (its text model nested in text_config) stays on transformers' class
    assert "multimodal" in str(native_runtime_reason({**gemma, "model_type": "gemma3"}))
    assert choose_runtime({**gemma, "model_type": "gemma3"}, "auto") == "transformers"


def test_which_layers_slide() -> None:
    """Each family's sliding layers and window, as transformers' config class and attention decide them."""
    from transformers import AutoConfig

    cases: list[dict[str, Any]] = [
        {"model_type": "llama", "sliding_window": 8, "layer_types": ["sliding_attention"] * 4},  # Llama reads none
        {"model_type": "mistral"},  # its default window, 4096
        {"model_type": "mistral", "sliding_window": None},
        {"model_type": "mixtral", "sliding_window": 7},
        {"model_type": "phi3", "sliding_window": 2047},
        {"model_type": "qwen2", "sliding_window": 8},  # not switched on
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
        {
            "model_type": "qwen3",
            "use_sliding_window": True,
            "sliding_window": 8,
            "layer_types": ["full_attention", "sliding_attention"] * 2,
        },
        {"model_type": "qwen2_moe", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
        {"model_type": "qwen3_moe", "use_sliding_window": True, "sliding_window": 8},
        {"model_type": "gemma2", "sliding_window": 8},
        {"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 3},
        {"model_type": "gemma3_text"},
    ]
    for overrides in cases:
        cfg = tiny_llama_config(num_hidden_layers=4, **overrides)
        ref = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
        types = (
            getattr(ref, "layer_types", None)
            if cfg["model_type"] in ("qwen2", "qwen3", "qwen2_moe") or "gemma" in cfg["model_type"]
            else None
        )
        window = ref.sliding_window
        if types is None:  # the families that window every layer, or none
            slides = window is not None and cfg["model_type"] not in ("llama", "gemma")
            want = [window if slides else None] * 4
        else:
            want = [window if kind == "sliding_attention" else None for kind in types]
        assert layer_windows(cfg) == want, overrides
        assert layer_windows(ref.to_dict()) == want, overrides  # the config as transformers saves it


#: the native runtime tests' DeepSeek-V3 (its layer count aside)
DEEPSEEK: dict[str, Any] = {k: v for k, v in VARIANTS["deepseek_v3"].items() if k != "num_hidden_layers"}


def test_which_deepseek_configs_run_natively() -> None:
    """DeepSeek-V3 (latent attention, group-limited routing) runs natively with default or YaRN rotary scaling;
    sizes that do not fit together, other routing than transformers' class computes, or other scalings stay on
    transformers' class with the reason."""
    ds = tiny_llama_config(**DEEPSEEK)
    assert native_runtime_reason(ds) is None and choose_runtime(ds, "auto") == "native"
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale_all_dim": 1.0}
    assert native_runtime_reason({**ds, "rope_scaling": yarn, "q_lora_rank": None}) is None
    assert native_runtime_reason({**ds, "n_routed_experts": None, "num_local_experts": 8}) is None
    for change, said in (
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"q_lora_rank": 1.5}, "q_lora_rank"),
        ({"n_group": 3}, "n_group 3"),
        ({"topk_group": 3}, "topk_group 3"),
        ({"n_group": 8}, "do not split"),  # one expert a group: no two best to score it by
        ({"num_experts_per_tok": 5}, "larger"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"qk_rope_head_dim": 15}, "odd"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"routed_scaling_factor": "x"}, "routed_scaling_factor"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "yarn"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ):
        assert said in str(native_runtime_reason({**ds, **change})), change


def test_which_deepseek_v2_configs_run_natively() -> None:
    """DeepSeek-V2: softmax routing, greedy or group-limited (its config's own default: greedy, no groups needed)."""
    v2 = tiny_llama_config(**{**DEEPSEEK, "model_type": "deepseek_v2", "n_group": None, "topk_group": None})
    assert native_runtime_reason(v2) is None and choose_runtime(v2, "auto") == "native"
    grouped = {**v2, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 2}  # one expert a group: fine
    assert native_runtime_reason(grouped) is None
    assert native_runtime_reason({**v2, "n_routed_experts": None, "num_experts": 8}) is None
    for change, said in (
        ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
        ({"topk_method": "group_limited_greedy"}, "n_group None"),
        ({**grouped, "n_group": 3}, "n_group 3"),
        ({"num_experts_per_tok": 9}, "larger"),
        ({"scoring_func": "sigmoid"}, "scoring_func"),
    ):
        assert said in str(native_runtime_reason({**v2, **change})), change


#: the shared pass over these (Qwen3: its q/k head norms, which the pass once left out; sliding windows shorter than
#: the prompts and steps; DeepSeek-V3's latent attention, whose values are narrower than its keys)
SHARED = {
    **FAMILIES,
    "deepseek_v3": DEEPSEEK,
    "deepseek_v2": {**DEEPSEEK, "model_type": "deepseek_v2", "topk_method": "group_limited_greedy"},
    "qwen3": {"model_type": "qwen3", "head_dim": 32},
    "mistral-window": {"model_type": "mistral", "sliding_window": 5},
    "qwen2-window": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
}


@pytest.fixture(scope="module", params=sorted(SHARED))
def native(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_tiny_dense(tmp_path_factory.mktemp(request.param) / "m", **SHARED[request.param])
    model = anyquant.load(path, runtime="auto")
    assert isinstance(model.module, NativeCausalLM) and model.info["runtime"] == "native"
    yield model
    model.close()


def _greedy(batch: Any, prompts: dict[str, list[int]], steps: int) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """Each prompt prefilled into ``batch``, then ``steps`` greedy tokens for all of them together."""
    rows = {key: batch.prefill(key, ids) for key, ids in prompts.items()}
    tokens: dict[str, list[int]] = {key: [] for key in prompts}
    logits: dict[str, list[torch.Tensor]] = {key: [row] for key, row in rows.items()}
    for _ in range(steps):
        keys = [slot.key for slot in batch.slots]
        fed = [int(logits[key][-1].argmax()) for key in keys]
        out = batch.step(fed)
        for i, key in enumerate(keys):
            tokens[key].append(fed[i])
            logits[key].append(out[i])
    return tokens, {key: torch.stack(rows) for key, rows in logits.items()}


def test_the_shared_pass_answers_as_each_request_alone(native: Any) -> None:
    """Three requests of different lengths stepped together in one shared pass: the tokens each gets alone (its
    own batch), and logits within float rounding of those."""
    DecodeBatch = pytest.importorskip("anyquant_serve.batch", reason="the server is anyquant-serve's").DecodeBatch

    gen: Any = native.generator
    prompts = {
        "a": [5, 17, 99, 3, 42, 8],
        "b": [7, 7, 120, 64, 1, 200, 33, 12, 90, 4, 150],
        "c": [250],
    }
    together = DecodeBatch(native.module, gen.cache_kw, gen.device, 4)
    assert together.shared
    calls = {"forward": 0}
    hook = native.module.register_forward_pre_hook(lambda *_: calls.__setitem__("forward", calls["forward"] + 1))
    try:
        got, got_logits = _greedy(together, prompts, 6)
    finally:
        hook.remove()
    # prefill chunks of 4 positions (2 + 3 + 1 forwards), then no forward of the module per step: the shared pass
    assert calls["forward"] == 6
    for key, ids in prompts.items():
        alone = DecodeBatch(native.module, gen.cache_kw, gen.device, 4)
        want, want_logits = _greedy(alone, {key: ids}, 6)
        assert got[key] == want[key], key
        torch.testing.assert_close(got_logits[key], want_logits[key], rtol=1e-5, atol=1e-5)


def test_the_shared_pass_equals_the_full_forward(native: Any) -> None:
    """The shared pass's logits for each row equal the model's full forward over the row's tokens (float
    rounding): every family's embedding scale, norms, fused projections and MoE blocks are in it."""
    DecodeBatch = pytest.importorskip("anyquant_serve.batch", reason="the server is anyquant-serve's").DecodeBatch

    gen: Any = native.generator
    prompts = {"a": [5, 17, 99, 3], "b": [7, 120, 64, 1, 200, 33]}
    batch = DecodeBatch(native.module, gen.cache_kw, gen.device, 0)
    tokens, logits = _greedy(batch, prompts, 4)
    with torch.no_grad():
        for key, ids in prompts.items():
            full = native.module(torch.tensor([ids + tokens[key]])).logits[0, len(ids) - 1 :]
            torch.testing.assert_close(logits[key], full, rtol=1e-5, atol=1e-5)


class _Rows:
    """:meth:`NativeCausalLM.decode_rows` as a batch of requests: each prompt prefilled alone into its own cache,
    then one call a step for all of them."""

    def __init__(self, module: Any) -> None:
        self.module, self.slots = module, []  # type: ignore[var-annotated]

    def prefill(self, key: str, ids: list[int]) -> torch.Tensor:
        out = self.module(torch.tensor([ids]), use_cache=True)
        self.slots.append(type("Slot", (), {"key": key, "cache": out.cache, "position": len(ids)})())
        return out.logits[0, -1]

    def step(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([[t] for t in tokens])
        positions = torch.tensor([[slot.position] for slot in self.slots])
        logits = self.module.decode_rows(ids, positions, [slot.cache for slot in self.slots])
        for slot in self.slots:
            slot.position += 1
        return logits


def test_decode_rows_answers_as_each_request_alone(native: Any) -> None:
    """The model's own shared pass (what a server's batched step calls), every family's layers included: each
    row's tokens those of its request alone, its logits within float rounding of the full forward over its tokens."""
    prompts = {"a": [5, 17, 99, 3, 42, 8], "b": [7, 7, 120, 64, 1, 200, 33, 12, 90, 4, 150], "c": [250]}
    with torch.inference_mode():
        rows = _Rows(native.module)
        got = {key: rows.prefill(key, ids) for key, ids in prompts.items()}
        tokens: dict[str, list[int]] = {key: [] for key in prompts}
        logits: dict[str, list[torch.Tensor]] = {key: [row] for key, row in got.items()}
        for _ in range(8):
            fed = [int(logits[slot.key][-1].argmax()) for slot in rows.slots]
            out = rows.step(fed)
            for i, slot in enumerate(rows.slots):
                tokens[slot.key].append(fed[i])
                logits[slot.key].append(out[i])
        for key, ids in prompts.items():
            alone = _Rows(native.module)
            want = [alone.prefill(key, ids)]
            for token in tokens[key]:
                want.append(alone.step([token])[0])
                assert int(want[-2].argmax()) == token, key
            torch.testing.assert_close(torch.stack(logits[key]), torch.stack(want), rtol=1e-5, atol=1e-5)
            full = native.module(torch.tensor([ids + tokens[key]])).logits[0, len(ids) - 1 :]
            torch.testing.assert_close(torch.stack(logits[key]), full, rtol=1e-5, atol=1e-5)
