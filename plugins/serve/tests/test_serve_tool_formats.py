"""The tool-call formats of the families beyond Hermes, Llama 3, Mistral, Qwen3-Coder and DeepSeek V3/V3.1 (issue #43
§2): DeepSeek-V3.2's DSML, Kimi K2's sections, GLM-4.5's ``<arg_key>``/``<arg_value>``, Granite's ``<|tool_call|>``,
``functools[...]`` (Phi-4-mini's tool template), Functionary v3.1's ``<function=name>`` and v3.2's ``>>>name``, and
pythonic ``[name(key=value)]`` lists (Llama 3.2's and Llama 4's pythonic templates).

Each format's answers are written as the family's own code writes them (DeepSeek's ``encoding_dsv32.py``, the
templates llama.cpp keeps in ``models/templates``, vLLM's parsers), parsed, streamed and constrained here. Real
servers run a few of them end to end on the bundled GGUF with an abridged template of the family given by
``--chat-template`` (Kimi's and Granite's markers as special tokens of a copy of the GGUF, as in their tokenizers).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from anyquant_serve.tools import (
    DEEPSEEK_V32,
    FUNCTIONARY_V31,
    FUNCTIONARY_V32,
    FUNCTOOLS,
    GLM45,
    GRANITE,
    KIMI_K2,
    PYTHONIC,
    XML_STYLES,
    ToolFormat,
    ToolStream,
    detect_format,
    named_calls,
    parse_tool_calls,
    supports_tools,
    xml_calls,
)
from plugins.serve.tests.servers import serving, with_special_tokens
from plugins.serve.tests.test_serve_tools import (
    ANSWERED,
    CALLED,
    NAME,
    TOOLS,
    grammar_accepts,
    streamed_answer,
    streams_as_whole,
    valid_calls,
)

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

# ---------------------------------------------------------------------- abridged templates of each family
# Each reads ``tools``, writes the family's own markers and renders a call sent back in the family's shape.

KIMI_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>{%- for t in m.tool_calls -%}<|tool_call_begin|>{{ t.id }}"
    "<|tool_call_argument_begin|>{{ t.function.arguments | tojson }}<|tool_call_end|>{%- endfor -%}"
    "<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n{{ m.content }}"
    "<|im_end|>{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
KIMI_MARKERS = [
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_system|>", "<|im_middle|>", "<|im_user|>",
    "<|im_assistant|>",
]  # fmt: skip

GLM_TEMPLATE = (
    "[gMASK]<sop>{%- if tools -%}<|system|>\n# Tools\n\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n"
    "</tool_call>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|user|>\n{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>\n{{ m.content or '' }}"
    "{%- for t in m.tool_calls or [] -%}\n<tool_call>{{ t.function.name }}\n"
    "{%- for k, v in t.function.arguments.items() -%}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{%- endfor -%}</tool_call>{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}<|observation|>\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>\n{%- endif -%}"
)

#: DeepSeek-V3.2 ships no chat template (a Python encoder): this follows ``encoding_dsv32.py``'s text
DSML_TEMPLATE = (
    "{{- bos_token -}}{%- if tools -%}## Tools\n\nYou have access to a set of tools you can use to answer the user's "
    'question.\nYou can invoke functions by writing a "<｜DSML｜function_calls>" block like the following:\n'
    '<｜DSML｜function_calls>\n<｜DSML｜invoke name="$FUNCTION_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n'
    "</｜DSML｜invoke>\n</｜DSML｜function_calls>\n\n<functions>\n{% for t in tools %}{{ t.function | tojson }}\n"
    "{% endfor %}</functions>\n{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<｜User｜>{{ m.content }}<｜Assistant｜></think>"
    "{%- elif m.role == 'assistant' -%}{{ m.content or '' }}{%- if m.tool_calls -%}\n\n<｜DSML｜function_calls>\n"
    '{%- for t in m.tool_calls -%}<｜DSML｜invoke name="{{ t.function.name }}">\n'
    '{%- for k, v in t.function.arguments.items() -%}<｜DSML｜parameter name="{{ k }}" '
    "string=\"{{ 'true' if v is string else 'false' }}\">{{ v if v is string else v | tojson }}"
    "</｜DSML｜parameter>\n{%- endfor -%}</｜DSML｜invoke>\n{%- endfor -%}</｜DSML｜function_calls>{%- endif -%}"
    "<｜end▁of▁sentence｜>"
    "{%- elif m.role == 'tool' -%}\n\n<function_results>\n<result>{{ m.content }}</result>\n</function_results>"
    "\n\n</think>{%- endif -%}{%- endfor -%}"
)

GRANITE_TEMPLATE = (
    "{%- if tools -%}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>\n{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}<|start_of_role|>assistant<|end_of_role|><|tool_call|>"
    "{{ m.tool_calls | map(attribute='function') | list | tojson }}<|end_of_text|>\n"
    "{%- else -%}<|start_of_role|>{{ m.role }}<|end_of_role|>{{ m.content }}<|end_of_text|>\n{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start_of_role|>assistant<|end_of_role|>{%- endif -%}"
)
GRANITE_MARKERS = ["<|tool_call|>", "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"]

#: Functionary v3.2: the generation prompt ends with ">>>", the answer names its recipient ("all": content)
FUNCTIONARY_V32_TEMPLATE = (
    "{%- if tools -%}<|start_header_id|>system<|end_header_id|>\n\n// Supported function definitions that should be "
    "called when necessary.\nnamespace functions {\n{% for t in tools %}// {{ t.function.description }}\n"
    "type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;\n{% endfor %}"
    "} // namespace functions<|eot_id|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- if m.content -%}{{ '>>>all\n' + m.content }}{%- endif -%}"
    "{%- for t in m.tool_calls or [] -%}{{ '>>>' + t.function.name + '\n' + (t.function.arguments | tojson) }}"
    "{%- endfor -%}<|eot_id|>"
    "{%- else -%}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>\n\n>>>{%- endif -%}"
)

#: template snippets of the formats run here without a server
FUNCTIONARY_V31_SNIPPET = (
    "{%- for t in tools %}{{ t | tojson }}{% endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for t in message.tool_calls -%}{{ '<function=' + t.function.name + '>' + t.function.arguments + '</function>' }}"
    "{%- endfor -%}"
)
FUNCTOOLS_SNIPPET = (
    "{%- if tools %}In addition to plain text responses, you can chose to call one or more of the provided functions."
    ' Prefix function calls with functools marker: functools[{"name": ..., "arguments": ...}]'
    "{{ tools | tojson }}{% endif %}"
)

#: vLLM's tool_chat_template_llama3.2_pythonic.jinja's instruction (Llama 4's says the same)
PYTHONIC_SNIPPET = (
    "{%- if tools %}If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "{{ tools | tojson }}{% endif %}"
)

#: a whole pythonic template (Llama 3.2's roles) for a server
PYTHONIC_TEMPLATE = (
    PYTHONIC_SNIPPET + "{%- for m in messages -%}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}"
    "<|end_header_id|>\n\n{%- if m.tool_calls -%}[{%- for t in m.tool_calls -%}{{ t.function.name }}("
    "{%- for k, v in t.function.arguments.items() -%}{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}{%- endfor -%})"
    "{{ ', ' if not loop.last }}{%- endfor -%}]{%- else -%}{{ m.content }}{%- endif -%}<|eot_id|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif -%}"
)

TEMPLATES: list[tuple[str, ToolFormat]] = [
    (KIMI_TEMPLATE, KIMI_K2),
    (GLM_TEMPLATE, GLM45),
    (DSML_TEMPLATE, DEEPSEEK_V32),
    (GRANITE_TEMPLATE, GRANITE),
    (FUNCTIONARY_V32_TEMPLATE, FUNCTIONARY_V32),
    (FUNCTIONARY_V31_SNIPPET, FUNCTIONARY_V31),
    (FUNCTOOLS_SNIPPET, FUNCTOOLS),
    (PYTHONIC_TEMPLATE, PYTHONIC),
]

# ---------------------------------------------------------------------- answers as each family writes them

WEATHER_ARGS = {"city": "Paris", "unit": "celsius"}
TIME_ARGS = {"zone": "JST"}
#: (format, answer, its content, the calls' names and arguments)
ANSWERS: list[tuple[ToolFormat, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    (
        KIMI_K2,
        "I will check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "unit": "celsius"}<|tool_call_end|><|tool_call_begin|>'
        'functions.get_time:1<|tool_call_argument_begin|>{"zone": "JST"}<|tool_call_end|><|tool_calls_section_end|>',
        "I will check.",
        [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)],
    ),
    (
        GLM45,
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>\n<tool_call>get_time\n"
        "<arg_key>zone</arg_key>\n<arg_value>JST</arg_value>\n</tool_call>",
        "Let me check.",
        [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)],
    ),
    (  # encoding_dsv32.py's layout: "\n\n", the block, invokes and parameters joined by newlines
        DEEPSEEK_V32,
        'Let me check.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="zone" string="true">JST</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
        "Let me check.",
        [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)],
    ),
    (
        GRANITE,
        'Sure.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"zone": "JST"}}]',
        "Sure.",
        [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)],
    ),
    (
        FUNCTOOLS,
        'functools[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "parameters": {"zone": "JST"}}]',
        None,
        [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)],
    ),
    (
        FUNCTIONARY_V31,
        'Checking both.<function=get_weather>{"city": "Paris", "unit": "celsius"}</function>'
        '<function=get_time>{"zone": "JST"}</function>',
        "Checking both.",
        [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)],
    ),
    (
        FUNCTIONARY_V32,
        'all\nI will check both.>>>get_weather\n{"city": "Paris", "unit": "celsius"}>>>get_time\n{"zone": "JST"}',
        "I will check both.",
        [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)],
    ),
    (FUNCTIONARY_V32, 'get_time\n{"zone": "JST"}', None, [("get_time", TIME_ARGS)]),  # a call from the first word
    (
        PYTHONIC,
        "[get_weather(city='Paris', unit=\"celsius\"), get_time(zone='JST')]",
        None,
        [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)],
    ),
    (  # Llama 4's tags around it; Python's literals and JSON's alike
        PYTHONIC,
        "<|python_start|>[get_weather(city='Paris', unit='celsius', days=-2, hourly=True, extra={'a': [1, null]})]"
        "<|python_end|>",
        None,
        [("get_weather", {**WEATHER_ARGS, "days": -2, "hourly": True, "extra": {"a": [1, None]}})],
    ),
]


def test_template_detection() -> None:
    for template, fmt in TEMPLATES:
        assert supports_tools(template) and detect_format(template) is fmt, fmt.name


@pytest.mark.parametrize(("fmt", "text", "content", "expected"), ANSWERS, ids=lambda v: getattr(v, "name", None))
def test_answers_parse(fmt: ToolFormat, text: str, content: str | None, expected: list[Any]) -> None:
    got_content, calls = parse_tool_calls(text, fmt, TOOLS)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    ids = [c["id"] for c in calls]
    if fmt is KIMI_K2:  # the model's own ids, which Kimi's template writes back into the history
        assert ids == ["functions.get_weather:0", "functions.get_time:1"]
    else:
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)


def test_values_are_read_by_their_types() -> None:
    """GLM's values as their parameters' schema types say (a string as written, a number as JSON); DSML's by its
    ``string`` attribute (``"false"``: JSON, or the text where it is none, as DeepSeek's encoder reads them)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}},
            },
        }
    ]
    glm = "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n<arg_key>s</arg_key>\n<arg_value>3</arg_value>"
    _, calls = parse_tool_calls(glm + "\n</tool_call>", GLM45, tools)
    assert json.loads(calls[0]["function"]["arguments"]) == {"n": 3, "s": "3"}
    dsml = (
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">[1, {"a": null}]'
        '</｜DSML｜parameter>\n<｜DSML｜parameter name="s" string="true">[1]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="t" string="false">not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜function_calls>"
    )
    content, calls = parse_tool_calls(dsml, DEEPSEEK_V32, tools)
    assert content is None
    assert json.loads(calls[0]["function"]["arguments"]) == {"n": [1, {"a": None}], "s": "[1]", "t": "not json"}


@pytest.mark.parametrize(
    ("fmt", "broken"),
    [
        (
            KIMI_K2,
            '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{"zone"',
        ),
        (KIMI_K2, "<|tool_call_begin|>get_time<|tool_call_argument_begin|>{}<|tool_call_end|>"),  # no :N
        (GLM45, "<tool_call>get_time\n<arg_key>zone</arg_key>\nJST\n</tool_call>"),
        (GLM45, '<tool_call>{"name": "get_time"}</tool_call>'),
        (DEEPSEEK_V32, '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>'),  # unclosed
        (DEEPSEEK_V32, "<｜DSML｜function_calls>\ntext\n</｜DSML｜function_calls>"),
        (GRANITE, '<|tool_call|>[{"name": "get_time", "arguments": {}'),
        (FUNCTOOLS, "functools[oops]"),
        (FUNCTIONARY_V31, "<function=get_time>{not json}</function>"),
        (FUNCTIONARY_V32, "get_time\n{not json"),
        (PYTHONIC, "[get_time(zone=JST)]"),  # a name, not a literal: nothing is evaluated
        (PYTHONIC, "[__import__('os').system('true')]"),
        (PYTHONIC, "[get_time('JST')]"),  # positional
        (PYTHONIC, "[get_time(zone='JST')] and more"),
        (PYTHONIC, "[get_time(zone=" + "1+" * 100_000 + "1)]"),  # past the parser's depth: no crash
    ],
)
def test_a_broken_answer_is_content(fmt: ToolFormat, broken: str) -> None:
    assert parse_tool_calls(broken, fmt, TOOLS) == (broken, [])


def test_functionary_v32_content_drops_its_recipient() -> None:
    """An answer to ``all`` is content without the recipient, unstreamed and streamed alike."""
    assert parse_tool_calls("all\nIt is sunny.", FUNCTIONARY_V32) == ("It is sunny.", [])
    stream = ToolStream(FUNCTIONARY_V32)
    sent = "".join(stream.feed(c)[0] for c in "all\nIt is sunny.") + stream.finish()[0]
    assert sent == "It is sunny." and stream.reason("stop") == "stop"
    assert parse_tool_calls("Hello", FUNCTIONARY_V32) == ("Hello", [])  # no recipient: the text as it is


def test_hostile_answers_parse_in_linear_time() -> None:
    start = time.perf_counter()
    for fmt, unit in (
        (KIMI_K2, "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"),
        (GLM45, "<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>"),
        (DEEPSEEK_V32, '<｜DSML｜function_calls><｜DSML｜invoke name="f">\n<｜DSML｜parameter name="k" string="true">'),
        (FUNCTIONARY_V31, "<function=f>{"),
        (FUNCTIONARY_V32, ">>>f\n{"),
        (PYTHONIC, "[f(a=["),
    ):
        text = unit * 20_000
        assert parse_tool_calls(text, fmt, TOOLS) == (text, []), fmt.name
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize(("fmt", "text"), [(a[0], a[1]) for a in ANSWERS], ids=lambda v: getattr(v, "name", None))
def test_stream_joins_into_the_whole_answer(fmt: ToolFormat, text: str, size: int) -> None:
    """Content goes out until the calls' marker (its whitespace before the marker too, which the unstreamed answer
    strips); the calls (Granite's and functools' arguments piece by piece, the others whole at the end) equal the
    unstreamed ones."""
    sent, entries, reason = streamed_answer(text, fmt, size)
    whole_content, calls = parse_tool_calls(text, fmt, TOOLS)
    assert sent.strip() == (whole_content or "")
    heads = [(e["index"], e["function"]["name"]) for e in entries if "id" in e]
    assert heads == [(i, c["function"]["name"]) for i, c in enumerate(calls)]
    for i, call in enumerate(calls):
        assert "".join(e["function"]["arguments"] for e in entries if e["index"] == i) == call["function"]["arguments"]
    if fmt.array and size == 1:  # streamed piece by piece
        assert sum(1 for e in entries if e["function"]["arguments"]) > len(calls)
    assert reason == "tool_calls"


# ---------------------------------------------------------------------- the constraint of required / named


CONSTRAINED = {  # two calls as each grammar writes them (JSON on one line, no property the schema does not name)
    "pythonic": '[get_time(zone="JST"), get_weather(city="Paris", unit="celsius")]',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:3<|tool_call_argument_begin|>"
    '{"zone": "JST"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:4<|tool_call_argument_begin|>'
    '{"city": "Paris", "unit": "celsius"}<|tool_call_end|><|tool_calls_section_end|>',
    "functionary_v31": '<function=get_time>{"zone": "JST"}</function><function=get_weather>{"city": "Paris", "unit": '
    '"celsius"}</function>',
    "functionary_v32": 'get_time\n{"zone": "JST"}>>>get_weather\n{"city": "Paris", "unit": "celsius"}',
    "glm45": "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>JST</arg_value>\n</tool_call>\n"
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n"
    "<arg_value>celsius</arg_value>\n</tool_call>",
    "deepseek_v32": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="zone" '
    'string="true">JST</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="unit" '
    'string="true">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
}


@pytest.mark.parametrize(
    "fmt", [KIMI_K2, FUNCTIONARY_V31, FUNCTIONARY_V32, GLM45, DEEPSEEK_V32, PYTHONIC], ids=lambda f: f.name
)
def test_the_constraint_writes_the_templates_shape(fmt: ToolFormat) -> None:
    """``required``'s grammar accepts two calls in the family's shape (Kimi's ids numbered on from the 3 calls of the
    history) and nothing else: an unknown tool, a third call, a wrong index; what it writes parses back."""
    pytest.importorskip("xgrammar")
    from anyquant_runtime.grammar import OutputFormat, _named_calls_grammar, _xml_calls_grammar

    text = CONSTRAINED[fmt.name]
    if fmt.name in XML_STYLES:
        spec = OutputFormat.xml_calls(xml_calls(TOOLS), fmt.sep, 2, XML_STYLES[fmt.name]).spec
        grammar = _xml_calls_grammar(json.loads(spec))
    else:
        named = named_calls(TOOLS, fmt, None, 3)
        assert named is not None and (named.first == 3) == (fmt is KIMI_K2)
        spec = OutputFormat.named_calls(named.options, named.begin, named.end, 2, named.sep, named.first).spec
        grammar = _named_calls_grammar(json.loads(spec))
    assert grammar_accepts(grammar, text)
    assert not grammar_accepts(grammar, text.replace("get_time", "get_news"))
    if fmt is KIMI_K2:
        assert not grammar_accepts(grammar, text.replace("get_weather:4", "get_weather:3"))
    _, calls = parse_tool_calls(text, fmt, TOOLS)
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]


def test_granite_and_functools_take_the_json_array_grammar() -> None:
    """Granite's ``<|tool_call|>`` and ``functools``, as Mistral's ``[TOOL_CALLS]``: a JSON array of call objects."""
    pytest.importorskip("xgrammar")
    from anyquant_runtime.grammar import OutputFormat, _tool_calls_grammar
    from anyquant_serve.tools import call_schema

    for fmt in (GRANITE, FUNCTOOLS):
        schema = {"type": "array", "items": call_schema(TOOLS, fmt), "minItems": 1, "maxItems": 2}
        grammar = _tool_calls_grammar(json.loads(OutputFormat.tool_calls(schema, fmt.begin, fmt.end).spec))
        text = fmt.begin + '[{"name": "get_time", "arguments": {"zone": "JST"}}]'
        assert grammar_accepts(grammar, text) and not grammar_accepts(
            grammar, text.replace("JST", "far too long a zone")
        )
        assert parse_tool_calls(text, fmt)[1][0]["function"]["name"] == "get_time"


# ---------------------------------------------------------------------- real servers

#: (format, template, the markers made special tokens of the GGUF copy, the ids its calls take)
SERVED = {
    "kimi_k2": (KIMI_TEMPLATE, KIMI_MARKERS, r"functions\.{name}:[0-9]+"),
    "glm45": (GLM_TEMPLATE, [], r"call_[0-9a-f]{24}"),
    "deepseek_v32": (DSML_TEMPLATE, [], r"call_[0-9a-f]{24}"),
    "granite": (GRANITE_TEMPLATE, GRANITE_MARKERS, r"call_[0-9a-f]{24}"),
    "functionary_v32": (FUNCTIONARY_V32_TEMPLATE, [], r"call_[0-9a-f]{24}"),
    "pythonic": (PYTHONIC_TEMPLATE, [], r"call_[0-9a-f]{24}"),
}


@pytest.fixture(scope="module", params=sorted(SERVED))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    for module in ("starlette", "uvicorn", "sse_starlette", "xgrammar", "openai", "jsonschema", "gguf"):
        pytest.importorskip(module)
    import openai

    import anyquant

    name: str = request.param
    template, markers, _ = SERVED[name]
    folder = tmp_path_factory.mktemp(name)
    (folder / "template.jinja").write_text(template, encoding="utf-8")
    model = with_special_tokens(folder / "model.gguf", markers) if markers else Path(anyquant.default_model())
    with serving(str(model), "--model-name", NAME, "--chat-template", str(folder / "template.jinja")) as base:
        yield name, openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.model
@pytest.mark.slow
def test_required_named_and_streamed_calls(served: tuple[str, Any]) -> None:
    """On a real server with the family's template: ``required`` and a named function give calls that validate
    against the tools' schemas (``jsonschema``), with no marker left in the content; streamed, the same calls, whose
    arguments join into the unstreamed ones. Kimi's ids are ``functions.name:N``, N counting the history's calls."""
    name, client = served
    ids = SERVED[name][2]
    named = {"type": "function", "function": {"name": "get_time"}}
    for messages, choice, extra in (
        (MESSAGES, named, {"temperature": 0}),
        ([*MESSAGES, CALLED, ANSWERED], "required", {"temperature": 0.8, "seed": 5}),
    ):
        request = {"model": NAME, "messages": messages, "tools": TOOLS, "tool_choice": choice, "max_tokens": 400}
        whole = client.chat.completions.create(**request, **extra).choices[0]
        assert whole.finish_reason == "tool_calls" and not whole.message.content, whole
        names = valid_calls(whole.message.tool_calls, TOOLS, ids)
        assert names and (choice != named or names == ["get_time"])
        if name == "kimi_k2":  # numbered on from the calls already in the conversation
            first = len(messages) > 1
            assert [c.id.rsplit(":", 1)[1] for c in whole.message.tool_calls] == [
                str(i + first) for i in range(len(names))
            ]
        streams_as_whole(client, {**request, **extra}, whole)
