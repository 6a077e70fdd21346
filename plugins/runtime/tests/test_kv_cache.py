"""The native decoder's KV cache dtype: the activations' own by default, float16 or bfloat16 on ``cpu-fast`` with the
load option ``cpu_fast_kv_cache`` (the exact backends ignore it). Judged by the float32 cache of the same load: the prefill of a prompt
of one chunk is bitwise the float32 cache's (the new positions attend exactly), later positions within a stated
tolerance of the largest logit, greedy tokens the same. (The tiny cpu-fast model's test is in
test_native_runtime.py, beside its helpers.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import anyquant
from anyquant.errors import ParameterError
from anyquant_runtime import generate as generate_mod

#: float16 history against float32 (measured on these prompts: bundled ~3e-3, tiny ~1e-3 of the largest logit)
FLOAT16_TOLERANCE = 1e-2
PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):"]
LONG = "The history of the river valley is long, and its towns were built by traders and farmers. " * 24


@pytest.fixture(scope="module")
def bundled() -> dict[str, Any]:
    path = anyquant.default_model()
    # float32 prompts: the two models then differ in the cache's dtype only (a bfloat16 prompt GEMM, the default on
    # AMX / AVX512-BF16 hosts, adds its own rounding to both, which the cache's then moves a little further)
    return {kv: anyquant.load(path, cpu_fast_kv_cache=kv, cpu_fast_prefill="float32") for kv in ("float16", "float32")}


def _steps(model: Any, ids: list[int], n: int) -> tuple[torch.Tensor, list[int], Any]:
    """The last prompt position's logits then ``n`` greedy decode steps' (``[n + 1, vocab]``), the greedy tokens
    and the cache, through the generator's own chunked prefill."""
    logits: list[torch.Tensor] = []
    gen = model.generator
    with torch.inference_mode():
        out = gen._prefill(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                           torch.arange(len(ids))[None], len(ids) + n)  # fmt: skip
        tokens: list[int] = []
        for i in range(n + 1):
            row = out.logits[0, -1].float()
            logits.append(row)
            tokens.append(int(row.argmax()))
            if i == n:
                break
            out = model.module(
                input_ids=torch.tensor([[tokens[-1]]]),
                position_ids=torch.tensor([[len(ids) + i]]),
                use_cache=True,
                cache=out.cache,
            )
    return torch.stack(logits), tokens, out.cache


def test_cpu_fast_caches_float32_by_default_and_float16_on_request() -> None:
    model = anyquant.load(anyquant.default_model())
    assert (model.backend, model.info["kv_cache"]) == ("cpu-fast", "float32")
    _, _, cache = _steps(model, model.tokenizer(PROMPTS[0])["input_ids"], 2)
    assert {k.dtype for k in cache.keys} == {v.dtype for v in cache.values} == {torch.float32}
    model = anyquant.load(anyquant.default_model(), cpu_fast_kv_cache="float16")
    assert (model.backend, model.info["kv_cache"]) == ("cpu-fast", "float16")
    _, _, cache = _steps(model, model.tokenizer(PROMPTS[0])["input_ids"], 2)
    assert {k.dtype for k in cache.keys} == {v.dtype for v in cache.values} == {torch.float16}


@pytest.mark.parametrize("backend", ["dequantized", "packed"])
def test_exact_backends_cache_float32(backend: str) -> None:
    model = anyquant.load(anyquant.default_model(), backend=backend, cpu_fast_kv_cache="float16")  # cpu-fast's only
    assert model.info["kv_cache"] == "float32" and model.module.kv_cache_dtype is None
    _, _, cache = _steps(model, model.tokenizer(PROMPTS[0])["input_ids"], 1)
    assert {k.dtype for k in cache.keys} == {torch.float32}


def test_bad_kv_cache_option_is_refused() -> None:
    with pytest.raises(ParameterError, match="cpu_fast_kv_cache='int8'"):
        anyquant.load(anyquant.default_model(), cpu_fast_kv_cache="int8")


def test_bfloat16_cache_on_request() -> None:
    model = anyquant.load(anyquant.default_model(), cpu_fast_kv_cache="bfloat16")
    assert model.info["kv_cache"] == "bfloat16"
    _, _, cache = _steps(model, model.tokenizer(PROMPTS[0])["input_ids"], 1)
    assert {k.dtype for k in cache.keys} == {torch.bfloat16}


@pytest.mark.parametrize("prompt", [*PROMPTS, LONG])
def test_float16_cache_logits_and_greedy_tokens_on_the_bundled_model(
    bundled: dict[str, Any], prompt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if prompt is LONG:
        monkeypatch.setattr(generate_mod, "PREFILL_CHUNK", 128)  # later chunks attend to the float16 history
    ids = bundled["float32"].tokenizer(prompt)["input_ids"]
    assert prompt is not LONG or len(ids) > 3 * 128
    half, half_tokens, cache = _steps(bundled["float16"], ids, 16)
    full, full_tokens, _ = _steps(bundled["float32"], ids, 16)
    assert cache.keys[0].dtype == torch.float16
    if prompt is not LONG:  # one chunk: its own positions attend exactly
        assert torch.equal(half[0], full[0])
    err = float((half - full).abs().max() / full.abs().max())
    assert 0 < err <= FLOAT16_TOLERANCE
    assert half_tokens == full_tokens


def test_generate_unchanged_on_the_bundled_model(bundled: dict[str, Any]) -> None:
    for prompt in PROMPTS:
        texts = [bundled[kv].generate(prompt, max_new_tokens=24) for kv in ("float16", "float32")]
        assert texts[0] == texts[1]
