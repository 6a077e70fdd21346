"""A checkpoint's chat template cannot render more text than the conversation and the model's context
justify (issue #27): the tokenizer would need hundreds of bytes per character of it, so a template that
emits megabytes of filler could abort the process after the render. The bound holds while rendering."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import pytest

import anyquant
from anyquant.testing.tiny import make_tiny_dense
from anyquant_runtime import chat

FILLER = "{% for i in range(100000) %}{{ 'x' * 500 }}{% endfor %}"  # 50 MB, under the frame budget's limits
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_dense(tmp_path_factory.mktemp("tiny") / "m"))


def test_a_template_emitting_megabytes_is_stopped_while_rendering(tokenizer: Any, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(tokenizer, "chat_template", FILLER)
    tracemalloc.start()
    try:
        with pytest.raises(anyquant.CheckpointError, match=r"chat template rendered more than 262,1\d\d characters"):
            chat.render_chat(tokenizer, MESSAGES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # the 50 MB were never built


def test_the_budget_grows_with_the_context_and_the_messages(tokenizer: Any, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(tokenizer, "chat_template", "{% for i in range(600) %}{{ 'x' * 500 }}{% endfor %}")  # 300 k
    with pytest.raises(anyquant.CheckpointError, match=r"more than 262,1\d\d "):
        chat.render_chat(tokenizer, MESSAGES)
    assert len(chat.render_chat(tokenizer, MESSAGES, context_length=32768)) == 300_000  # 16 per token: 512 Ki
    long = [{"role": "user", "content": "y" * 200_000}]  # the messages' own text counts on top of the floor
    template = "{{ messages[0]['content'] }}{% for i in range(200) %}{{ 'x' * 500 }}{% endfor %}"
    monkeypatch.setattr(tokenizer, "chat_template", template)
    assert len(chat.render_chat(tokenizer, long)) == 300_000


def test_a_long_conversation_renders_as_transformers_renders_it(tokenizer: Any) -> None:
    assert tokenizer.chat_template
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "a long message " * 700}
        for i in range(100)
    ]  # 1 MB of text, four times the floor
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert len(expected) > 1_000_000
    assert chat.render_chat(tokenizer, messages, add_generation_prompt=True) == expected
    short = chat.render_chat(tokenizer, MESSAGES, add_generation_prompt=True)
    assert short == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    # the counting join is active only inside render_chat: transformers' own renders stay unbounded
    huge = [{"role": "user", "content": "z" * 400_000}]
    assert len(tokenizer.apply_chat_template(huge, tokenize=False)) > 400_000


def test_generate_bounds_the_template_by_the_models_context(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    loaded = anyquant.load(make_tiny_dense(tmp_path / "m"))
    monkeypatch.setattr(loaded.tokenizer, "chat_template", FILLER)
    with pytest.raises(anyquant.CheckpointError, match="chat template rendered more than"):
        loaded.generate(MESSAGES, max_new_tokens=2)
