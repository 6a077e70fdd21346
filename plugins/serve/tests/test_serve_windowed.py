"""The server's batched decode over native models with sliding-window attention (Mistral's every layer, Qwen2's
from ``max_window_layers`` on) and over Gemma 2 and 3 (soft-capping, four norms a layer, alternating windows, two
rotary tables): several requests decoding together in the scheduler's shared step answer as each request alone,
well past the windows. (``anyquant_serve.batch`` attends over what each cache's ``update`` gives: a sliding layer's
cache gives the window's positions only. Gemma 2's and 3's layers need the model's own shared pass,
``NativeCausalLM.decode_rows``: where the batch does not call it, those cases are expected to fail.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import anyquant
from anyquant.testing.tiny import make_tiny_dense
from anyquant_runtime.native import NativeCausalLM

pytestmark = pytest.mark.slow

MODELS: dict[str, dict[str, Any]] = {
    "mistral-window": {"model_type": "mistral", "sliding_window": 5},
    "qwen2-window": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "gemma2": {"model_type": "gemma2", "head_dim": 48, "sliding_window": 6, "tie_word_embeddings": True},
    "gemma3_text": {
        "model_type": "gemma3_text",
        "head_dim": 32,
        "sliding_window": 5,
        "sliding_window_pattern": 2,
        "tie_word_embeddings": True,
    },
}
PROMPTS = ["Hi", "Hello there, how are you today?", "x", "Count: one two three four five six."]


@pytest.fixture(scope="module", params=sorted(MODELS))
def native(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path: Path = make_tiny_dense(tmp_path_factory.mktemp(request.param) / "m", **MODELS[request.param])
    model = anyquant.load(path, runtime="auto")
    assert isinstance(model.module, NativeCausalLM) and any(w is not None for w in model.module.config.windows)
    yield model
    model.close()


def test_batched_greedy_answers_equal_each_request_alone(native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from anyquant_serve.batch import DecodeBatch
    from anyquant_serve.scheduler import Finished, ModelAdapter, Request, Scheduler

    shared = {"steps": 0}
    step = DecodeBatch._shared_step

    def counted(self: Any, tokens: Any) -> Any:
        shared["steps"] += 1
        return step(self, tokens)

    monkeypatch.setattr(DecodeBatch, "_shared_step", counted)
    adapter = ModelAdapter(native)
    scheduler = Scheduler(adapter, max_batch=4, max_queue=4, prefix_cache_mb=0)
    texts: dict[int, list[str]] = {i: [] for i in range(len(PROMPTS))}
    ends: dict[int, Finished] = {}
    done = threading.Event()

    def request(i: int) -> Request:
        def finish(f: Finished) -> None:
            ends[i] = f
            if len(ends) == len(PROMPTS):
                done.set()

        ids = adapter.encode(PROMPTS[i], chat=False)
        return Request(ids, native.params(chat=False), 16, texts[i].append, finish, time.monotonic() + 300)

    try:
        scheduler.submit_many([request(i) for i in range(len(PROMPTS))])
        assert done.wait(300)
    finally:
        scheduler.close(30)
    assert shared["steps"] > 0  # the requests did decode together
    assert all(ends[i].reason in ("stop", "length") for i in ends)
    for i, prompt in enumerate(PROMPTS):
        assert "".join(texts[i]) == native.generate(prompt, max_new_tokens=16, chat=False), prompt
