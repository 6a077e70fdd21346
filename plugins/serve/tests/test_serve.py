"""``anyquant serve``: a real server process on the bundled model, driven by the official ``openai`` client."""

from __future__ import annotations

import http.client
import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from plugins.serve.tests.servers import serving, start, stop

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")

pytestmark = [pytest.mark.model, pytest.mark.slow]

KEY = "test-key"
NAME = "smol"
QUESTIONS = [
    "What is 2+2?",
    "Name a color.",
    "Write a haiku about the sea and the wind at night.",
    "Hi",
    "What is the capital of France? Answer briefly.",
    "Count to five.",
    "Tell me a joke.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving("--model-name", NAME, "--api-key", KEY, "--max-batch", "8", "--max-queue", "16") as base:
        yield base


@pytest.fixture(scope="module")
def local() -> Iterator[Any]:
    import anyquant

    with anyquant.load(anyquant.default_model()) as model:
        yield model


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _chat(client: Any, question: str, max_tokens: int = 16, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, **kw
    )


def test_models_and_health(server: str, client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    with urllib.request.urlopen(server + "/health") as r:
        assert json.loads(r.read())["status"] == "ok"


def test_chat_equals_generate(client: Any, local: Any) -> None:
    want = local.generate([{"role": "user", "content": QUESTIONS[0]}], max_new_tokens=16)
    n_prompt = len(local.generator.encode([{"role": "user", "content": QUESTIONS[0]}], local.params()))
    n_out = len(local.tokenizer(want, add_special_tokens=False)["input_ids"])
    r = _chat(client, QUESTIONS[0])
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == n_prompt
    assert r.choices[0].finish_reason == "stop"  # the answer ends before 16 tokens
    assert r.usage.completion_tokens == n_out + 1  # its tokens and the end of sequence
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_length_stop_and_stream(client: Any) -> None:
    r = _chat(client, QUESTIONS[2], max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    whole = _chat(client, QUESTIONS[2], max_tokens=12).choices[0].message.content
    word = whole.split()[2]
    cut = _chat(client, QUESTIONS[2], max_tokens=12, stop=[word]).choices[0].message
    assert cut.content == whole[: whole.index(word)]
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": QUESTIONS[2]}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completions_text_and_token_ids(client: Any, local: Any) -> None:
    a = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=6, temperature=0)
    ids = local.tokenizer("The capital of France is")["input_ids"]
    want = local.generate("The capital of France is", max_new_tokens=6)
    assert a.choices[0].text == want and a.usage.prompt_tokens == len(ids)
    b = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert b.choices[0].text == want
    streamed = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want


def test_errors(server: str, client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as e404:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e404.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e400:
        client.chat.completions.create(model=NAME, messages=[], max_tokens=2)
    assert e400.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as temp:
        _chat(client, "hi", max_tokens=2, top_p=7)
    assert temp.value.code == "invalid_value" and temp.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.completions.create(model=NAME, prompt="hi", max_tokens=2, suffix="x")
    assert unsupported.value.code == "unsupported_parameter" and unsupported.value.param == "suffix"
    bad_values: list[tuple[dict[str, Any], str]] = [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"extra_body": {"min_p": 1}}, "min_p"),
        ({"seed": -1}, "seed"),
    ]
    for kw, param in bad_values:
        with pytest.raises(openai.BadRequestError) as bad_value:
            _chat(client, "hi", max_tokens=2, **kw)
        assert bad_value.value.code == "invalid_value" and bad_value.value.param == param, kw
    with pytest.raises(openai.BadRequestError) as legacy:
        client.completions.create(model=NAME, prompt="hi", max_tokens=2, logprobs=21)
    assert legacy.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=NAME, prompt=[1] * 9000, max_tokens=2)
    assert long.value.code == "context_length_exceeded"
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    req = urllib.request.Request(
        server + "/v1/chat/completions",
        data=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(req)
    body = json.loads(raw.value.read())
    assert raw.value.code == 400 and body["error"]["code"] == "invalid_json" and "Traceback" not in json.dumps(body)
    # a body declared over --max-body: 413 as soon as the headers arrive. Only the headers are sent: a client
    # still writing the body when the server answers and closes can see a broken pipe instead of the answer
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Authorization", f"Bearer {KEY}")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(2 << 20))
        conn.endheaders()
        answer = conn.getresponse()
        assert answer.status == 413 and json.loads(answer.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()


def test_client_mistakes_on_the_model_are_a_400(server: str) -> None:
    """Issue #44's bodies against the real model, tokenizer and sampler (a 500 or a 200 ignoring the value before):
    each a 400 naming the parameter, from the schema, before any work. ``n: 8`` with the largest seed is valid
    (choice i samples with seed + i, from 0 again past 2**63 - 1): 8 choices. ``plugins/serve/tests/test_serve_hardening.py``
    has the whole list and the schema fuzz on a stand-in engine."""

    def post(body: dict[str, Any]) -> tuple[int, Any]:
        req = urllib.request.Request(
            server + "/v1/chat/completions",
            data=json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}], **body}).encode(),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    for body, param in [
        ({"logit_bias": {"²": 1}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ({"temperature": 1e-320, "max_tokens": 2}, "temperature"),
        ({"model": "\ud800"}, "model"),
        ({"messages": [{"role": "\ud800", "content": "hi"}]}, "messages"),
        ({"stop": 5}, "stop"),
        ({"stream": True, "stream_options": False}, "stream_options"),
    ]:
        status, answer = post(body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    status, answer = post({"n": 8, "seed": 2**63 - 1, "temperature": 1.0, "max_tokens": 2})
    assert status == 200 and len(answer["choices"]) == 8, answer


def test_disconnect_cancels_the_work(server: str, client: Any) -> None:
    stream = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTIONS[6]}], max_tokens=4000, stream=True
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 60
    while json.loads(urllib.request.urlopen(server + "/health").read())["running"]:
        assert time.monotonic() < deadline, "the abandoned request kept decoding"
        time.sleep(0.1)


def test_sampling_with_a_seed_repeats(client: Any) -> None:
    one, two = (
        _chat(client, QUESTIONS[1], temperature=0.9, seed=7, extra_body={"top_k": 40}).choices[0].message
        for _ in range(2)
    )
    assert one.content == two.content


def test_eight_concurrent_clients_answer_as_one(client: Any) -> None:
    """Greedy answers under 8 concurrent clients (one batched decode) equal the answers one client gets alone."""
    alone = [_chat(client, q, max_tokens=20).choices[0].message.content for q in QUESTIONS]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda q: _chat(client, q, max_tokens=20).choices[0].message.content, QUESTIONS))
    assert together == alone
    assert len(set(alone)) == len(alone)


def test_queue_full_is_503() -> None:
    proc, base = start("--model-name", NAME, "--max-batch", "1", "--max-queue", "0")
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300)
        # n choices past what the batch and the queue hold together: never servable, a 400 naming n (was a 503)
        with pytest.raises(openai.BadRequestError) as too_many:
            _chat(c, "hi", 2, n=2)
        assert too_many.value.param == "n"
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(_chat, c, "Count to fifty.", 48) for _ in range(3)]
            outcomes = []
            for f in futures:
                try:
                    f.result()
                    outcomes.append("ok")
                except openai.InternalServerError as exc:
                    outcomes.append(exc.status_code)
        assert 503 in outcomes and "ok" in outcomes
        # SIGTERM while a request runs: it finishes, then the server stops (uvicorn re-raises the signal)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_chat, c, "Count to fifty.", 32)
            deadline = time.monotonic() + 60
            while json.loads(urllib.request.urlopen(base + "/health").read())["running"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            answer = running.result()
        assert answer.usage.completion_tokens == 32
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_scheduler_timeout_cancel_and_length(local: Any) -> None:
    """The scheduler in-process: a request past its deadline ends as ``timeout``, a cancelled one as ``cancelled``
    (neither decodes), and a budget of 3 tokens ends as ``length`` with 3 tokens counted."""
    import threading

    from anyquant_serve.scheduler import Finished, ModelAdapter, Request, Scheduler

    adapter = ModelAdapter(local)
    scheduler = Scheduler(adapter, max_batch=4, max_queue=4)
    ids = adapter.encode([{"role": "user", "content": QUESTIONS[2]}], chat=True)
    ends: dict[str, Finished] = {}
    done = threading.Event()

    def request(name: str, max_tokens: int, deadline: float | None = None) -> Request:
        def finish(f: Finished) -> None:
            ends[name] = f
            if len(ends) == 3:
                done.set()

        return Request(ids, local.params(), max_tokens, lambda text: None, finish, deadline)

    late = request("late", 50, deadline=time.monotonic() - 1)
    gone = request("gone", 50)
    gone.cancel()
    for r in (late, gone, request("short", 3)):
        scheduler.submit(r)
    assert done.wait(120)
    scheduler.close(30)
    assert ends["late"].reason == "timeout" and ends["late"].completion_tokens == 0
    assert ends["gone"].reason == "cancelled" and ends["gone"].completion_tokens == 0
    assert ends["short"].reason == "length" and ends["short"].completion_tokens == 3
    assert ends["short"].prompt_tokens == len(ids)


def _close(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max((abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)), default=0.0) < 2e-3


def _want(local: Any, question: str, max_tokens: int, top: int) -> tuple[Any, list[tuple[str, float]]]:
    r = local.complete(
        [{"role": "user", "content": question}], max_new_tokens=max_tokens, logprobs=True, top_logprobs=top
    )
    return r, [(lp.text, lp.logprob) for lp in r.logprobs]


def _chat_pairs(logprobs: Any) -> list[tuple[str, float]]:
    return [(c.token, c.logprob) for c in logprobs.content]


def test_chat_logprobs_equal_complete(client: Any, local: Any) -> None:
    """``logprobs``/``top_logprobs`` in OpenAI's chat shape: the tokens and log-probabilities ``complete`` reports
    (the end-of-sequence token included), whole and streamed."""
    want, pairs = _want(local, QUESTIONS[0], 16, 3)
    r = _chat(client, QUESTIONS[0], logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    _close(_chat_pairs(r.choices[0].logprobs), pairs)
    assert r.choices[0].message.content == want.text
    for got, lp in zip(content, want.logprobs, strict=True):
        assert got.bytes == list(got.token.encode())
        assert [t.token for t in got.top_logprobs] == [t for _, t, _ in lp.top]
        assert all(abs(t.logprob - v) < 2e-3 for t, (_, _, v) in zip(got.top_logprobs, lp.top, strict=True))
        assert got.top_logprobs[0].logprob >= got.logprob - 2e-3  # greedy: the token is the best one
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            max_tokens=16,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=3,
        )
    )
    streamed = [p for c in chunks if c.choices and c.choices[0].logprobs for p in _chat_pairs(c.choices[0].logprobs)]
    _close(streamed, pairs)
    assert _chat(client, QUESTIONS[0]).choices[0].logprobs is None  # not asked: none


def test_concurrent_logprobs_equal_complete(client: Any, local: Any) -> None:
    """Several clients at once (rows of one batched decode step): each gets ``complete``'s log-probabilities."""
    questions = QUESTIONS[:6]
    wants = [_want(local, q, 12, 2)[1] for q in questions]
    with ThreadPoolExecutor(len(questions)) as pool:
        answers = list(pool.map(lambda q: _chat(client, q, 12, logprobs=True, top_logprobs=2), questions))
    for answer, want in zip(answers, wants, strict=True):
        _close(_chat_pairs(answer.choices[0].logprobs), want)


def test_completions_logprobs_legacy_shape(client: Any, local: Any) -> None:
    prompt = "The capital of France is"
    want = local.complete(prompt, max_new_tokens=6, logprobs=True, top_logprobs=2)
    a = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    lp = a.choices[0].logprobs
    _close(list(zip(lp.tokens, lp.token_logprobs, strict=True)), [(x.text, x.logprob) for x in want.logprobs])
    assert [list(d) for d in lp.top_logprobs] == [[t for _, t, _ in x.top] for x in want.logprobs]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=0, stream=True
    )
    tokens, offsets = [], []
    for c in streamed:
        if c.choices and c.choices[0].logprobs:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_logit_bias_penalties_min_p_and_seed_as_complete(client: Any, local: Any) -> None:
    """``logit_bias``, the presence/frequency penalties and ``min_p`` (an extension) with a seed give the text
    ``complete`` gives with the same parameters."""
    forced = local.tokenizer(" blue", add_special_tokens=False)["input_ids"][0]
    r = _chat(client, QUESTIONS[3], max_tokens=3, logit_bias={str(forced): 100})
    assert r.choices[0].message.content == local.tokenizer.decode([forced] * 3)
    msgs = [{"role": "user", "content": "Repeat the word cat ten times."}]
    plain = local.complete(msgs, max_new_tokens=24).text
    kw = {"presence_penalty": 1.5, "frequency_penalty": 1.0}
    penalised = local.complete(msgs, max_new_tokens=24, **kw).text
    assert penalised != plain  # the penalties matter on this prompt
    got = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0, **kw)
    assert got.choices[0].message.content == penalised
    sampled = local.complete(msgs, max_new_tokens=16, temperature=1.0, seed=11, min_p=0.2).text
    with ThreadPoolExecutor(3) as pool:  # batched rows sample as one row alone does
        outs = list(
            pool.map(
                lambda _: client.chat.completions.create(
                    model=NAME, messages=msgs, max_tokens=16, temperature=1.0, seed=11, extra_body={"min_p": 0.2}
                ),
                range(3),
            )
        )
    assert [o.choices[0].message.content for o in outs] == [sampled] * 3


def test_n_choices(client: Any) -> None:
    """``n`` choices, each a row of the batched decode: greedy ones are equal; with a seed, choice i samples with
    seed + i, so the same request repeats its choices; usage counts the prompt once and every choice's tokens."""
    one = _chat(client, QUESTIONS[1], max_tokens=8)
    r = _chat(client, QUESTIONS[1], max_tokens=8, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.message.content for c in r.choices} == {one.choices[0].message.content}
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    a = _chat(client, QUESTIONS[2], max_tokens=12, n=3, temperature=1.0, seed=7)
    b = _chat(client, QUESTIONS[2], max_tokens=12, n=3, temperature=1.0, seed=7)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # seeds 7, 8, 9: not one answer three times
    first = _chat(client, QUESTIONS[2], max_tokens=12, temperature=1.0, seed=7)
    assert first.choices[0].message.content == a.choices[0].message.content
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": QUESTIONS[2]}],
        max_tokens=12,
        n=3,
        temperature=1.0,
        seed=7,
        stream=True,
    )
    texts = ["", "", ""]
    for c in stream:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in a.choices]
    with pytest.raises(openai.BadRequestError) as too_many:
        _chat(client, "hi", max_tokens=2, n=9)
    assert too_many.value.param == "n"


def test_echo(client: Any, local: Any) -> None:
    """Completions' ``echo``: the prompt before the answer, whole and streamed; with ``logprobs`` the prompt
    tokens' log-probabilities too (the first ``null``), which sum to what ``loglikelihood`` gives; with
    ``max_tokens: 0`` only the prompt, scored (what evaluation harnesses ask of an OpenAI server)."""
    prompt = "The capital of France is"
    want = local.generate(prompt, max_new_tokens=4)
    a = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert a.choices[0].text == prompt + want
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt + want
    ids = local.tokenizer(prompt)["input_ids"]
    scored = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
    ((total, _),) = local.loglikelihood([(ids[:1], ids[1:])])
    assert abs(sum(lp.token_logprobs[1:]) - total) < 2e-3 * len(ids)
    both = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=0)
    blp = both.choices[0].logprobs
    assert both.choices[0].text == prompt + want and len(blp.tokens) > len(ids)
    assert blp.text_offset == [sum(len(t) for t in blp.tokens[:i]) for i in range(len(blp.tokens))]
    with pytest.raises(openai.BadRequestError) as chat_echo:
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"echo": True}
        )
    assert chat_echo.value.param == "echo"


def test_logprob_bytes_of_a_partial_character(client: Any, local: Any) -> None:
    """A token holding part of a UTF-8 character: its ``bytes`` are exact and its ``token`` is OpenAI's
    ``bytes:\\x..`` spelling (its text alone would be U+FFFD)."""
    from anyquant_runtime.tokenizer import token_bytes

    tok = local.tokenizer
    ids = tok("🙂", add_special_tokens=False)["input_ids"]
    partial = next(i for i in ids if "\ufffd" in tok.decode([i]))
    r = _chat(client, "hi", max_tokens=1, logprobs=True, logit_bias={str(partial): 100})
    got = r.choices[0].logprobs.content[0]
    raw = token_bytes(tok, partial)
    assert got.bytes == list(raw) and got.token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_a_failed_prefill_is_answered(local: Any) -> None:
    """A request whose prefill raises (a token id past the embedding) ends as ``error`` at once; it used to be
    dropped without a word, its client waiting until its timeout. The next request runs as usual."""
    import threading

    from anyquant_serve.scheduler import Finished, ModelAdapter, Request, Scheduler

    adapter = ModelAdapter(local)
    scheduler = Scheduler(adapter, max_batch=2, max_queue=2)
    ends: list[Finished] = []
    done = threading.Event()

    def finish(f: Finished) -> None:
        ends.append(f)
        if len(ends) == 2:
            done.set()

    bad = Request([1, 10**8], local.params(), 3, lambda text: None, finish, time.monotonic() + 300)
    good = Request([1, 2, 3], local.params(), 2, lambda text: None, finish, time.monotonic() + 300)
    scheduler.submit(bad)
    scheduler.submit(good)
    assert done.wait(60)
    scheduler.close(30)
    assert ends[0].reason == "error" and ends[0].error is not None
    assert ends[1].reason == "length" and ends[1].completion_tokens == 2


def test_choices_share_one_prefill(local: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests queued together with one prompt (the ``n`` choices of a request) are prefilled once, the others
    copying its cache; each choice still samples exactly what ``generate`` gives with its seed, and scoring the
    prompt (``echo`` with ``logprobs``) runs once too."""
    import threading

    from anyquant_serve.batch import DecodeBatch
    from anyquant_serve.scheduler import DEFAULT_PREFILL_CHUNK, Finished, ModelAdapter, Request, Scheduler

    calls = {"prefill": 0, "score": 0}
    prefill, score = DecodeBatch.prefill, DecodeBatch.score

    def counted_prefill(self: Any, *args: Any) -> Any:
        calls["prefill"] += 1
        return prefill(self, *args)

    def counted_score(self: Any, *args: Any) -> Any:
        calls["score"] += 1
        return score(self, *args)

    monkeypatch.setattr(DecodeBatch, "prefill", counted_prefill)
    monkeypatch.setattr(DecodeBatch, "score", counted_score)
    adapter = ModelAdapter(local)
    scheduler = Scheduler(adapter, max_batch=4, max_queue=4)
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    ids = adapter.encode(messages, chat=True)
    texts: dict[int, list[str]] = {s: [] for s in (7, 8, 9)}
    ends: dict[int, Finished] = {}
    scored: dict[int, list[Any]] = {}
    done = threading.Event()

    def request(seed: int) -> Request:
        def finish(f: Finished) -> None:
            ends[seed] = f
            if len(ends) == 3:
                done.set()

        params = local.params(temperature=1.0, seed=seed, logprobs=True)
        work = Request(ids, params, 8, texts[seed].append, finish, time.monotonic() + 300)
        work.logprob = lambda lp: None
        work.prompt_logprobs, work.prompt_top = (lambda items, s=seed: scored.__setitem__(s, items)), 0
        return work

    scheduler.submit_many([request(s) for s in (7, 8, 9)])
    assert done.wait(120)
    scheduler.close(30)
    assert len(ids) <= DEFAULT_PREFILL_CHUNK  # one chunk: scored in one forward, prefilled in one
    assert calls == {"prefill": 1, "score": 1}
    assert all(ends[s].reason in ("stop", "length") for s in ends)
    for seed in (7, 8, 9):
        assert "".join(texts[seed]) == local.generate(messages, max_new_tokens=8, temperature=1.0, seed=seed)
        assert [lp and lp.logprob for lp in scored[seed]] == [lp and lp.logprob for lp in scored[7]]
    assert len({"".join(t) for t in texts.values()}) > 1  # three seeds, not one answer copied


def test_logprob_bytes_concatenate_to_the_answer(client: Any) -> None:
    """An answer of emoji (each split across byte-level tokens): the ``bytes`` of its tokens, whole and streamed,
    concatenate to the UTF-8 of its text; the partial tokens are spelled ``bytes:\\x..``, and every alternative's
    ``bytes`` is its text's UTF-8 unless it too is spelled that way."""
    kw: dict[str, Any] = {"max_tokens": 12, "logprobs": True, "top_logprobs": 2}
    r = _chat(client, "Repeat: 🙂🙂🙂", **kw)
    choice = r.choices[0]
    content = choice.logprobs.content
    tokens = content[:-1] if choice.finish_reason == "stop" else content  # the end-of-sequence token
    assert "🙂" in choice.message.content and any(t.token.startswith("bytes:") for t in tokens)
    assert b"".join(bytes(t.bytes) for t in tokens) == choice.message.content.encode()
    for t in content:
        for alt in [t, *t.top_logprobs]:
            if not alt.token.startswith("bytes:"):
                assert bytes(alt.bytes) == alt.token.encode()
    streamed = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Repeat: 🙂🙂🙂"}], temperature=0, stream=True, **kw
    )
    pieces = [c.choices[0].logprobs.content for c in streamed if c.choices and c.choices[0].logprobs]
    assert [bytes(t.bytes) for p in pieces for t in p] == [bytes(t.bytes) for t in content]


def test_serve_says_what_it_loads_and_the_name_clients_send() -> None:
    """A first-day user waited in silence while it loaded and was never told the model id to send (#44 item 13)."""
    proc, _ = start("--model-name", NAME)
    stop(proc)
    err = proc.stderr.read().decode()  # type: ignore[union-attr]
    assert "anyquant serve: loading " in err
    assert f"model '{NAME}' (what clients send as `model`)" in err
    assert err.index("loading") < err.index("/v1")


def test_plain_greedy_rows_take_one_argmax() -> None:
    """The shared step's greedy rows (no grammar, bias, penalty or log-probabilities) are sampled by one argmax over
    them: each the token :func:`~anyquant_runtime.generate.sample_next` gives it (the first largest logit); the other
    rows, and a row whose logits are not all finite, are left to the per-row sampler."""
    import torch

    from anyquant.plugin import GenerationParams
    from anyquant_runtime.generate import sample_next
    from anyquant_serve.scheduler import Scheduler

    def row(greedy: bool) -> Any:
        return type("Row", (), {"plain_greedy": greedy})()

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    logits[0, [7, 9]] = 50.0  # a tie: the first index, as argmax gives it
    logits[3, 4] = float("nan")
    live = [row(True), row(False), row(True), row(True), row(True)]
    got = Scheduler._greedy(live, logits)
    empty = torch.empty((1, 0), dtype=torch.long)
    want = {i: int(sample_next(logits[i : i + 1], GenerationParams(temperature=0), empty, None)[0]) for i in (0, 2, 4)}
    assert got == want and got[0] == 7
    assert Scheduler._greedy([row(True), row(False)], logits[:2]) == {}  # one greedy row: the per-row sampler
