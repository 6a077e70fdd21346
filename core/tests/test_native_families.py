"""The native decoder's Mixtral, Qwen2-MoE, Phi-3 and Gemma: which of their configs it takes (the rest keep a
reason and stay on transformers' class), and the server's shared decode pass over tiny models of each: one pass
for every request of a step, the same numbers as each request stepped alone. (Their logits against
transformers' classes: ``test_native_runtime.py``'s variants.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import anyquant
from anyquant.runtime.build import choose_runtime
from anyquant.runtime.native import NativeCausalLM, native_runtime_reason
from anyquant.testing.tiny import make_tiny_dense, tiny_llama_config

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
}


def test_which_family_configs_run_natively() -> None:
    for family, overrides in FAMILIES.items():
        cfg = tiny_llama_config(**overrides)
        assert native_runtime_reason(cfg) is None, family
        assert choose_runtime(cfg, "auto") == "native"
    mixtral, qwen2_moe, phi3, gemma = (tiny_llama_config(**FAMILIES[f]) for f in FAMILIES)
    # sliding windows: Mixtral's and Phi-3's whenever named; Qwen2-MoE's when switched on or in the layer types
    assert "sliding" in str(native_runtime_reason({**mixtral, "sliding_window": 4096}))
    assert "sliding" in str(native_runtime_reason({**phi3, "sliding_window": 2047}))
    assert native_runtime_reason({**qwen2_moe, "sliding_window": 4096, "use_sliding_window": False}) is None
    assert "sliding" in str(native_runtime_reason({**qwen2_moe, "sliding_window": 4096, "use_sliding_window": True}))
    assert "sliding" in str(native_runtime_reason({**qwen2_moe, "layer_types": ["sliding_attention"] * 2}))
    assert native_runtime_reason({**qwen2_moe, "layer_types": ["full_attention"] * 2}) is None
    # MoE sizes
    assert "num_experts" in str(native_runtime_reason({**mixtral, "num_local_experts": None}))
    assert "shared_expert" in str(native_runtime_reason({**qwen2_moe, "shared_expert_intermediate_size": None}))
    assert "larger" in str(native_runtime_reason({**mixtral, "num_experts_per_tok": 5}))
    # Phi-3: default rotary only (longrope and su stay on transformers' class); an even partial rotary
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
    # the later Gemmas (soft-capping, alternating sliding windows) stay on transformers' class
    for later in ("gemma2", "gemma3", "gemma3_text"):
        assert "sliding-window layers" in str(native_runtime_reason({**gemma, "model_type": later}))
        assert choose_runtime({**gemma, "model_type": later}, "auto") == "transformers"


#: the shared pass over these (Qwen3: its q/k head norms, which the pass once left out)
SHARED = {**FAMILIES, "qwen3": {"model_type": "qwen3", "head_dim": 32}}


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
