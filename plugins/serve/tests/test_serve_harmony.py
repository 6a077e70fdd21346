"""gpt-oss's harmony answers on ``anyquant serve`` (issue #43 §2): the answer decoded with its channel markers and
split into ``reasoning_content`` (``analysis``), ``content`` (``final``) and ``tool_calls`` (messages to
``functions.<name>``), whole and streamed; ``tool_choice`` ``required`` or a named function constrained to a call's
header and its arguments' schema; ``reasoning_effort`` passed to the template.

The parser and its stream are tested on fixed answers. The rest runs against real server processes on a copy of the
bundled GGUF whose chat template is harmony's and whose unused special tokens are renamed to harmony's markers, so
that, as in gpt-oss's tokenizer, the markers are special tokens a plain decode drops.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from anyquant_runtime.harmony import HarmonyStream, call_options, is_harmony, parse_harmony
from anyquant_serve.tools import functions
from plugins.serve.tests.servers import serving, with_special_tokens
from plugins.serve.tests.test_serve_tools import ANSWERED, CALLED, NAME, QWEN25_TEMPLATE, TIME, TOOLS, valid_calls

#: gpt-oss's chat template, abridged: its markers, channels, tool namespace, call and tool-result rendering, and
#: the ``reasoning_effort`` it reads
HARMONY_TEMPLATE = '{#- gpt-oss\'s harmony chat template, abridged: the same markers, channels, tool namespace and call rendering -#}\n{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\nReasoning: " + (reasoning_effort or "medium") + "\\n\\n# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}\n{%- if tools %}{{- "\\nCalls to these tools must go to the commentary channel: \'functions\'." }}{% endif -%}\n{{- "<|end|>" -}}\n{%- if messages[0].role in ("system", "developer") %}{% set first = messages[0].content %}{% set rest = messages[1:] %}{% else %}{% set first = "" %}{% set rest = messages %}{% endif -%}\n{%- if first or tools -%}\n{{- "<|start|>developer<|message|>" -}}\n{%- if first %}{{ "# Instructions\\n\\n" + first + "\\n\\n" }}{% endif -%}\n{%- if tools -%}\n{{- "# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n" -}}\n{%- for tool in tools %}{% set f = tool.function %}{{ "// " + f.description + "\\ntype " + f.name + " = (_: " + (f.parameters | tojson) + ") => any;\\n\\n" }}{% endfor -%}\n{{- "} // namespace functions" -}}\n{%- endif -%}\n{{- "<|end|>" -}}\n{%- endif -%}\n{%- set last = namespace(name=none) -%}\n{%- for m in rest -%}\n{%- if m.role == "assistant" and m.tool_calls -%}\n{%- set call = m.tool_calls[0].function -%}\n{%- if m.thinking %}{{ "<|start|>assistant<|channel|>analysis<|message|>" + m.thinking + "<|end|>" }}{% endif -%}\n{{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" + (call.arguments | tojson) + "<|call|>" -}}\n{%- set last.name = call.name -%}\n{%- elif m.role == "assistant" -%}\n{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}\n{%- elif m.role == "tool" -%}\n{{- "<|start|>functions." + last.name + " to=assistant<|channel|>commentary<|message|>" + (m.content | tojson) + "<|end|>" -}}\n{%- else -%}\n{{- "<|start|>user<|message|>" + m.content + "<|end|>" -}}\n{%- endif -%}\n{%- endfor -%}\n{%- if add_generation_prompt %}{{ "<|start|>assistant" }}{% endif -%}\n'

#: harmony's markers, written over the bundled tokenizer's unused special tokens 3..9
MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]

THINK_FINAL = (
    "<|channel|>analysis<|message|>The user asks for the weather.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
)
CALL_AFTER_THINKING = (
    "<|channel|>analysis<|message|>Need the tool.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris",'
    '"unit":"celsius"}'
)
CALL_RECIPIENT_FIRST = (  # the order the template writes history in (and the model may copy)
    '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "JST"}'
)


# ---------------------------------------------------------------------- the parser and its stream


def test_template_detection() -> None:
    assert is_harmony(HARMONY_TEMPLATE) and not is_harmony(QWEN25_TEMPLATE)


def _call(answer: Any) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in answer.calls]


def test_channels() -> None:
    a = parse_harmony(THINK_FINAL, tools=False)
    assert (a.reasoning, a.content, a.calls) == ("The user asks for the weather.", "It is sunny in Paris.", [])
    assert a.message() == {
        "role": "assistant",
        "content": "It is sunny in Paris.",
        "reasoning_content": "The user asks for the weather.",
    }
    a = parse_harmony(CALL_AFTER_THINKING, tools=True)
    assert (a.reasoning, a.content) == ("Need the tool.", None)
    assert _call(a) == [("get_weather", '{"city":"Paris","unit":"celsius"}')]
    assert a.calls[0]["id"].startswith("call_") and a.message()["content"] is None
    assert _call(parse_harmony(CALL_RECIPIENT_FIRST, tools=True)) == [("get_time", '{"zone": "JST"}')]
    # no tools offered: a message to a recipient is not for the user either
    a = parse_harmony(CALL_AFTER_THINKING, tools=False)
    assert a.calls == [] and a.content is None and a.reasoning == 'Need the tool.{"city":"Paris","unit":"celsius"}'
    assert a.message()["content"] == ""
    # arguments that are no JSON object: no call
    a = parse_harmony("<|channel|>commentary to=functions.get_time<|message|>JST", tools=True)
    assert a.calls == [] and a.reasoning == "JST"
    # a preamble (commentary without a recipient) and an unknown channel are content; so is text with no harmony
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done."
    assert parse_harmony(preamble, tools=True).content == "Checking.Done."
    assert parse_harmony("plain <| text", tools=True).message() == {"role": "assistant", "content": "plain <| text"}
    # a header cut off by max_tokens holds nothing; a body cut off is what was written
    assert (
        parse_harmony(THINK_FINAL + "<|end|><|start|>assistant<|chan", tools=False).content == "It is sunny in Paris."
    )
    assert parse_harmony("<|channel|>analysis<|message|>Hm", tools=False).reasoning == "Hm"


def _streamed(text: str, tools: bool, size: int) -> tuple[list[dict[str, Any]], str]:
    stream = HarmonyStream(tools)
    deltas: list[dict[str, Any]] = []
    for at in range(0, len(text), size):
        deltas += stream.feed(text[at : at + size])
    deltas += stream.finish()
    return deltas, stream.reason("stop")


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
@pytest.mark.parametrize("tools", [True, False])
@pytest.mark.parametrize(
    "text", [THINK_FINAL, CALL_AFTER_THINKING, CALL_RECIPIENT_FIRST, "plain text", "<|channel|>final<|message|>a <|en"]
)
def test_stream_joins_into_the_whole_answer(text: str, tools: bool, size: int) -> None:
    whole = parse_harmony(text, tools)
    deltas, reason = _streamed(text, tools, size)
    assert all(len(d) == 1 for d in deltas)
    joined = {key: "".join(d[key] for d in deltas if key in d) or None for key in ("reasoning_content", "content")}
    assert joined == {"reasoning_content": whole.reasoning, "content": whole.content}
    entries = [e for d in deltas for e in d.get("tool_calls", [])]
    heads = [e for e in entries if "id" in e]  # index, id, type and name once, then the arguments piece by piece
    assert [(e["index"], e["function"]["name"], e["function"]["arguments"]) for e in heads] == [
        (i, name, "") for i, (name, _) in enumerate(_call(whole))
    ]
    arguments = "".join(e["function"]["arguments"] for e in entries)
    assert arguments == "".join(args for _, args in _call(whole))
    assert reason == ("tool_calls" if whole.calls else "stop")
    if size == 1 and whole.calls:
        assert len(entries) > 3  # the arguments come as they are generated, not at the end


def test_call_options() -> None:
    options = call_options(functions(TOOLS, "get_time"))
    assert options == [
        ("<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>", TIME["function"]["parameters"])
    ]
    assert [header for header, _ in call_options(functions(TOOLS))] == [
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
        "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>",
    ]


# ---------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_special_tokens(tmp_path_factory.mktemp("harmony") / "smol-harmony.gguf", MARKERS, HARMONY_TEMPLATE)


@pytest.fixture(scope="module")
def harmony_client(harmony_model: Path) -> Iterator[Any]:
    for module in ("starlette", "uvicorn", "sse_starlette", "xgrammar", "openai", "jsonschema"):
        pytest.importorskip(module)
    import openai

    with serving(str(harmony_model), "--model-name", NAME) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.model
def test_the_markers_are_special_tokens(harmony_model: Path) -> None:
    """The copy's tokenizer is gpt-oss's case: a plain decode drops the markers, the server's keeps them; the
    template gets ``reasoning_effort``."""
    import anyquant
    from anyquant_serve.scheduler import ModelAdapter

    adapter = ModelAdapter(anyquant.load(str(harmony_model)))
    ids = adapter.encode("<|channel|>final<|message|>Hi<|end|>", chat=False)
    assert [i for i in ids if i < 17] == [4, 5, 6]
    assert adapter.decode(ids) == "finalHi"
    assert adapter.decode(ids, special=True) == "<|channel|>final<|message|>Hi<|end|>"
    call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "JST"}}}
    sent_back = {"role": "assistant", "content": "", "tool_calls": [call], "thinking": "Need the time."}
    prompt = adapter.decode(adapter.encode_chat([*MESSAGES, sent_back], TOOLS), special=True)
    assert "<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant to=functions.get_time" in prompt
    for effort in ("low", "high"):
        prompt = adapter.decode(adapter.encode_chat(MESSAGES, None, reasoning_effort=effort), special=True)
        assert prompt.startswith("<|start|>system<|message|>") and f"\nReasoning: {effort}\n" in prompt
        assert prompt.endswith("<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>assistant")


#: an answer in two channels, forced on the tiny model by a regular expression
TWO_CHANNELS = (
    r"<\|channel\|>analysis<\|message\|>[a-z]{2,6}( [a-z]{2,6}){1,2}<\|end\|>"
    r"<\|start\|>assistant<\|channel\|>final<\|message\|>[a-z]{2,6}( [a-z]{2,6}){1,2}"
)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.model
@pytest.mark.slow
def test_reasoning_and_content(harmony_client: Any) -> None:
    """The channels come back as ``reasoning_content`` and ``content``, with no marker; streamed, the deltas join
    into the same two texts."""
    request = {"model": NAME, "messages": MESSAGES, "max_tokens": 120, "temperature": 0}
    extra = {"guided_regex": TWO_CHANNELS}
    whole = harmony_client.chat.completions.create(**request, extra_body=extra).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert whole.finish_reason == "stop" and whole.message.tool_calls is None, whole
    for text in (reasoning, whole.message.content):
        assert text and "<|" not in text and text.replace(" ", "").isalpha()
    parts: dict[str, list[str]] = {"reasoning_content": [], "content": []}
    reasons = []
    for event in harmony_client.chat.completions.create(**request, extra_body=extra, stream=True):
        delta = event.choices[0].delta
        for key in parts:
            value = delta.content if key == "content" else (delta.model_extra or {}).get(key)
            if value:
                parts[key].append(value)
        reasons.append(event.choices[0].finish_reason)
    assert "".join(parts["reasoning_content"]) == reasoning and "".join(parts["content"]) == whole.message.content
    assert len(parts["reasoning_content"]) > 1 and reasons[-1] == "stop"


@pytest.mark.model
@pytest.mark.slow
def test_required_and_named_calls(harmony_client: Any) -> None:
    """``required`` and a named function give one well-formed call (harmony: one call a turn); streamed, the call's
    arguments come piece by piece and join into the unstreamed ones."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, extra in ((named, {"temperature": 0}), ("required", {"temperature": 0.8, "seed": 3})):
        request = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 80}
        whole = harmony_client.chat.completions.create(**request, **extra).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        names = valid_calls(whole.message.tool_calls, TOOLS)
        assert len(names) == 1 and (choice != named or names == ["get_weather"])
        heads, pieces, reasons = [], [], []
        for event in harmony_client.chat.completions.create(**request, **extra, stream=True):
            for entry in event.choices[0].delta.tool_calls or ():
                if entry.id is not None:
                    heads.append((entry.index, entry.function.name))
                elif entry.function.arguments:
                    pieces.append(entry.function.arguments)
            reasons.append(event.choices[0].finish_reason)
        assert heads == [(0, names[0])] and len(pieces) > 1 and reasons[-1] == "tool_calls"
        assert "".join(pieces) == whole.message.tool_calls[0].function.arguments


@pytest.mark.model
@pytest.mark.slow
def test_history_effort_and_refusals(harmony_client: Any) -> None:
    """A tool round trip renders through the template; ``reasoning_effort`` is taken, and refused where a template
    does not read it."""
    import openai

    # the call sent back as the server returned it, reasoning and all
    history = [*MESSAGES, {**CALLED, "reasoning_content": "The user wants the weather."}, ANSWERED]
    r = harmony_client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for effort in ("low", "high"):
        r = harmony_client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1, reasoning_effort=effort)
        assert r.choices[0].finish_reason in ("stop", "length")
    with serving("--model-name", NAME) as base:  # the bundled template reads no reasoning_effort
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        with pytest.raises(openai.BadRequestError, match="reasoning_effort") as info:
            client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1, reasoning_effort="low")
        assert info.value.body["param"] == "reasoning_effort"


# ---------------------------------------------------------------------- the library: complete, stream, generate

SCRIPT = (
    "<|channel|>analysis<|message|>Think it over.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
    "<|return|>never reached"
)


@pytest.mark.model
def test_library_answers_split_by_channel(harmony_model: Path) -> None:
    """``complete`` on a chat prompt rendered by a harmony template: ``text`` is the final channel, ``reasoning`` the
    analysis, the answer ends at ``<|return|>`` (a special token here, as in gpt-oss); ``complete_stream``'s chunks
    join into the same two texts; ``stream`` and ``generate_batch`` give the final channel. The tokens are
    scripted through ``token_steps`` (the generator's seam for another token loop): what is tested is the decode
    and the split, with this tokenizer."""
    import anyquant
    from anyquant.params import GenerationParams
    from anyquant_runtime.generate import TorchGenerator

    model = anyquant.load(str(harmony_model))
    script = model.tokenizer.encode(SCRIPT, add_special_tokens=False)
    assert sum(1 for i in script if i < 17) == 7  # the markers are single special tokens

    class Scripted(TorchGenerator):
        def token_steps(self, batch: Any, params: Any, ends: Any = None) -> Iterator[list[int | None]]:
            done = [False] * len(batch)
            for token in script:
                yield [None if d else token for d in done]
                done = [d or token in (ends or ()) for d in done]

    gen = Scripted(model.module, model.tokenizer)
    params = GenerationParams(max_new_tokens=64)
    result = gen.complete(MESSAGES, params)
    assert (result.text, result.reasoning) == ("Sunny.", "Think it over.")
    assert result.finish_reason == "stop" and result.stop_string is None
    assert list(result.token_ids) == script[: script.index(7) + 1]  # up to <|return|> (id 7), which ends it
    chunks = list(gen.complete_stream(MESSAGES, params))
    assert "".join(c.text for c in chunks) == "Sunny." and "".join(c.reasoning for c in chunks) == "Think it over."
    assert sum(1 for c in chunks if c.reasoning) > 1  # the reasoning streams as it comes
    assert "".join(gen.stream(MESSAGES, params)) == "Sunny."
    assert gen.generate_batch([MESSAGES, MESSAGES], params) == ["Sunny.", "Sunny."]
    plain = gen.complete("Weather?", params)  # no chat template: not split, markers dropped as before
    assert plain.reasoning is None and plain.text.startswith("analysisThink it over.assistantfinalSunny.")


def test_long_answers_parse_in_one_pass() -> None:
    """An answer of 20,000 messages (and a stream of a 400,000-character header that never closes) is read in one
    pass: each marker's next place is remembered instead of searched for again from every message (before: 9 s for
    the first, minutes for the second at a token a piece). The results are the short answers' repeated."""
    many = "<|channel|>analysis<|message|>x<|end|><|start|>assistant" * 20_000 + "<|channel|>final<|message|>y"
    answer = parse_harmony(many, tools=True)
    assert (answer.reasoning, answer.content, answer.calls) == ("x" * 20_000, "y", [])
    stream = HarmonyStream(tools=False)
    for _ in range(100_000):
        assert stream.feed("abcd") == []
    assert stream.finish() == [{"content": "abcd" * 100_000}]
