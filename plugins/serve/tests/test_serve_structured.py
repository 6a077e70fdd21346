"""Structured output in ``anyquant serve`` (issue #43 §1): ``response_format`` (``json_object``, ``json_schema``)
and vLLM's ``guided_json``/``guided_regex``/``guided_choice`` through xgrammar's token masks, applied per row in the
batched decode step. Against a real server process on the bundled model with the ``openai`` client: every answer
parses and validates against its schema (``jsonschema``), streamed or not, sampled with a seed, ``n`` > 1, and under
8 concurrent clients with different schemas; unconstrained neighbours decode as they do alone. The bounds (schema
size, compile time, what xgrammar cannot compile, xgrammar not installed) are a 400 naming the field.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from anyquant_runtime.grammar import MAX_FORMAT_BYTES, GrammarError, Grammars, OutputFormat
from plugins.serve.tests.servers import serving

NAME = "smol"
ROOT = Path(__file__).resolve().parents[3]

# ---------------------------------------------------------------------- schemas

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
    "required": ["color", "bright"],
    "additionalProperties": False,
}
LIST = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 3,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "city": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "location": {
                    "type": "object",
                    "properties": {
                        "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                        "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                    },
                    "required": ["lat", "lon"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "location"],
            "additionalProperties": False,
        }
    },
    "required": ["city"],
    "additionalProperties": False,
}
RANGES = {
    "type": "object",
    "properties": {
        "score": {"type": "integer", "minimum": 1, "maximum": 10},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 1000},
    },
    "required": ["score", "ratio", "count"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "color": COLOR, "list": LIST, "nested": NESTED, "ranges": RANGES}
ASK = {
    "person": "Describe a person as JSON.",
    "color": "Pick a color as JSON.",
    "list": "List some fruits as JSON.",
    "nested": "Describe a city and where it is as JSON.",
    "ranges": "Rate a movie as JSON.",
}


def _variant(i: int) -> dict[str, Any]:
    """Eight different schemas for eight clients: the keys, enums and bounds differ."""
    key = f"field_{i}"
    return {
        "type": "object",
        "properties": {
            key: {"enum": [f"v{i}a", f"v{i}b", f"v{i}c"]},
            "n": {"type": "integer", "minimum": i, "maximum": 10 * (i + 1)},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": i % 3 + 1},
        },
        "required": [key, "n", "tags"],
        "additionalProperties": False,
    }


# ---------------------------------------------------------------------- without a model


def test_format_bounds() -> None:
    big = {"type": "object", "description": "x" * MAX_FORMAT_BYTES}
    with pytest.raises(GrammarError, match="at most"):
        OutputFormat.json_schema(big)
    with pytest.raises(GrammarError, match="not valid JSON"):
        OutputFormat.json_schema("{")
    with pytest.raises(GrammarError):
        OutputFormat.json_schema([1])  # type: ignore[arg-type]
    with pytest.raises(GrammarError):
        OutputFormat.regex("")
    with pytest.raises(GrammarError):
        OutputFormat.choice([])
    with pytest.raises(GrammarError, match="at most"):
        OutputFormat.choice(["a"] * 2000)
    # keywords xgrammar accepts without enforcing them: refused, naming where
    with pytest.raises(GrammarError, match=r"properties\.tags: 'uniqueItems' is not supported"):
        OutputFormat.json_schema({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})
    with pytest.raises(GrammarError, match=r"anyOf\[1\]: 'not'"):
        OutputFormat.json_schema({"anyOf": [{"type": "integer"}, {"not": {"type": "string"}}]})
    # a property named like a keyword is a name, not the keyword
    OutputFormat.json_schema({"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}})
    # the schema's property order is kept: the output writes its properties in it
    assert OutputFormat.json_schema({"b": 1, "a": 2}).spec == '{"b":1,"a":2}'
    assert OutputFormat.json_schema('{"type": "object"}') == OutputFormat.json_schema({"type": "object"})


class _SlowCompiler:
    def __init__(self, delay: float) -> None:
        self.delay, self.calls = delay, 0

    def compile_regex(self, regex: str) -> str:
        self.calls += 1
        time.sleep(self.delay)
        return "compiled:" + regex


def _grammars(compiler: Any, **kw: Any) -> Grammars:
    grammars = Grammars(None, 10, [0], **kw)
    grammars._compiler = compiler
    grammars.compiler = lambda: compiler  # type: ignore[method-assign]
    return grammars


def test_compile_time_limit_and_cache() -> None:
    slow = _SlowCompiler(1.0)
    grammars = _grammars(slow, timeout=0.2)
    with pytest.raises(GrammarError, match=r"did not compile within 0\.2 s"):
        grammars.compile(OutputFormat.regex("a+"))
    time.sleep(1.2)  # the compile went on in its thread and was cached when it ended
    assert grammars.compile(OutputFormat.regex("a+")) == "compiled:a+"
    assert slow.calls == 1
    fast = _SlowCompiler(0)
    grammars = _grammars(fast, cache_size=2)
    for pattern in ("a", "b", "a", "c", "a", "b"):
        grammars.compile(OutputFormat.regex(pattern))
    assert fast.calls == 4  # a, b, c, then b again (dropped as least recently used when c came)
    assert list(grammars._cache) == [OutputFormat.regex("a"), OutputFormat.regex("b")]


def test_anyquant_imports_without_xgrammar() -> None:
    """Nothing imports xgrammar until a constrained request arrives (it is optional)."""
    code = (
        "import sys, anyquant, anyquant_runtime.grammar, anyquant_serve.app, anyquant_serve.schema\n"
        "assert 'xgrammar' not in sys.modules, 'xgrammar imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_xgrammar_a_400_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("sse_starlette")
    import importlib.util

    import anyquant_runtime.grammar as grammar

    spec = importlib.util.spec_from_file_location("_hardening", Path(__file__).with_name("test_serve_hardening.py"))
    assert spec is not None and spec.loader is not None
    hardening = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hardening)
    CHAT, _post, _server = hardening.CHAT, hardening._post, hardening._server

    class Structured(hardening.FakeScheduler):  # type: ignore[misc,name-defined]
        structured_output = True

    monkeypatch.setattr(
        grammar, "unavailable", lambda: "structured output needs xgrammar: pip install 'anyquant[serve]'"
    )
    with _server(Structured()) as (port, _):
        status, answer = _post(port, "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}})
        assert status == 400, answer
        assert answer["error"]["param"] == "response_format"
        assert answer["error"]["code"] == "unsupported_parameter"
        assert "pip install 'anyquant[serve]'" in answer["error"]["message"]
        # the bounds are checked before: a schema too big is refused as such
        big = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"description": "x" * 70000}}}
        status, answer = _post(port, "/v1/chat/completions", {**CHAT, "response_format": big})
        assert status == 400 and "at most 65536" in answer["error"]["message"], answer
        # plain text is no constraint: answered
        status, answer = _post(port, "/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}})
        assert status == 200, answer


# ---------------------------------------------------------------------- a real server on the bundled model


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("sse_starlette")
    pytest.importorskip("xgrammar")
    with serving("--model-name", NAME, "--max-batch", "8") as base:
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)


def _json_schema(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _answers(client: Any, chat: bool, prompt: str, stream: bool, **kw: Any) -> list[tuple[str, str]]:
    """Each choice's (text, finish_reason), streamed or not."""
    kw.setdefault("max_tokens", 160)
    if chat:
        call = client.chat.completions.create
        kw["messages"] = [{"role": "user", "content": prompt}]
    else:  # the client's completions take no response_format: sent as it sends any extension
        call = client.completions.create
        kw["prompt"] = prompt
        if "response_format" in kw:
            kw.setdefault("extra_body", {})["response_format"] = kw.pop("response_format")
    if not stream:
        r = call(model=NAME, **kw)
        return [((c.message.content if chat else c.text), c.finish_reason) for c in r.choices]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in call(model=NAME, stream=True, **kw):
        for c in chunk.choices:
            piece = (c.delta.content if chat else c.text) or ""
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return [(texts.get(i, ""), reasons[i]) for i in sorted(reasons)]


def _valid(text: str, schema: dict[str, Any] | None) -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    value = json.loads(text)
    assert isinstance(value, dict), text
    if schema is not None:
        jsonschema.validate(value, schema)
    return value


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_object(client: Any, chat: bool, stream: bool) -> None:
    answers = _answers(
        client, chat, "Reply with a JSON object giving the name and the number of legs of a cat.", stream,
        response_format={"type": "json_object"}, temperature=0.7, top_p=0.9, frequency_penalty=0.5, seed=5, n=2,
    )  # fmt: skip
    assert len(answers) == 2
    for text, reason in answers:
        assert reason == "stop", text
        _valid(text, None)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_validates(client: Any, name: str) -> None:
    """Each schema on both routes, streamed and not, sampled (temperature 0.8, a seed) with two choices."""
    schema = SCHEMAS[name]
    for chat, stream in ((True, False), (False, True)):
        answers = _answers(
            client, chat, ASK[name], stream, response_format=_json_schema(schema), temperature=0.8, seed=11, n=2
        )
        assert len(answers) == 2
        for text, reason in answers:
            assert reason == "stop", (name, chat, stream, text)
            _valid(text, schema)
    # greedy, and streamed equal to whole
    whole = _answers(client, True, ASK[name], False, response_format=_json_schema(schema), temperature=0)
    streamed = _answers(client, True, ASK[name], True, response_format=_json_schema(schema), temperature=0)
    assert whole == streamed
    _valid(whole[0][0], schema)


@pytest.mark.model
@pytest.mark.slow
def test_every_sampler_parameter_on_masked_logits(client: Any) -> None:
    """Penalties, top-k/p, min-p, a logit bias pushing a token the grammar forbids, logprobs: still valid."""
    r = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": ASK["person"]}],
        response_format=_json_schema(PERSON),
        max_tokens=160, temperature=1.2, top_p=0.9, seed=3, presence_penalty=1.0, frequency_penalty=0.5,
        logit_bias={"28": 100, "2": -100}, logprobs=True, top_logprobs=2,
        extra_body={"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.2},
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    _valid(choice.message.content, PERSON)
    tokens = choice.logprobs.content[:-1]  # the last: the end-of-sequence token
    assert b"".join(bytes(t.bytes) for t in tokens) == choice.message.content.encode()
    assert all(t.logprob <= 0 for t in tokens)


@pytest.mark.model
@pytest.mark.slow
def test_eight_concurrent_clients_with_different_schemas(client: Any) -> None:
    schemas = [_variant(i) for i in range(8)]

    def one(i: int) -> list[tuple[str, str]]:
        return _answers(
            client, i % 2 == 0, f"Give an answer as JSON (case {i}).", i % 4 < 2,
            response_format=_json_schema(schemas[i], f"s{i}"), temperature=0.7, seed=i,
        )  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for i, answers in enumerate(results):
        (text, reason) = answers[0]
        assert reason == "stop", (i, text)
        value = _valid(text, schemas[i])
        assert f"field_{i}" in value


@pytest.mark.model
@pytest.mark.slow
def test_unconstrained_neighbours_decode_as_alone(client: Any) -> None:
    """A greedy free-text request gives the same tokens with constrained requests in its batch as alone."""
    question = [{"role": "user", "content": "Write a haiku about the sea and the wind at night."}]
    alone = client.chat.completions.create(model=NAME, messages=question, max_tokens=40, temperature=0)
    started = threading.Barrier(4)

    def constrained(i: int) -> str:
        started.wait()
        return str(
            _answers(client, True, ASK["list"], i == 0, response_format=_json_schema(LIST), temperature=0.8, seed=i)
        )

    def free() -> Any:
        started.wait()
        time.sleep(0.3)  # joins a batch already decoding constrained rows
        return client.chat.completions.create(model=NAME, messages=question, max_tokens=40, temperature=0)

    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(constrained, i) for i in range(3)]
        together = pool.submit(free).result()
        for f in others:
            f.result()
    assert together.choices[0].message.content == alone.choices[0].message.content
    assert together.usage.completion_tokens == alone.usage.completion_tokens


@pytest.mark.model
@pytest.mark.slow
def test_guided_extensions(client: Any) -> None:
    choices = ["positive", "negative", "neutral"]
    for chat in (True, False):
        for stream in (False, True):
            (text, reason), = _answers(
                client, chat, "Is 'I love it' positive or negative?", stream,
                extra_body={"guided_choice": choices}, temperature=0.5, seed=1,
            )  # fmt: skip
            assert text in choices and reason == "stop"
    pattern = r"[0-9]{3}-[A-Z]{2}"
    ((text, reason),) = _answers(
        client, False, "A code:", False, extra_body={"guided_regex": pattern}, temperature=1.0, seed=2
    )
    assert re.fullmatch(pattern, text) and reason == "stop", text
    ((text, reason),) = _answers(client, True, ASK["color"], True, extra_body={"guided_json": COLOR}, temperature=0)
    _valid(text, COLOR)


@pytest.mark.model
@pytest.mark.slow
def test_too_few_tokens_end_with_length(client: Any) -> None:
    """As OpenAI documents: an answer cut by max_tokens ends with finish_reason "length", its JSON unfinished."""
    for stream in (False, True):
        (text, reason), = _answers(
            client, True, ASK["nested"], stream, response_format=_json_schema(NESTED), max_tokens=5, temperature=0
        )  # fmt: skip
        assert reason == "length"
        assert text.startswith("{")
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


@pytest.mark.model
@pytest.mark.slow
def test_refused_formats_are_a_400(server: str, client: Any) -> None:
    openai = pytest.importorskip("openai")
    bad: list[tuple[dict[str, Any], str, str]] = [
        ({"response_format": _json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}})},
         "response_format", "cannot be compiled"),
        ({"response_format": _json_schema({"type": "object", "description": "x" * 70000})},
         "response_format", "at most 65536"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
        ({"response_format": {"type": "json_object", "json_schema": {"schema": {}}}}, "response_format", "only"),
        ({"response_format": _json_schema({"type": "nonsense"})}, "response_format", "cannot be compiled"),
        ({"response_format": _json_schema({"type": "array", "uniqueItems": True})}, "response_format",
         "'uniqueItems' is not supported"),
        ({"guided_regex": "a(b"}, "guided_regex", "cannot be compiled"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", ""),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice", "one output"),
    ]  # fmt: skip
    for extra, param, message in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body=extra
            )
        error = info.value.body
        assert info.value.status_code == 400 and error["param"] == param, (extra, error)
        assert message in error["message"], (extra, error)
    # the server still answers a constrained request afterwards
    ((text, _),) = _answers(client, False, ASK["color"], False, response_format=_json_schema(COLOR), temperature=0)
    _valid(text, COLOR)
