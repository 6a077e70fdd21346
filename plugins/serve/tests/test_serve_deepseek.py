"""DeepSeek's tool calls on ``anyquant serve`` (issue #43 §2): V3.1's ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}``
and V3's / R1's ``function<｜tool▁sep｜>name`` with a fenced JSON object, between ``<｜tool▁calls▁begin｜>`` and
``<｜tool▁calls▁end｜>``; and ``--chat-template FILE``, which is how a client gets tools to a DeepSeek checkpoint
(their own templates render calls in the history but never read ``tools``, as vLLM's and llama.cpp's users know).

The parser and its stream are tested on fixed answers. The rest runs against real server processes on a copy of the
bundled GGUF whose unused special tokens are renamed to DeepSeek's markers (special tokens, as in DeepSeek's
tokenizer: a plain decode drops them, the server's keeps them), with a DeepSeek-V3.1-style template given by
``--chat-template``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from anyquant_serve.tools import (
    DEEPSEEK_V3,
    DEEPSEEK_V31,
    DS_CALL,
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    DS_SEP,
    deepseek_calls,
    detect_format,
    parse_tool_calls,
)
from plugins.serve.tests.servers import serving, with_special_tokens
from plugins.serve.tests.test_serve_tools import (
    ANSWERED,
    CALLED,
    NAME,
    TIME,
    TOOLS,
    grammar_accepts,
    streamed_answer,
    streams_as_whole,
    valid_calls,
)

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

#: a DeepSeek-V3.1-style chat template: the tools described in the system prompt (as vLLM's
#: tool_chat_template_deepseekv31.jinja does), calls and tool results rendered with DeepSeek's markers
V31_TEMPLATE = (
    "{{- bos_token -}}{%- if tools -%}{{- '## Tools\\nYou have access to the following tools:\\n\\n' -}}"
    "{%- for tool in tools %}{{ '### ' + tool.function.name + '\\nParameters: ' + (tool.function.parameters | tojson) "
    "+ '\\n\\n' }}{% endfor -%}"
    "{{- 'IMPORTANT: ALWAYS adhere to this exact format for tool use:\\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    "tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜><｜tool▁calls▁end｜>\\n\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{ '<｜Assistant｜><｜tool▁calls▁begin｜>' }}"
    "{%- for t in m.tool_calls %}{{ '<｜tool▁call▁begin｜>' + t.function.name + '<｜tool▁sep｜>' "
    "+ (t.function.arguments | tojson) + '<｜tool▁call▁end｜>' }}{% endfor %}{{ '<｜tool▁calls▁end｜>' }}"
    "{%- elif m.role == 'assistant' %}{{ '<｜Assistant｜>' + m.content }}"
    "{%- elif m.role == 'tool' %}{{ '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}{% endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif -%}"
)
#: DeepSeek-V3's way of writing a call in the history (its type, the name, a fenced JSON object)
V3_CALL = "'<｜tool▁call▁begin｜>' + t.type + '<｜tool▁sep｜>' + t.function.name + '\\n```json\\n' + args + '\\n```'"

#: DeepSeek's markers, written over the bundled tokenizer's unused special tokens 3..
MARKERS = [DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP, "<｜User｜>", "<｜Assistant｜>"]

V31_ANSWER = (
    f'Let me check.{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris", "unit": "celsius"}}{DS_CALL_END}'
    f'{DS_CALL}get_time{DS_SEP}{{"zone":"JST"}}{DS_CALL_END}{DS_CALLS_END}'
)
V3_ANSWER = (
    f'{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Paris", "unit": "celsius"}}\n```'
    f"{DS_CALL_END}{DS_CALLS_END}"
)


# ---------------------------------------------------------------------- the parser, its stream, the grammar


def test_template_detection() -> None:
    assert detect_format(V31_TEMPLATE) is DEEPSEEK_V31
    assert detect_format(V31_TEMPLATE.replace("'<｜tool▁call▁begin｜>' + t.function.name", V3_CALL)) is DEEPSEEK_V3
    assert DEEPSEEK_V31.special and DEEPSEEK_V3.special


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_both_shapes_parse() -> None:
    content, calls = parse_tool_calls(V31_ANSWER, DEEPSEEK_V31)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone":"JST"}')]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    content, calls = parse_tool_calls(V3_ANSWER, DEEPSEEK_V3)
    assert content is None and _calls(calls) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    # either shape whichever the template writes (as vLLM's two parsers read them)
    assert _calls(parse_tool_calls(V3_ANSWER, DEEPSEEK_V31)[1]) == _calls(calls)
    # text after the calls is content too; no markers: all content
    assert parse_tool_calls(V3_ANSWER + " Done.", DEEPSEEK_V3)[0] == "Done."
    assert parse_tool_calls("It is sunny.", DEEPSEEK_V31) == ("It is sunny.", [])


@pytest.mark.parametrize(
    "broken",
    [
        V31_ANSWER[: V31_ANSWER.rfind(DS_CALL_END)],  # the last call cut off (max_tokens)
        f"{DS_CALLS}{DS_CALL}get_time{DS_SEP}not json{DS_CALL_END}{DS_CALLS_END}",
        f"{DS_CALLS}{DS_CALL}get_time{DS_SEP}[1]{DS_CALL_END}{DS_CALLS_END}",  # arguments not an object
        f'{DS_CALLS}{DS_CALL}get_time{{"zone": "X"}}{DS_CALL_END}{DS_CALLS_END}',  # no separator
        f"{DS_CALLS}{DS_CALL}two words{DS_SEP}{{}}{DS_CALL_END}{DS_CALLS_END}",  # not a name
        f'{DS_CALLS}{DS_CALL}get_time{DS_SEP}{{"zone": "X"}} trailing{DS_CALL_END}{DS_CALLS_END}',
    ],
)
def test_a_broken_answer_is_content(broken: str) -> None:
    assert parse_tool_calls(broken, DEEPSEEK_V31) == (broken, [])


def test_hostile_answers_parse_in_linear_time() -> None:
    import time

    many = DS_CALLS + (DS_CALL + "get_time" + DS_SEP + '{"zone": "X"}' + DS_CALL_END) * 20_000
    start = time.perf_counter()
    assert len(parse_tool_calls(many, DEEPSEEK_V31)[1]) == 20_000
    unclosed = DS_CALLS + (DS_CALL + "get_time" + DS_SEP) * 20_000
    assert parse_tool_calls(unclosed, DEEPSEEK_V31) == (unclosed, [])
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("text", [V31_ANSWER, V3_ANSWER, "plain <｜tool▁ text"])
def test_stream_joins_into_the_whole_answer(text: str, size: int) -> None:
    """Content goes out until the calls' marker; the calls, read whole at the end, equal the unstreamed ones."""
    sent, entries, reason = streamed_answer(text, DEEPSEEK_V31, size)
    whole_content, calls = parse_tool_calls(text, DEEPSEEK_V31)
    assert sent == (whole_content or "") if calls else sent == text
    heads = [(e["index"], e["function"]["name"]) for e in entries if "id" in e]
    assert heads == [(i, c["function"]["name"]) for i, c in enumerate(calls)]
    assert "".join(e["function"]["arguments"] for e in entries) == "".join(a for _, a in _calls(calls))
    assert reason == ("tool_calls" if calls else "stop")


def test_the_constraint_writes_the_templates_shape() -> None:
    """``required``'s grammar: V3.1's name, separator and arguments' schema; V3's type, name and fence."""
    options = deepseek_calls(TOOLS, DEEPSEEK_V31, "get_time")
    assert options == [(f"{DS_CALL}get_time{DS_SEP}", TIME["function"]["parameters"], DS_CALL_END)]
    (begin, _, end), _ = deepseek_calls(TOOLS, DEEPSEEK_V3)
    assert (begin, end) == (f"{DS_CALL}function{DS_SEP}get_weather\n```json\n", f"\n```{DS_CALL_END}")
    xgrammar = pytest.importorskip("xgrammar")
    from anyquant_runtime.grammar import OutputFormat, _named_calls_grammar

    fmt = OutputFormat.named_calls(deepseek_calls(TOOLS, DEEPSEEK_V31), DS_CALLS, DS_CALLS_END, 2)
    grammar = _named_calls_grammar(json.loads(fmt.spec))
    assert isinstance(grammar, xgrammar.Grammar)
    one = f'{DS_CALLS}{DS_CALL}get_time{DS_SEP}{{"zone": "JST"}}{DS_CALL_END}{DS_CALLS_END}'
    two = V31_ANSWER[len("Let me check.") :].replace('{"zone":"JST"}', '{"zone": "JST"}')  # the grammar's spacing
    for text, ok in ((one, True), (one.replace("get_time", "get_news"), False), (two, True), (one * 2, False)):
        assert grammar_accepts(grammar, text) == ok, text


# ---------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def deepseek_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("deepseek")
    template = folder / "deepseek-v31.jinja"
    template.write_text(V31_TEMPLATE, encoding="utf-8")
    return with_special_tokens(folder / "smol-deepseek.gguf", MARKERS), template


@pytest.fixture(scope="module")
def deepseek_client(deepseek_files: tuple[Path, Path]) -> Iterator[Any]:
    for module in ("starlette", "uvicorn", "sse_starlette", "xgrammar", "openai", "jsonschema"):
        pytest.importorskip(module)
    import openai

    model, template = deepseek_files
    with serving(str(model), "--model-name", NAME, "--chat-template", str(template)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.model
def test_the_template_file_renders_tools_and_history(deepseek_files: tuple[Path, Path]) -> None:
    """``--chat-template``'s template takes over the checkpoint's: the tools in the prompt, a call and its result
    sent back rendered with the markers, which are special tokens (a plain decode drops them)."""
    import anyquant
    from anyquant_serve.scheduler import ModelAdapter

    model, template = deepseek_files
    adapter = ModelAdapter(anyquant.load(str(model)))
    assert "<|im_start|>" in (adapter.chat_template() or "")  # the checkpoint's own (SmolLM2's ChatML)
    adapter.use_chat_template(template.read_text(encoding="utf-8"))
    assert detect_format(adapter.chat_template() or "") is DEEPSEEK_V31
    ids = adapter.encode_chat([*MESSAGES, CALLED, ANSWERED], TOOLS)
    prompt = adapter.decode(ids, special=True)
    assert "### get_weather\nParameters: " in prompt and prompt.endswith("<｜Assistant｜>")
    assert f"<｜Assistant｜>{DS_CALLS}{DS_CALL}get_weather{DS_SEP}" in prompt  # the call sent back, in V3.1's shape
    assert DS_CALL not in adapter.decode(ids)  # special tokens, as in DeepSeek's tokenizer
    with pytest.raises(anyquant.ParameterError, match="does not compile"):
        adapter.use_chat_template("{% if %}")


@pytest.mark.model
@pytest.mark.slow
def test_required_and_named_calls(deepseek_client: Any) -> None:
    """``required`` and a named function give well-formed calls in V3.1's shape, parsed back into ``tool_calls``
    (the markers decoded, no marker left in any text); streamed, the calls equal the unstreamed ones."""
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, extra in ((named, {"temperature": 0}), ("required", {"temperature": 0.8, "seed": 5})):
        request = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 400}
        whole = deepseek_client.chat.completions.create(**request, **extra).choices[0]
        assert whole.finish_reason == "tool_calls" and not whole.message.content, whole
        names = valid_calls(whole.message.tool_calls, TOOLS)
        assert names and (choice != named or names == ["get_time"])
        streams_as_whole(deepseek_client, {**request, **extra}, whole)


@pytest.mark.model
@pytest.mark.slow
def test_auto_and_a_round_trip(deepseek_client: Any) -> None:
    """``auto`` after a call and its result: whatever the tiny model writes comes back as content or as calls that
    parse, with no marker left in the content."""
    for choice in ("auto", "none"):
        r = deepseek_client.chat.completions.create(
            model=NAME, messages=[*MESSAGES, CALLED, ANSWERED], tools=TOOLS, tool_choice=choice, max_tokens=24,
            temperature=0,
        )  # fmt: skip
        c = r.choices[0]
        if c.message.tool_calls:
            assert choice == "auto" and c.finish_reason == "tool_calls"
            valid_calls(c.message.tool_calls, TOOLS)
        else:
            assert c.finish_reason in ("stop", "length") and isinstance(c.message.content, str)


def test_the_flag_refuses_a_bad_file(tmp_path: Path) -> None:
    from anyquant.errors import ParameterError
    from anyquant_serve.plugin import CHAT_TEMPLATE_MAX_BYTES, _chat_template_file

    assert _chat_template_file(None) is None
    with pytest.raises(ParameterError, match="No such file"):
        _chat_template_file(str(tmp_path / "missing.jinja"))
    (tmp_path / "big.jinja").write_bytes(b"x" * (CHAT_TEMPLATE_MAX_BYTES + 1))
    with pytest.raises(ParameterError, match="larger than"):
        _chat_template_file(str(tmp_path / "big.jinja"))
    (tmp_path / "latin1.jinja").write_bytes(b"\xe9t\xe9")
    with pytest.raises(ParameterError, match="not UTF-8"):
        _chat_template_file(str(tmp_path / "latin1.jinja"))
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ParameterError, match="empty"):
        _chat_template_file(str(tmp_path / "empty.jinja"))
    (tmp_path / "ok.jinja").write_text(V31_TEMPLATE, encoding="utf-8")
    assert _chat_template_file(str(tmp_path / "ok.jinja")) == V31_TEMPLATE
