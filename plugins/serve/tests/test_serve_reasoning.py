"""A thinking model's ``<think>`` block as ``reasoning_content`` on ``anyquant serve`` (issue #43): where the answer
begins (inside a block the prompt left open, as DeepSeek-R1's, QwQ's and Qwen3-Thinking's templates leave it, or
outside, as Qwen3's hybrid one), the split of a whole answer and of a streamed one (the same two texts at every
piece size), ``--reasoning-format none``, and constrained answers left whole.

The split is tested on fixed answers; the wiring against real server processes on copies of the bundled GGUF with a
DeepSeek-R1-style and a Qwen3-style template (the tiny model never closes the block: its whole answer is then
reasoning, equal to the unsplit server's content).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from anyquant_serve.reasoning import ThinkStream, begins_thinking, split_thinking, thinks
from plugins.serve.tests.servers import serving
from plugins.serve.tests.test_serve_tools import NAME, QWEN25_TEMPLATE, _with_template

#: DeepSeek-R1's template, abridged: the generation prompt opens the <think> block
R1_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
    "{% elif m.role == 'assistant' %}{% set c = m.content %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}"
    "{% endif %}{{ '<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)
#: Qwen3's hybrid template, abridged: the model opens the block itself; enable_thinking=false closes an empty one
QWEN3_TEMPLATE = (
    "{% for m in messages %}{% set c = m.content %}{% if m.role == 'assistant' and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

ANSWERS = [
    ("Let me see.\nIt is 4.\n</think>\n\nThe answer is 4.", True, ("Let me see.\nIt is 4.\n", "The answer is 4.")),
    ("<think>\nHmm.\n</think>\n\nFour.", False, ("\nHmm.\n", "Four.")),
    ("  <think>Hm</think>Four", False, ("Hm", "Four")),
    ("Still thinking when cut off", True, ("Still thinking when cut off", "")),
    ("No block at all.", False, (None, "No block at all.")),
    ("</think> four", False, (None, "</think> four")),
    ("a < b </thin k> c</think>  d <think> e", True, ("a < b </thin k> c", "d <think> e")),
    ("<thinking is not the tag", False, (None, "<thinking is not the tag")),
]


def test_templates_and_prompts() -> None:
    assert thinks(R1_TEMPLATE) and thinks(QWEN3_TEMPLATE) and not thinks(QWEN25_TEMPLATE)
    assert begins_thinking("<｜User｜>Hi<｜Assistant｜><think>\n")
    assert not begins_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not begins_thinking("<|im_start|>assistant\n") and not begins_thinking("")


@pytest.mark.parametrize(("text", "thinking", "expected"), ANSWERS)
def test_split(text: str, thinking: bool, expected: tuple[str | None, str]) -> None:
    assert split_thinking(text, thinking) == expected


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
@pytest.mark.parametrize(("text", "thinking", "expected"), ANSWERS)
def test_stream_joins_into_the_split(text: str, thinking: bool, expected: Any, size: int) -> None:
    stream = ThinkStream(thinking)
    steps = [stream.feed(text[at : at + size]) for at in range(0, len(text), size)] + [stream.finish()]
    reasoning, content = "".join(r for r, _ in steps), "".join(c for _, c in steps)
    assert (reasoning, content) == (expected[0] or "", expected[1])
    if size == 1 and expected[0] and len(expected[0]) > 8:
        assert sum(1 for r, _ in steps if r) > 1  # the reasoning goes out as it comes


# ---------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("thinking")
    return {
        "r1": _with_template(root / "smol-r1.gguf", R1_TEMPLATE),
        "qwen3": _with_template(root / "smol-qwen3.gguf", QWEN3_TEMPLATE),
    }


def _client(base: str) -> Any:
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


def _servers(*args: str) -> Iterator[Any]:
    for module in ("starlette", "uvicorn", "sse_starlette", "xgrammar", "openai"):
        pytest.importorskip(module)
    with serving(*args, "--model-name", NAME) as base:
        yield _client(base)


MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def _streamed(client: Any, **request: Any) -> tuple[str, str, str | None]:
    reasoning, content, reason = [], [], None
    for event in client.chat.completions.create(model=NAME, messages=MESSAGES, stream=True, **request):
        delta = event.choices[0].delta
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        content.append(delta.content or "")
        reason = event.choices[0].finish_reason or reason
    assert sum(1 for r in reasoning if r) > 1 or not "".join(reasoning)  # streamed as it comes
    return "".join(reasoning), "".join(content), reason


@pytest.mark.model
@pytest.mark.slow
def test_an_open_block_is_reasoning(models: dict[str, Path]) -> None:
    """R1-style: the prompt opens the block, the tiny model never closes it: the whole answer is reasoning (equal
    to the content of a server that does not split), streamed the same; ``--reasoning-format none`` and a
    constrained answer are content."""
    request = {"max_tokens": 24, "temperature": 0}
    for unsplit in _servers(str(models["r1"]), "--reasoning-format", "none"):
        plain = unsplit.chat.completions.create(model=NAME, messages=MESSAGES, **request).choices[0].message
        assert plain.content and "reasoning_content" not in (plain.model_extra or {})
    for client in _servers(str(models["r1"])):
        whole = client.chat.completions.create(model=NAME, messages=MESSAGES, **request).choices[0]
        assert whole.message.model_extra["reasoning_content"] == plain.content and whole.message.content == ""
        assert _streamed(client, **request) == (plain.content, "", whole.finish_reason)
        schema = {"type": "object", "properties": {"n": {"enum": [3, 4, 5]}}, "required": ["n"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        guided = client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=40, temperature=0, response_format=fmt
        ).choices[0]
        assert json.loads(guided.message.content)["n"] in (3, 4, 5)
        assert "reasoning_content" not in (guided.message.model_extra or {})


@pytest.mark.model
@pytest.mark.slow
def test_no_open_block_is_content(models: dict[str, Path]) -> None:
    """Qwen3-style: the model would open the block itself; the tiny one does not, so the answer is content, as
    without the split."""
    request = {"max_tokens": 16, "temperature": 0}
    for client in _servers(str(models["qwen3"])):
        whole = client.chat.completions.create(model=NAME, messages=MESSAGES, **request).choices[0].message
        assert whole.content and "reasoning_content" not in (whole.model_extra or {})
        reason = client.chat.completions.create(model=NAME, messages=MESSAGES, **request).choices[0].finish_reason
        assert _streamed(client, **request) == ("", whole.content, reason)


def test_reasoning_sent_back_reaches_the_template() -> None:
    """A client sends the assistant message back as the server returned it, ``reasoning_content`` and all (or
    vLLM's newer ``reasoning``): accepted, and passed to the template under the names Qwen3's and gpt-oss's read."""
    from anyquant_serve.schema import validate

    for key in ("reasoning_content", "reasoning"):
        body = {
            "model": "m",
            "messages": [
                {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4", key: "Two and two.", "refusal": None},
                {"role": "user", "content": "And 3 + 3?"},
            ],
        }
        request = validate(body, chat=True)
        answer = request.messages[1].template_dict()  # type: ignore[union-attr]
        assert answer == {"role": "assistant", "content": "4", "reasoning_content": "Two and two.",
                          "thinking": "Two and two."}  # fmt: skip
        assert "reasoning_content" not in request.messages[0].template_dict()  # type: ignore[union-attr]
