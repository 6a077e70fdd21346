"""``anyquant serve`` against hostile clients (issue #44, items 3 and 4), on a real uvicorn server on a free port
with a stand-in engine (no model to load: a few seconds in all).

Client mistakes are a 4xx in OpenAI's error shape naming the parameter, validated by the pydantic schema before
any work starts (they were 500s, or 200s with the value ignored); a seeded schema fuzz finds no 5xx. Slow and
idle clients (slowloris) are closed after the header timeout, the connection limit holds with more half-sent
connections than it allows while a normal request still succeeds, and repeated error logs are rate-limited.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
pytest.importorskip("pydantic")

from anyquant.errors import ParameterError
from anyquant.params import GenerationParams
from anyquant.results import TokenLogprob
from anyquant_serve.scheduler import Finished, Request
from plugins.serve.tests.servers import ROOT, free_port, in_thread

NAME = "fake"
VOCAB = 100


class FakeAdapter:
    """A tokenizer stand-in: one token per character (mod the vocabulary), refusing text a real tokenizer refuses
    (lone surrogates: a bare ``UnicodeEncodeError``, as the real one raises a bare ``TypeError``)."""

    context = 256
    eos_ids = frozenset({0})

    def encode(self, prompt: Any, chat: bool) -> list[int]:
        text = "".join(m["role"] + m["content"] for m in prompt) if chat else prompt
        text.encode("utf-8")
        return [1 + ord(c) % (VOCAB - 1) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(96 + i % 26) for i in ids)

    def vocab_size(self) -> int:
        return VOCAB

    def token_bytes(self, token: int) -> bytes:
        return self.decode([token]).encode()


class FakeScheduler:
    """An engine that samples one token per request with the real sampler (``sample_next``) on random logits, so a
    parameter that breaks sampling fails here as it does on a model; prompts holding ``HOLD`` wait for
    :meth:`release` (requests in flight, for the connection limit)."""

    full_sampling = prompt_scoring = prompt_only = True
    capacity = 64
    running = waiting = 0

    def __init__(self) -> None:
        import anyquant_runtime.generate  # noqa: F401  (torch: imported now, not during a timed request)

        self.adapter = FakeAdapter()
        self.held: list[Request] = []

    def submit(self, work: Request) -> None:
        if work.ids == self.adapter.encode("HOLD", False):
            self.held.append(work)
            return
        self._run(work)

    def release(self) -> None:
        held, self.held = self.held, []
        for work in held:
            self._run(work)

    def _run(self, work: Request) -> None:
        import torch

        from anyquant_runtime.generate import row_generators, sample_next

        params = work.params
        try:
            if work.prompt_logprobs is not None:
                work.prompt_logprobs([None] + [TokenLogprob(t, "x", -1.0) for t in work.ids[1:]])
            if work.max_tokens == 0:
                work.finish(Finished("length", len(work.ids), 0))
                return
            rng = row_generators(params.seed, 1, "cpu") if params.temperature > 0 else None
            logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
            history = torch.tensor([work.ids])
            token = int(sample_next(logits, params, history, rng, torch.tensor([[1]]))[0])
        except Exception as exc:  # what the real scheduler does with a failed step: the request ends as error
            work.finish(Finished("error", len(work.ids), 0, exc))
            return
        if work.logprob is not None:
            top = tuple((t, "y", -2.0) for t in range(params.top_logprobs))
            work.logprob(TokenLogprob(token, self.adapter.decode([token]), -1.0, top))
        work.emit(self.adapter.decode([token]))
        work.finish(Finished("length", len(work.ids), 1))

    def close(self, timeout: float | None = None) -> None:
        pass


@contextlib.contextmanager
def _server(scheduler: Any = None, body_timeout: float = 30.0, **limits: Any) -> Iterator[tuple[int, Any]]:
    """``anyquant serve``'s app and uvicorn configuration (``uvicorn_config``) on a free port, in a thread."""
    from anyquant_serve.app import ServerConfig, build_app
    from anyquant_serve.http import Limits

    app = build_app(scheduler or FakeScheduler(), ServerConfig(NAME, body_timeout=body_timeout))
    with in_thread(app, Limits(**limits)) as served:
        yield served


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with _server() as (port, _):
        yield port


def _post(port: int, path: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        data = raw if raw is not None else json.dumps(body).encode()  # ensure_ascii: "\ud800" stays an escape
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TEXT = {"model": NAME, "prompt": "Hello", "max_tokens": 2}


def _is_error(answer: Any) -> bool:
    error = answer.get("error") if isinstance(answer, dict) else None
    return (
        isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and error["type"] == "invalid_request_error"
        and isinstance(error["message"], str)
        and "Traceback" not in error["message"]
    )


# ---------------------------------------------------------------------- 3: client mistakes are a 4xx


def _nested(depth: int) -> bytes:
    return b'{"model": "fake", "messages": ' + b"[" * depth + b"]" * depth + b"}"


BAD: list[tuple[str, dict[str, Any], str | None]] = [
    # 500 before
    ("chat", {"logit_bias": {"²": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ("chat", {"temperature": 1e-320}, "temperature"),
    ("text", {"temperature": 5e-324}, "temperature"),
    ("chat", {"model": "\ud800"}, "model"),
    ("chat", {"messages": [{"role": "\ud800", "content": "Hi"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "Hi \udfff"}]}, "messages"),
    ("text", {"prompt": "\ud83d"}, "prompt"),
    ("chat", {"stop": ["\ud800"]}, "stop"),
    # 200 before, the value ignored
    ("chat", {"stop": 7}, "stop"),
    ("chat", {"stop": {"a": 1}}, "stop"),
    ("chat", {"stop": True}, "stop"),
    ("text", {"stop": 1.5}, "stop"),
    ("chat", {"stream_options": 5}, "stream_options"),
    ("chat", {"stream": True, "stream_options": False}, "stream_options"),
    ("chat", {"stream": True, "stream_options": []}, "stream_options"),
    ("text", {"stream": True, "stream_options": 0}, "stream_options"),
    ("chat", {"stream_options": "yes"}, "stream_options"),
    ("chat", {"stream_options": [True]}, "stream_options"),
    ("chat", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    # strict types, bounds and the rest of the schema
    ("chat", {"max_tokens": "5"}, "max_tokens"),
    ("chat", {"n": 2.0}, "n"),
    ("chat", {"n": True}, "n"),
    ("chat", {"n": 10**30}, "n"),
    ("chat", {"seed": 2**63}, "seed"),
    ("chat", {"temperature": "0.5"}, "temperature"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("chat", {"logit_bias": {"100": 1}}, "logit_bias"),  # past the vocabulary
    ("text", {"prompt": [1, 100]}, "prompt"),
    ("text", {"prompt": [1, -1]}, "prompt"),
    ("text", {"prompt": ["a", "b"]}, "prompt"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages",
    ),
    ("chat", {"messages": [{"role": "user"}], "mesages": []}, "mesages"),  # unknown: refused, as OpenAI does
    ("chat", {"max_new_tokens": 5}, "max_new_tokens"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("text", {"best_of": True}, "best_of"),
]


@pytest.mark.parametrize(("route", "change", "param"), BAD, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(BAD)])
def test_client_mistakes_are_a_400_naming_the_parameter(
    port: int, route: str, change: dict[str, Any], param: str | None
) -> None:
    base = CHAT if route == "chat" else TEXT
    status, answer = _post(port, "/v1/chat/completions" if route == "chat" else "/v1/completions", {**base, **change})
    assert status == 400, answer
    assert _is_error(answer), answer
    assert answer["error"]["param"] == param, answer
    assert answer["error"]["code"] in ("invalid_value", "unsupported_parameter", "unknown_parameter"), answer


def test_deep_json_is_a_400_before_parsing(port: int) -> None:
    """Nesting past 64 levels is refused before the parser runs (100,000 levels were a RecursionError, a 500)."""
    for depth in (65, 2_000, 100_000):
        status, answer = _post(port, "/v1/chat/completions", None, raw=_nested(depth))
        assert status == 400 and _is_error(answer) and answer["error"]["code"] == "invalid_json", (depth, answer)
        assert "64" in answer["error"]["message"]
    status, answer = _post(port, "/v1/chat/completions", None, raw=_nested(40))  # deep, not too deep: the schema's
    assert status == 400 and answer["error"]["param"] == "messages"
    inf = b'{"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"5": 1e999}}'
    status, answer = _post(port, "/v1/chat/completions", None, raw=inf)  # 1e999 parses as inf: not finite
    assert status == 400 and answer["error"]["param"] == "logit_bias", answer
    for raw in (b'{"model": "fake", "temperature": NaN}', b'{"model": 1' + b"0" * 5000 + b"}", b"[1]", b'"\\"' * 3):
        status, answer = _post(port, "/v1/chat/completions", None, raw=raw)
        assert status == 400 and answer["error"]["code"] == "invalid_json", raw[:40]


def test_valid_edges_are_answered(port: int) -> None:
    """What OpenAI's schema allows is answered: ``n: 8`` with the largest seed (choice i samples with seed + i,
    from 0 again past 2**63 - 1; a 500 before), the smallest temperature float32 holds, an assistant message sent
    back as the API returned it (its empty ``tool_calls``, ``refusal``), ``user`` and ``metadata``."""
    status, answer = _post(port, "/v1/chat/completions", {**CHAT, "n": 8, "seed": 2**63 - 1, "temperature": 1})
    assert status == 200 and [c["index"] for c in answer["choices"]] == list(range(8)), answer
    status, answer = _post(port, "/v1/completions", {**TEXT, "temperature": 1e-45, "seed": 3})
    assert status == 200, answer
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None, "function_call": None},
        {"role": "user", "content": [{"type": "text", "text": "again"}]},
    ]
    body = {**CHAT, "messages": history, "user": "u1", "metadata": {"k": "v"}, "stop": [], "tools": []}
    status, answer = _post(port, "/v1/chat/completions", body)
    assert status == 200, answer


def test_echo_scores_prompts_up_to_the_context() -> None:
    """``echo`` with ``logprobs`` took prompts of at most 4,096 tokens (one forward held every position's logits);
    scored in prefill chunks it takes what any prompt takes, the model's context: 6,000 tokens of an 8,192-token
    context are answered with 6,000 entries, and 8,193 are ``context_length_exceeded``, as without ``echo``."""
    scheduler = FakeScheduler()
    scheduler.adapter.context = 8192
    body = {"model": NAME, "echo": True, "logprobs": 1, "max_tokens": 0}
    with _server(scheduler) as (port, _):
        status, answer = _post(port, "/v1/completions", {**body, "prompt": "a" * 6000})
        assert status == 200, answer
        logprobs = answer["choices"][0]["logprobs"]
        assert len(logprobs["token_logprobs"]) == 6000 and logprobs["token_logprobs"][0] is None
        status, answer = _post(port, "/v1/completions", {**body, "prompt": "a" * 8193})
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer


def test_tiny_temperature_is_a_typed_error_in_the_python_api() -> None:
    """``temperature=1e-320`` rounds to 0 in float32 and made the sampler divide 0 by 0: torch raised a bare
    ``RuntimeError`` at the first token (``anyquant.generate`` too). Now a ``ParameterError`` when made."""
    with pytest.raises(ParameterError, match="temperature"):
        GenerationParams(temperature=1e-320)
    assert GenerationParams(temperature=1e-45).temperature == 1e-45  # float32's smallest: still samples


def _raw(port: int, data: bytes, wait: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
    return out


def _answer(raw: bytes) -> tuple[int, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_malformed_http_is_answered_in_openai_shape(port: int) -> None:
    """What h11 refuses before the app sees a request (uvicorn answered it ``400 Invalid HTTP request received.``
    in plain text): a malformed ``Content-Length`` is a 400, headers over ``--max-header-kb`` a 431, in OpenAI's
    shape."""
    for length in (b"abc", b"-1", b"\xc2\xb2", b"1 2"):
        raw = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n{}")
        status, answer = _answer(raw)
        assert status == 400 and _is_error(answer) and answer["error"]["code"] == "invalid_http", raw
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    status, answer = _answer(_raw(port, big))
    assert status == 431 and _is_error(answer) and answer["error"]["code"] == "headers_too_large"


def _mutations(rng: random.Random) -> list[Any]:
    odd = ["", "\ud800", "\udfff\ud800", "\x00", "²", "٣", "\U0001d7d8", "\u202e", "a" * 5000, " " * 3]
    return [
        None, True, False, 0, -1, 1, 2, 3.5, -0.0, 1e-320, 1e308, -1e308, 2**63, -(2**63), 10**40,
        rng.choice(odd), [], [rng.choice(odd)], {}, {rng.choice(odd): 1}, [[[[1]]]], {"a": {"b": [None]}},
        [1] * rng.randint(1, 20), {"type": "text"}, {"include_usage": rng.choice([True, 1, "x"])},
        rng.random() * rng.choice([1, 10, 1e6]), rng.randint(-(2**70), 2**70),
    ]  # fmt: skip


FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
    "seed", "stop", "stream", "stream_options", "logit_bias", "presence_penalty", "frequency_penalty", "min_p",
    "repetition_penalty", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "response_format", "tools",
    "tool_choice", "user", "metadata", "unknown_field",
]  # fmt: skip


def _valid(rng: random.Random, chat: bool) -> dict[str, Any]:
    """A random body the schema allows."""
    body: dict[str, Any] = dict(CHAT if chat else TEXT)
    text = "".join(rng.choice(["a", "é", "🙂", " ", "\n", "\x00", "語"]) for _ in range(rng.randint(1, 12)))
    if chat:
        body["messages"] = [
            {
                "role": rng.choice(["user", "system", "assistant"]),
                "content": rng.choice([text, [{"type": "text", "text": text}]]),
            }
        ]
    else:
        body["prompt"] = rng.choice([text, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))], [text]])
    choices: dict[str, Any] = {
        "temperature": rng.choice([0, 1e-45, rng.uniform(0, 2), 2]),
        "top_p": rng.choice([1, rng.uniform(1e-9, 1)]),
        "top_k": rng.choice([0, 1, rng.randint(0, 10**6)]),
        "n": rng.randint(1, 8),
        "seed": rng.choice([0, 2**63 - 1, rng.randrange(2**63)]),
        "stop": rng.choice([text, [text] * rng.randint(0, 4)]),
        "stream": rng.choice([True, False]),
        "stream_options": {"include_usage": rng.choice([True, False])},
        "logit_bias": {str(rng.randrange(VOCAB)): rng.uniform(-100, 100) for _ in range(rng.randint(0, 5))},
        "presence_penalty": rng.uniform(-2, 2),
        "frequency_penalty": rng.uniform(-2, 2),
        "min_p": rng.choice([0, rng.uniform(0, 0.99)]),
        "repetition_penalty": rng.uniform(0.01, 10),
        "max_tokens": rng.randint(1, 10**6),
        "user": text,
    }
    for name in rng.sample(sorted(choices), rng.randint(0, len(choices))):
        body[name] = choices[name]
    if chat and rng.random() < 0.5:
        body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 20)
    elif not chat and rng.random() < 0.5:
        body["logprobs"] = rng.randint(0, 20)
        body["echo"] = rng.choice([True, False])
    return body


def _read_stream(port: int, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def test_schema_fuzz_no_5xx(port: int) -> None:
    """Seeded random bodies for 4 seconds: valid ones (every field within OpenAI's schema) are answered 200 with
    no error chunk; mutated ones (a field set to a wrong type, a huge number, odd Unicode, nesting, an unknown
    field) are a 4xx in OpenAI's shape or a 200, never a 5xx."""
    rng = random.Random(44)
    deadline = time.monotonic() + 4.0
    counts = {"valid": 0, "mutated": 0, "refused": 0}
    while time.monotonic() < deadline:
        chat = rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = _valid(rng, chat)
        if rng.random() < 0.4:
            status, raw = _read_stream(port, path, body)
            assert status == 200 and b'"error"' not in raw, (body, raw[:300])
            counts["valid"] += 1
            continue
        for _ in range(rng.randint(1, 3)):
            field = rng.choice(FIELDS)
            value = rng.choice(_mutations(rng))
            if field == "messages" and rng.random() < 0.5:  # inside a message
                body["messages"] = [{"role": "user", "content": value} if rng.random() < 0.5 else {"role": value}]
            else:
                body[field] = value
        status, raw = _read_stream(port, path, body)
        counts["mutated"] += 1
        assert status < 500, (body, raw[:300])
        if status >= 400:
            counts["refused"] += 1
            answer = json.loads(raw)
            assert _is_error(answer) or answer["error"]["code"] == "model_not_found", (body, answer)
        else:
            assert b'"error"' not in raw, (body, raw[:300])
    assert counts["valid"] > 20 and counts["refused"] > 20, counts


# ---------------------------------------------------------------------- 4: slowloris


HALF = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"  # no blank line: headers unfinished


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closes ``sock`` within ``seconds``, and what it sent before."""
    sock.settimeout(0.1)
    deadline = time.monotonic() + seconds
    got = b""
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def _health(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def test_half_sent_connections_past_the_limit() -> None:
    """More half-sent requests than ``max_connections`` (slowloris; 1,100 of them made every request time out
    before): the server never holds more than the limit, a normal request still succeeds meanwhile (the connection
    that waited longest for its headers makes room), and every half-sent one is closed by the header timeout."""
    timeout, limit = 1.5, 8
    with _server(header_timeout=timeout, max_connections=limit) as (port, server):
        socks = []
        for _ in range(3 * limit):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(HALF)
            socks.append(s)
        time.sleep(0.2)
        started = time.monotonic()
        assert _health(port) == 200
        status, answer = _post(port, "/v1/completions", TEXT)
        assert status == 200 and answer["choices"][0]["text"], answer
        assert time.monotonic() - started < 1.0  # at once, not after the half-sent ones time out
        assert len(server.server_state.connections) <= limit
        results = [_closed_within(s, timeout + 2.0) for s in socks]
        assert all(closed for closed, _ in results), "a half-sent connection outlived the header timeout"
        timed_out = [got for _, got in results if got]
        assert timed_out, "none lasted to the header timeout"
        for got in timed_out:  # the ones that lasted were told why
            status, answer = _answer(got)
            assert status == 408 and answer["error"]["code"] == "request_timeout"
        for s in socks:
            s.close()
        assert _health(port) == 200


def test_idle_and_slow_clients_are_closed_after_the_timeouts() -> None:
    """An idle connection, a request whose headers trickle in a byte a time, and a body that never completes are
    closed within their timeout plus slack (200 slow connections stayed open 66 s before: no header timeout)."""
    with _server(header_timeout=1.0, body_timeout=1.0) as (port, _):
        idle = socket.create_connection(("127.0.0.1", port))
        started = time.monotonic()
        closed, got = _closed_within(idle, 3.0)
        assert closed and got == b"" and 0.8 < time.monotonic() - started < 3.0  # idle: closed without a word
        slow = socket.create_connection(("127.0.0.1", port))
        started = time.monotonic()
        for byte in HALF[:5]:  # a byte every 0.15 s: data keeps coming, the headers never finish in time
            slow.sendall(bytes([byte]))
            time.sleep(0.15)
        closed, got = _closed_within(slow, 3.0)
        assert closed and _answer(got)[0] == 408 and time.monotonic() - started < 4.0
        body = socket.create_connection(("127.0.0.1", port))
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        started = time.monotonic()
        closed, got = _closed_within(body, 4.0)
        status, answer = _answer(got)
        assert status == 408 and answer["error"]["code"] == "request_timeout" and time.monotonic() - started < 3.0
        for s in (idle, slow, body):
            s.close()
        assert _health(port) == 200


def test_connections_all_running_requests_get_a_503() -> None:
    """When every connection the limit allows is running a request, a new one is answered 503 (``Retry-After``)
    in OpenAI's shape at once, and served again once they finish."""
    scheduler = FakeScheduler()
    with _server(scheduler, header_timeout=5.0, max_connections=3) as (port, _):
        held = []
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            data = json.dumps({**TEXT, "prompt": "HOLD"}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
            held.append(s)
        deadline = time.monotonic() + 5
        while len(scheduler.held) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        raw = _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, answer = _answer(raw)
        assert status == 503 and b"retry-after: 1" in raw.lower() and answer["error"]["code"] == "too_many_connections"
        scheduler.release()
        for s in held:
            assert b"200 OK" in s.recv(65536)
            s.close()
        time.sleep(0.1)
        assert _health(port) == 200


def test_repeated_errors_are_logged_once_per_interval() -> None:
    """The accept loop's EMFILE error repeated (a 209 MB log in 45 s before): one line per interval, the next
    saying how many were held back."""
    from anyquant_serve.http import RateLimitFilter

    now = [0.0]
    limiter = RateLimitFilter(interval=10.0, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    passed = [limiter.filter(record("socket.accept() out of system resource\nsocket: <fd=3>")) for _ in range(1000)]
    assert passed.count(True) == 1
    assert limiter.filter(record("another message"))
    now[0] = 11.0
    later = record("socket.accept() out of system resource\nsocket: <fd=3>")
    assert limiter.filter(later) and "999 more like this" in later.getMessage()


SERVE_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
sys.path.insert(0, {root!r})
import uvicorn
from test_serve_hardening import FakeScheduler, NAME
from anyquant_serve.plugin import _serve
from anyquant_serve.app import ServerConfig, build_app
from anyquant_serve.http import Limits
scheduler = FakeScheduler()
_serve(build_app(scheduler, ServerConfig(NAME)), scheduler, "127.0.0.1", {port}, 5, Limits(header_timeout=3.0))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="descriptor limits are POSIX")
def test_more_half_sent_connections_than_descriptors(tmp_path: Path) -> None:
    """The attack as it was run: a server process whose descriptor limit is 512 (soft and hard), and 600
    half-sent connections. The default --max-connections (512) is lowered to fit, so the accept loop never runs
    out of descriptors: a normal request is answered meanwhile and the log stays small (EMFILE looped before)."""
    import resource

    port = free_port()
    script = SERVE_SCRIPT.format(tests=str(Path(__file__).parent), root=str(ROOT), port=port)
    log_path = tmp_path / "serve.log"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))

    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=log_file, stderr=log_file, preexec_fn=limit)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()[-2000:]
            try:
                if _health(port) == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        socks = []
        for _ in range(600):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(HALF)
            socks.append(s)
        time.sleep(0.5)
        started = time.monotonic()
        status, answer = _post(port, "/v1/completions", TEXT)
        assert status == 200, answer
        assert time.monotonic() - started < 2.0
        for s in socks:
            s.close()
        time.sleep(0.5)
        text = log_path.read_text()
        assert "lowered to" in text, text[-2000:]
        assert "out of system resource" not in text and len(text) < 20_000, text[-2000:]
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
