"""Tool calls in ``anyquant serve`` (issue #43 §2): ``tools``, ``tool_choice`` (``none``, ``auto``, ``required``, a
named function) and ``parallel_tool_calls`` on chat, rendered by the checkpoint's own chat template, the answer's
tool-call text parsed back into OpenAI ``tool_calls`` (streamed as OpenAI streams them: the arguments piece by
piece, joining into the unstreamed arguments), ``tool`` messages accepted.

The parsers (Hermes/Qwen ``<tool_call>``, Llama 3 JSON, Mistral ``[TOOL_CALLS]``), the streaming of their calls
(``ToolStream``, and the server's event stream read by the openai client's accumulator) and the request schema are
tested on fixed inputs; the rest against real server processes: the bundled model (its template has no tool support: a
400) and the bundled model with Qwen2.5's chat template written into a copy of its GGUF, where ``required`` and a
named function constrain the answer so that even this tiny model's call parses and validates (``jsonschema``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from anyquant_serve.schema import RequestError, validate
from anyquant_serve.tools import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    QWEN3_XML,
    ToolStream,
    call_schema,
    detect_format,
    parse_tool_calls,
    supports_tools,
)
from plugins.serve.tests.servers import serving

NAME = "smol"
ROOT = Path(__file__).resolve().parents[3]

#: Qwen2.5-Instruct's chat template (Hermes-style tool calls), as its tokenizer_config.json holds it
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are '
    'provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
LLAMA3_SNIPPET = (
    '{%- if tools is not none %}{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.' }}{%- endif %}{{- '<|python_tag|>' }}"
)
MISTRAL_SNIPPET = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]"
#: Qwen3-Coder's chat template, abridged: tools listed as XML, calls written and rendered as <function=...> blocks
QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.\\n\\n# Tools\\n\\nYou have access to"
    " the following functions:\\n\\n<tools>' }}{%- for tool in tools %}{%- set f = tool.function %}"
    "{{- '\\n<function>\\n<name>' + f.name + '</name>\\n<description>' + f.description + '</description>\\n"
    "<parameters>' + (f.parameters | tojson) + '</parameters>\\n</function>' }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n"
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "</function>\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + (m.content or '') }}{%- for call in m.tool_calls %}"
    "{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}"
    "{%- for k, v in call.function.arguments | items %}{{- '<parameter=' + k + '>\\n' }}"
    "{{- v if v is string else v | tojson }}{{- '\\n</parameter>\\n' }}{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response>"
    "<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "minLength": 1, "maxLength": 8}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]


# ---------------------------------------------------------------------- formats and parsers


def test_template_detection() -> None:
    assert supports_tools(QWEN25_TEMPLATE) and detect_format(QWEN25_TEMPLATE) is HERMES
    assert supports_tools(LLAMA3_SNIPPET) and detect_format(LLAMA3_SNIPPET) is LLAMA3_JSON
    assert supports_tools(MISTRAL_SNIPPET) and detect_format(MISTRAL_SNIPPET) is MISTRAL
    assert not supports_tools(CHATML)
    assert not supports_tools("{{ 'tools' }}{% set x = 1 %}")  # the word, not the variable
    assert supports_tools("{% for t in tools %}{{ t }}{% endfor %}")


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_parser() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, HERMES)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    two = "Let me check.\n" + text + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    content, calls = parse_tool_calls(two, HERMES)
    assert content == "Let me check." and [n for n, _ in _calls(calls)] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls}) == 2
    # arguments as JSON text, and a call the model did not close before its end
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}', HERMES)
    assert content is None and _calls(calls) == [("f", {"a": 1})]
    for bad in ("no call at all", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_tool_calls(bad, HERMES) == (bad, [])


def test_llama3_parser() -> None:
    content, calls = parse_tool_calls('{"name": "get_time", "parameters": {"zone": "UTC"}}', LLAMA3_JSON)
    assert content is None and _calls(calls) == [("get_time", {"zone": "UTC"})]
    text = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1]}}'
    assert _calls(parse_tool_calls(text, LLAMA3_JSON)[1]) == [("a", {}), ("b", {"x": [1]})]
    for plain in ("The answer is 4.", '{"not": "a call"}', '{"name": "a", "parameters": {}} and more'):
        assert parse_tool_calls(plain, LLAMA3_JSON) == (plain, [])


def test_mistral_parser() -> None:
    text = 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "b", "arguments": {}}]'
    content, calls = parse_tool_calls(text, MISTRAL)
    assert content == "Sure." and _calls(calls) == [("get_time", {"zone": "UTC"}), ("b", {})]
    newer = '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]b[ARGS]{}'
    assert _calls(parse_tool_calls(newer, MISTRAL)[1]) == [("get_time", {"zone": "UTC"}), ("b", {})]
    for plain in ("Hello", "[TOOL_CALLS]not json"):
        assert parse_tool_calls(plain, MISTRAL) == (plain, [])


XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>"
TYPED: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "typed",
        "description": "Every JSON type",
        "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "x": {"type": "number"},
                "flag": {"type": "boolean"},
                "code": {"type": "string"},
                "opts": {"type": "object"},
                "ids": {"type": "array", "items": {"type": "integer"}},
                "maybe": {"type": ["integer", "null"]},
            },
        },
    },
}


def test_qwen3_xml_parser() -> None:
    """Qwen3-Coder's XML calls: each value read by its parameter's type (a string as written, even when it looks
    like a number; JSON for the others; what does not parse as the type stays text), arguments as JSON text."""
    assert detect_format(QWEN3_CODER_TEMPLATE) is QWEN3_XML and supports_tools(QWEN3_CODER_TEMPLATE)
    content, calls = parse_tool_calls("I will look.\n" + XML_CALL + "\n" + XML_CALL, QWEN3_XML, TOOLS)
    assert content == "I will look." and _calls(calls) == [("get_weather", {"city": "San Jose", "unit": "celsius"})] * 2
    body = "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n"
        for k, v in [("n", "42"), ("x", "2.5"), ("flag", "true"), ("code", "007"), ("opts", '{"a": [1]}'),
                     ("ids", "[1, 2]"), ("maybe", "null"), ("extra", "3")]
    )  # fmt: skip
    typed = parse_tool_calls(f"<tool_call>\n<function=typed>\n{body}</function>\n</tool_call>", QWEN3_XML, [TYPED])
    assert _calls(typed[1]) == [
        ("typed", {"n": 42, "x": 2.5, "flag": True, "code": "007", "opts": {"a": [1]}, "ids": [1, 2], "maybe": None,
                   "extra": "3"})
    ]  # fmt: skip
    wrong = "<tool_call>\n<function=typed>\n<parameter=n>\nmany\n</parameter>\n<parameter=flag>\n1\n</parameter>\n"
    assert _calls(parse_tool_calls(wrong + "</function>", QWEN3_XML, [TYPED])[1]) == [
        ("typed", {"n": "many", "flag": "1"})
    ]  # cut off before </tool_call>: the call as far as it was closed
    multiline = "<tool_call>\n<function=typed>\n<parameter=code>\ndef f():\n    return 1\n\n</parameter>\n</function>"
    assert _calls(parse_tool_calls(multiline, QWEN3_XML, [TYPED])[1]) == [
        ("typed", {"code": "def f():\n    return 1\n"})
    ]
    for plain in ("No call.", "<tool_call>\n{not xml}\n</tool_call>", "<tool_call>\n<function=f>\n"):
        assert parse_tool_calls(plain, QWEN3_XML, TOOLS) == (plain, [])
    # read in one pass (a parameter without its closing tag ends the list): 20,000 unclosed parameters take
    # milliseconds (a regular expression took a minute)
    unclosed = "<tool_call>\n<function=get_time>\n" + "<parameter=zone>\nx\n" * 20_000 + "</function>"
    assert _calls(parse_tool_calls(unclosed, QWEN3_XML, TOOLS)[1]) == [("get_time", {})]
    # streamed: the content as it comes, the calls whole at the end
    sent, deltas, reason = streamed_answer("Sure. " + XML_CALL, QWEN3_XML, 3)
    assert sent == "Sure. " and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in _joined(deltas)] == [
        ("get_weather", {"city": "San Jose", "unit": "celsius"})
    ]


def test_arguments_are_the_model_text() -> None:
    """The arguments are the model's own text of the arguments object (OpenAI's are), as they stream."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Zürich" ,  "unit": "celsius"}}\n</tool_call>'
    assert parse_tool_calls(text, HERMES)[1][0]["function"]["arguments"] == '{"city":"Zürich" ,  "unit": "celsius"}'
    # JSON text in a string: that text; none (or null): {}
    assert parse_tool_calls('{"name": "a", "parameters": "{\\"x\\":1}"}', LLAMA3_JSON)[1][0]["function"] == {
        "name": "a",
        "arguments": '{"x":1}',
    }
    for none in ('{"name": "a"}', '{"name": "a", "parameters": null}'):
        assert parse_tool_calls(none, LLAMA3_JSON)[1][0]["function"]["arguments"] == "{}"
    # one name and at most one arguments member: anything else is no call
    for bad in ('{"name": "a", "arguments": {}, "parameters": {}}', '{"name": "a", "name": "b", "arguments": {}}'):
        assert parse_tool_calls(bad, LLAMA3_JSON) == (bad, [])
    for bad in ('[TOOL_CALLS][{"name": "a", "arguments": {}},]', "[TOOL_CALLS][]", '[TOOL_CALLS]["a"]'):
        assert parse_tool_calls(bad, MISTRAL) == (bad, [])


def grammar_accepts(grammar: Any, text: str) -> bool:
    """Whether the xgrammar ``grammar`` accepts ``text`` whole (and then ends): xgrammar's own matcher, no tokenizer."""
    xgrammar = pytest.importorskip("xgrammar")
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_grammar(grammar)
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return bool(matcher.accept_string(text) and matcher.is_terminated())


def streamed_answer(text: str, fmt: Any, size: int, reason: str = "stop") -> tuple[str, list[dict[str, Any]], str]:
    """``text`` fed to a :class:`ToolStream` (of :data:`TOOLS`) ``size`` characters at a time: the content sent, the
    ``delta.tool_calls`` entries sent, and the finish reason."""
    stream = ToolStream(fmt, TOOLS)
    content, deltas = "", list[dict[str, Any]]()
    for i in range(0, len(text), size):
        sent, more = stream.feed(text[i : i + size])
        content, deltas = content + sent, deltas + more
    sent, more = stream.finish()
    return content + sent, deltas + more, stream.reason(reason)


def _joined(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls the entries make, as a client puts them together by ``index``, with how many argument pieces
    each came in; each call's first entry carries its id, type and name with empty arguments."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        if delta["index"] not in calls:
            assert delta["id"].startswith("call_") and delta["type"] == "function", delta
            assert delta["function"]["arguments"] == "" and delta["function"]["name"], delta
            calls[delta["index"]] = {"id": delta["id"], "name": delta["function"]["name"], "arguments": "", "n": 0}
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}, delta
            assert delta["function"]["arguments"], delta
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
            calls[delta["index"]]["n"] += 1
    assert list(calls) == list(range(len(calls)))  # indexes 0, 1, ... in the order the calls began
    return list(calls.values())


WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME_CALL = {"name": "get_time", "arguments": {"zone": "JST"}}
#: answers with content before two parallel calls, in each format (the calls' arguments as models space them)
ANSWERS = [
    (
        HERMES,
        "Let me check <tool_ first.\n"
        + "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in (WEATHER_CALL, TIME_CALL)),
    ),
    # the name after the arguments: they go out once it is read
    (HERMES, '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>'),
    (
        LLAMA3_JSON,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"zone": "JST"}}',
    ),
    (MISTRAL, "Sure.[TOOL_CALLS]" + json.dumps([WEATHER_CALL, TIME_CALL])),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city":"Paris","unit":"celsius"}[TOOL_CALLS]get_time[ARGS]{"zone":"X"}'),
    (MISTRAL, "".join("[TOOL_CALLS]" + json.dumps(c, separators=(",", ":")) for c in (WEATHER_CALL, TIME_CALL))),
]


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize(("fmt", "text"), ANSWERS, ids=[f"{f.name}-{i}" for i, (f, _) in enumerate(ANSWERS)])
def test_stream_sends_content_then_arguments_piece_by_piece(fmt: Any, text: str, size: int) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    content, calls = parse_tool_calls(text, fmt)
    assert calls
    sent, deltas, reason = streamed_answer(text, fmt, size)
    assert reason == "tool_calls" and sent.strip() == (content or "")
    streamed = _joined(deltas)
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]  # the pieces join into the unstreamed arguments: the model's text
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in streamed:
        jsonschema.validate(json.loads(call["arguments"]), params[call["name"]])
        if size == 1 and text.rfind(call["name"], 0, text.find(call["arguments"])) >= 0:  # the name first
            assert call["n"] == len(call["arguments"])  # one piece a character: the arguments as they come


def test_stream_holds_what_may_be_a_call() -> None:
    text = 'Checking <tool!\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    stream = ToolStream(HERMES)
    assert stream.feed(text[:14]) == ("Checking ", [])  # "<tool" may begin a call
    assert stream.feed(text[14:22]) == ("<tool!\n", [])  # it did not; "<tool_" may
    assert stream.feed(text[22:40]) == ("", [])  # a call: the name is not read yet
    sent, deltas = stream.feed(text[40:68])  # the name, then the arguments so far
    assert sent == "" and deltas[0]["function"] == {"name": "get_time", "arguments": ""}
    assert deltas[1] == {"index": 0, "function": {"arguments": '{"zone'}}
    assert stream.feed(text[68:]) == ("", [{"index": 0, "function": {"arguments": '": "UTC"}'}}])
    assert stream.finish() == ("", []) and stream.called and stream.reason("length") == "tool_calls"
    assert stream.calls[0]["id"] == deltas[0]["id"]
    plain = ToolStream(HERMES)
    sent = "".join(plain.feed(c)[0] for c in "a <tool_ca")
    assert sent == "a " and plain.finish() == ("<tool_ca", []) and not plain.called
    llama = ToolStream(LLAMA3_JSON)
    assert llama.feed(" ") == ("", []) and llama.feed("Hi") == (" Hi", []) and llama.feed(" {") == (" {", [])
    llama = ToolStream(LLAMA3_JSON)
    assert llama.feed('{"name": "a", ')[1][0]["function"]["name"] == "a"
    assert llama.feed('"parameters": {}}') == ("", [{"index": 0, "function": {"arguments": "{}"}}])
    assert llama.finish() == ("", []) and _calls(llama.calls) == [("a", {})]
    # arguments as JSON text in a string go out whole once read; none at all: {} at the end
    sent, deltas, _ = streamed_answer('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', HERMES, 1)
    assert [c["arguments"] for c in _joined(deltas)] == ['{"a": 1}'] and len(deltas) == 2
    assert _joined(streamed_answer('{"name": "f"}', LLAMA3_JSON, 1)[1])[0]["arguments"] == "{}"


@pytest.mark.parametrize(
    ("fmt", "text", "reason", "content", "arguments", "finish"),
    [
        # nothing streamed as a call: as unstreamed, the text is the content
        (HERMES, "Hi <tool_call>{not json}</tool_call>", "stop", None, [], "stop"),
        (LLAMA3_JSON, '{"not": "a call"}', "stop", None, [], "stop"),
        (HERMES, '<tool_call>{"name": 3, "arguments": {"a": 1}}', "length", None, [], "length"),
        (MISTRAL, '[TOOL_CALLS]{"arguments": {"a": 1}}', "stop", None, [], "stop"),
        # a call streamed, then the text does not parse: what was sent stands (vLLM's way)
        (HERMES, 'Hi <tool_call>{"name": "f", "arguments": {"a": [1', "length", "Hi ", ['{"a": [1'], "length"),
        (LLAMA3_JSON, '{"name": "f", "parameters": {"a": 1}} and more', "stop", "", ['{"a": 1}'], "tool_calls"),
        (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": 2}]', "stop", "", ["{}"], "tool_calls"),
    ],
)
def test_stream_of_calls_that_do_not_parse(
    fmt: Any, text: str, reason: str, content: str | None, arguments: list[str], finish: str
) -> None:
    """What a client sees when the text turns out to hold no well-formed call: the text as content, as unstreamed,
    when no call was streamed (``content`` ``None``); else what was sent, and nothing more."""
    assert parse_tool_calls(text, fmt) == (text, [])
    for size in (1, 4, 1000):
        sent, deltas, why = streamed_answer(text, fmt, size, reason)
        expected = (text if content is None else content, arguments, finish)
        assert (sent, [c["arguments"] for c in _joined(deltas)], why) == expected


def test_sse_streams_arguments_as_the_openai_client_reads_them() -> None:
    """The server's stream of a scripted answer (``app._sse``) read by the openai client's own accumulator: the
    message it builds equals the unstreamed answer's, and the arguments came piece by piece."""
    import asyncio

    openai = pytest.importorskip("openai")
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from anyquant_serve.app import _Choice, _choice, _Job, _Shapes, _sse
    from anyquant_serve.scheduler import Finished

    text = "Checking.\n" + "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in (WEATHER_CALL, TIME_CALL))
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # about a token each

    class Work:
        def cancel(self) -> None:
            pass

    async def stream() -> list[str]:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        for item in [*pieces, Finished("stop", 5, len(pieces))]:
            queue.put_nowait((0, item))
        job = _Job(ids=[], params=None, max_tokens=100, stream=True, include_usage=False, tools=HERMES)
        head = {"id": "chatcmpl-1", "created": 0, "model": NAME}
        works: list[Any] = [Work()]
        return [event async for event in _sse(queue, works, head, _Shapes(True, False, None), job)]

    events = asyncio.run(stream())
    assert events[-1] == "[DONE]"
    state: Any = ChatCompletionStreamState()
    pieces_of: dict[int, int] = {}
    for event in events[:-1]:
        chunk = ChatCompletionChunk.model_validate(json.loads(event))
        state.handle_chunk(chunk)
        for delta in chunk.choices[0].delta.tool_calls or ():
            if delta.id is None:
                pieces_of[delta.index] = pieces_of.get(delta.index, 0) + 1
    final = state.get_final_completion().choices[0]
    job = _Job(ids=[], params=None, max_tokens=100, stream=False, include_usage=False, tools=HERMES)
    whole = _choice(_Shapes(True, False, None), job, 0, _Choice(pieces, [], [], Finished("stop", 5, len(pieces))))
    assert final.finish_reason == whole["finish_reason"] == "tool_calls"
    assert final.message.content == "Checking.\n" and whole["message"]["content"] == "Checking."
    got = [(c.function.name, c.function.arguments) for c in final.message.tool_calls or ()]
    assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert got == [(c["name"], json.dumps(c["arguments"])) for c in (WEATHER_CALL, TIME_CALL)]
    assert all(c.id.startswith("call_") for c in final.message.tool_calls or ())
    assert pieces_of[0] > 3 and pieces_of[1] > 3  # the arguments piece by piece, not whole
    assert isinstance(openai.__version__, str)


def test_call_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = call_schema(TOOLS, HERMES)
    jsonschema.validate({"name": "get_time", "arguments": {"zone": "UTC"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", "arguments": {"city": "x", "unit": "celsius"}}, schema)
    named = call_schema(TOOLS, LLAMA3_JSON, "get_weather")
    assert named["properties"]["name"] == {"enum": ["get_weather"]} and "parameters" in named["properties"]


# ---------------------------------------------------------------------- the request schema


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "two tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "pattern"),
        ({"tools": [{"type": "code", "function": {"name": "a"}}]}, "tools", "function"),
        ({"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]}, "tools", "dict"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "bool"),
    ],
)
def test_schema_refuses(extra: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(RequestError) as info:
        validate({**CHAT, **extra}, chat=True)
    assert info.value.param == param and words in info.value.message, info.value.message


def test_schema_takes_tools_and_their_messages() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"model": NAME, "messages": messages, "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False}
    request = validate(body, chat=True)
    assert request.tool_mode() == "auto"  # type: ignore[union-attr]
    rendered = [m.template_dict() for m in request.messages]  # type: ignore[union-attr]
    assert rendered[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "P"}}
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    for choice, mode in (("none", "none"), ("required", "required"), (None, "auto")):
        assert validate({**body, "tool_choice": choice}, chat=True).tool_mode() == mode  # type: ignore[union-attr]
    named = {"type": "function", "function": {"name": "get_time"}}
    assert validate({**body, "tool_choice": named}, chat=True).tool_mode() == "function"  # type: ignore[union-attr]
    assert validate({**CHAT, "tools": []}, chat=True).tool_mode() == "none"  # type: ignore[union-attr]
    with pytest.raises(RequestError):  # completions take no tools
        validate({"model": NAME, "prompt": "x", "tools": TOOLS}, chat=False)


# ---------------------------------------------------------------------- real servers


def _serve(path: str | None) -> Iterator[str]:
    for module in ("starlette", "uvicorn", "sse_starlette", "xgrammar", "openai", "jsonschema"):
        pytest.importorskip(module)
    with serving(*([path] if path else []), "--model-name", NAME) as base:
        yield base


def _with_template(dest: Path, template: str) -> Path:
    """A copy of the bundled GGUF with ``template`` as its chat template."""
    gguf = pytest.importorskip("gguf")
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    import anyquant

    reader = gguf.GGUFReader(str(anyquant.default_model()))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(str(dest), arch=arch, endianess=reader.endianess)
    writer.data_alignment = reader.alignment
    new = {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(gguf.GGUFValueType.STRING, template)}
    copy_with_new_metadata(reader, writer, new, [])
    return dest


@pytest.fixture(scope="module")
def qwen_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path = _with_template(tmp_path_factory.mktemp("tools") / "smol-qwen-template.gguf", QWEN25_TEMPLATE)
    openai = pytest.importorskip("openai")
    for base in _serve(str(path)):
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


def streams_as_whole(client: Any, request: dict[str, Any], whole: Any) -> None:
    """``request`` streamed gives the unstreamed answer ``whole``'s calls (the ``openai`` client's choice) as OpenAI
    streams them: no content, each call's head (index, id, name) once and in order, its arguments' pieces joining
    into ``whole``'s, the last ``finish_reason`` ``tool_calls``."""
    heads, pieces, reasons = [], [], []
    for event in client.chat.completions.create(**request, stream=True):
        assert not event.choices[0].delta.content
        for entry in event.choices[0].delta.tool_calls or ():
            if entry.id is not None:
                heads.append((entry.index, entry.function.name))
            if entry.function.arguments:
                pieces.append((entry.index, entry.function.arguments))
        reasons.append(event.choices[0].finish_reason)
    calls = whole.message.tool_calls
    assert heads == [(i, c.function.name) for i, c in enumerate(calls)] and reasons[-1] == "tool_calls"
    assert ["".join(p for i, p in pieces if i == k) for k in range(len(calls))] == [c.function.arguments for c in calls]


def valid_calls(calls: Any, allowed: list[dict[str, Any]], ids: str = r"call_[0-9a-f]{24}") -> list[str]:
    """The names of ``calls`` (the ``openai`` client's), each checked: a function call whose id matches ``ids``
    (``{name}``: the call's name) naming one of ``allowed``, its arguments valid against that tool's ``parameters``
    (``jsonschema``)."""
    jsonschema = pytest.importorskip("jsonschema")
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in allowed}
    names = []
    for call in calls:
        assert call.type == "function" and re.fullmatch(ids.replace("{name}", call.function.name), call.id), call.id
        assert call.function.name in by_name, call.function.name
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
        names.append(call.function.name)
    return names


MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.mark.model
@pytest.mark.slow
def test_required_and_named_calls_are_well_formed(qwen_client: Any) -> None:
    for seed in (0, 1):
        r = qwen_client.chat.completions.create(
            model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0.8,
            seed=seed,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert valid_calls(choice.message.tool_calls, TOOLS)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = qwen_client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=80, parallel_tool_calls=False
    )
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and valid_calls(calls, [TIME]) == ["get_time"]


@pytest.mark.model
@pytest.mark.slow
def test_streamed_calls_as_openai_streams_them(qwen_client: Any) -> None:
    """Read by the openai client's own streaming helper: each call's arguments come piece by piece, the pieces
    join into the unstreamed answer's arguments (the same request, greedy or seeded) and parse."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]  # the helper parses these
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, extra in ((named, {"temperature": 0}), ("required", {"temperature": 0.8, "seed": 1})):
        request = {"model": NAME, "messages": MESSAGES, "tools": strict, "tool_choice": choice, "max_tokens": 120}
        whole = qwen_client.chat.completions.create(**request, **extra).choices[0]
        pieces: dict[int, list[str]] = {}
        with qwen_client.chat.completions.stream(**request, **extra) as stream:
            for event in stream:
                if event.type == "tool_calls.function.arguments.delta":
                    pieces.setdefault(event.index, []).append(event.arguments_delta)
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == whole.finish_reason == "tool_calls"
        calls = final.message.tool_calls or []
        got = [(c.function.name, c.function.arguments) for c in calls]
        assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
        assert list(pieces) == list(range(len(calls))) and all(len(p) > 1 for p in pieces.values()), pieces
        assert ["".join(p) for p in pieces.values()] == [c.function.arguments for c in calls]
        assert valid_calls(calls, TOOLS) and len({c.id for c in calls}) == len(calls)
        assert [c.function.parsed_arguments for c in calls] == [json.loads(c.function.arguments) for c in calls]
        if choice is named:
            assert [c.function.name for c in calls] == ["get_weather"]


#: a tool round trip as a client sends it back: the assistant's call, then the tool's answer
CALLED: dict[str, Any] = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_abc",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
        }
    ],
}
ANSWERED: dict[str, Any] = {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21}'}


@pytest.mark.model
@pytest.mark.slow
def test_auto_none_and_a_tool_round_trip(qwen_client: Any) -> None:
    history = [*MESSAGES, CALLED, ANSWERED]
    for choice in ("auto", "none"):
        r = qwen_client.chat.completions.create(
            model=NAME, messages=history, tools=TOOLS, tool_choice=choice, max_tokens=16, temperature=0
        )
        c = r.choices[0]
        if c.message.tool_calls:  # whatever the tiny model writes: a call only when it parses as one
            assert choice == "auto" and c.finish_reason == "tool_calls"
            assert all(json.loads(t.function.arguments) is not None for t in c.message.tool_calls)
        else:
            assert c.finish_reason in ("stop", "length") and isinstance(c.message.content, str)


@pytest.mark.model
@pytest.mark.slow
def test_refusals(qwen_client: Any) -> None:
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="one output constraint"):
        qwen_client.chat.completions.create(
            model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=8,
            response_format={"type": "json_object"},
        )  # fmt: skip
    for base in _serve(None):  # the bundled template never reads tools
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        with pytest.raises(openai.BadRequestError, match="chat template has no tool support") as info:
            client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8)
        assert info.value.body["param"] == "tools"
        r = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=4)
        assert r.choices[0].message.tool_calls is None


@pytest.mark.model
@pytest.mark.slow
def test_qwen3_xml_required_and_named_calls(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen3-Coder's template on the bundled model: ``required`` and a named function constrain the answer to XML
    calls whose values follow each parameter's schema (enum, string lengths), so they parse and validate; the
    tools render through the template; streamed, the calls arrive whole at the end, equal to the unstreamed ones."""
    path = _with_template(tmp_path_factory.mktemp("coder") / "smol-coder.gguf", QWEN3_CODER_TEMPLATE)
    openai = pytest.importorskip("openai")
    for base in _serve(str(path)):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice, extra in ((named, {"temperature": 0}), ("required", {"temperature": 0.8, "seed": 2})):
            request = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 160}
            whole = client.chat.completions.create(**request, **extra).choices[0]
            assert whole.finish_reason == "tool_calls", whole
            names = valid_calls(whole.message.tool_calls, TOOLS)
            assert names and (choice != named or set(names) == {"get_weather"})
            deltas = []
            for event in client.chat.completions.create(**request, **extra, stream=True):
                deltas += [d.model_dump(exclude_none=True) for d in event.choices[0].delta.tool_calls or ()]
            streamed = _joined(deltas)
            assert [(c["name"], c["arguments"]) for c in streamed] == [
                (c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()
            ]
