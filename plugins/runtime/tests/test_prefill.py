"""The generator's prefill: a long prompt runs in chunks of ``PREFILL_CHUNK`` positions, asks the module for
the last position's logits only, and the native cache is sized once for prompt plus new tokens.

(An 8,001-token prompt on the bundled SmolLM2 peaked at 2.7 GB with the whole prompt's logits, 8,001 x
49,152 float32, and a doubled cache; 0.83 GB after. RSS figures live in the issue notes, not in tests.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant
from anyquant.testing.tiny import make_tiny_dense
from anyquant_runtime import generate as generate_mod

PROMPTS = ["Hello there, how are you today? " * 3, "x", "A longer prompt, one that spans chunks: " * 2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dense(tmp_path_factory.mktemp("prefill") / "m", num_hidden_layers=2)


def _recorded(model: Any) -> list[Any]:
    """Every forward's keyword arguments and output, recorded on the loaded model's module."""
    seen: list[Any] = []
    module = model.module
    forward = module.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        seen.append((kwargs, out))
        return out

    module.forward = spy
    model.generator.module = module
    return seen


@pytest.mark.parametrize("runtime", ["native", "transformers"])
def test_chunked_prefill_gives_the_whole_prompts_tokens(
    tiny: Path, runtime: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = anyquant.load(tiny, runtime=runtime)
    monkeypatch.setattr(generate_mod, "PREFILL_CHUNK", 100_000)
    whole = model.generate_batch(PROMPTS, max_new_tokens=12)
    sampled = model.generate(PROMPTS[0], max_new_tokens=12, temperature=0.9, seed=5)
    monkeypatch.setattr(generate_mod, "PREFILL_CHUNK", 7)
    seen = _recorded(model)
    assert model.generate_batch(PROMPTS, max_new_tokens=12) == whole  # left-padded rows across chunk edges
    assert model.generate(PROMPTS[0], max_new_tokens=12, temperature=0.9, seed=5) == sampled
    widths = [kw["input_ids"].shape[1] for kw, _ in seen]
    assert max(widths) == 7 and widths.count(7) >= 2  # the prompts did run in chunks


@pytest.mark.parametrize("runtime", ["native", "transformers"])
def test_prefill_asks_for_the_last_positions_logits_only(tiny: Path, runtime: str) -> None:
    model = anyquant.load(tiny, runtime=runtime)
    seen = _recorded(model)
    model.generate(PROMPTS[0], max_new_tokens=3)
    prompt_len = seen[0][0]["input_ids"].shape[1]
    assert prompt_len > 1
    assert [tuple(out.logits.shape[:2]) for _, out in seen] == [(1, 1)] * len(seen)


def test_native_cache_is_sized_once_for_prompt_and_new_tokens(tiny: Path) -> None:
    model = anyquant.load(tiny, runtime="native")
    seen = _recorded(model)
    model.generate(PROMPTS[2], max_new_tokens=40, stop=["\x00never"])
    prompt_len = seen[0][0]["input_ids"].shape[1]
    cache = seen[-1][1].cache
    held = {k.shape[2] for k in cache.keys if k is not None}
    assert held == {prompt_len + 40}, (held, prompt_len)  # not 64, not doubled


def test_native_logits_to_keep_equals_the_last_rows_of_the_full_forward(tiny: Path) -> None:
    model = anyquant.load(tiny, runtime="native")
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model.module(ids).logits
        last = model.module(ids, logits_to_keep=2).logits
    assert last.shape == (2, 2, full.shape[-1])
    torch.testing.assert_close(last, full[:, -2:], rtol=1e-5, atol=1e-6)
