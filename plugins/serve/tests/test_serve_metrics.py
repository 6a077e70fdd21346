"""``GET /metrics`` of ``anyquant serve`` (issue #43, section 5): Prometheus' text format, vLLM's names under
``anyquant:``, on a real uvicorn server with a stand-in engine (no model: a second or two). The counters and
histogram counts match the requests made and the ``usage`` they answered; the gauges are read from the engine
when scraped; each app keeps its own registry; the API key does not guard the page; ``metrics=False`` removes it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
pytest.importorskip("pydantic")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from anyquant_serve.scheduler import Finished, Request
from plugins.serve.tests.servers import in_thread

NAME = "fake"
KEY = "secret"


class FakeAdapter:
    """One token per character; every generated token decodes to one letter."""

    context = 256
    eos_ids = frozenset({0})

    def encode(self, prompt: Any, chat: bool) -> list[int]:
        text = "".join(m["role"] + m["content"] for m in prompt) if chat else prompt
        return [1 + ord(c) % 99 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def vocab_size(self) -> int:
        return 100


class FakeScheduler:
    """Generates ``min(max_tokens, 3)`` tokens a few milliseconds apart: ``length`` when that is ``max_tokens``,
    else ``stop`` (an end of sequence after the third)."""

    capacity = 64
    running = waiting = 0

    def __init__(self) -> None:
        self.adapter = FakeAdapter()

    def submit(self, work: Request) -> None:
        threading.Thread(target=self._run, args=(work,), daemon=True).start()

    def _run(self, work: Request) -> None:
        tokens = min(work.max_tokens, 3)
        for i in range(tokens):
            time.sleep(0.005)
            work.emit(self.adapter.decode([i]))
        reason = "length" if tokens == work.max_tokens else "stop"
        work.finish(Finished(reason, len(work.ids), tokens))

    def close(self, timeout: float | None = None) -> None:
        pass


@contextlib.contextmanager
def _server(scheduler: Any, **config: Any) -> Iterator[int]:
    from anyquant_serve.app import ServerConfig, build_app

    with in_thread(build_app(scheduler, ServerConfig(NAME, **config))) as (port, _):
        yield port


def _call(port: int, method: str, path: str, body: Any = None) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        conn.request(method, path, None if body is None else json.dumps(body), headers if body is not None else {})
        answer = conn.getresponse()
        return answer.status, answer.getheader("content-type") or "", answer.read().decode()
    finally:
        conn.close()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``GET /metrics`` (no key) parsed: each sample's value by its name and labels."""
    status, kind, text = _call(port, "GET", "/metrics")
    assert status == 200 and kind.startswith("text/plain"), (status, kind)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return samples


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[name, tuple(sorted({"model_name": NAME, **labels}.items()))]


def _usage_of_stream(text: str) -> dict[str, int]:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]  # type: ignore[no-any-return]


def test_metrics_count_the_requests_and_their_usage() -> None:
    scheduler = FakeScheduler()
    with _server(scheduler, api_key=KEY) as port:
        before = _scrape(port)
        assert _value(before, "anyquant:request_success_total", finished_reason="stop") == 0
        assert _value(before, "anyquant:time_to_first_token_seconds_count") == 0

        usages = []
        chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        status, _, text = _call(port, "POST", "/v1/chat/completions", chat)
        assert status == 200, text
        usages.append(json.loads(text)["usage"])
        streamed = {"model": NAME, "prompt": "Hello", "max_tokens": 10, "stream": True}
        streamed["stream_options"] = {"include_usage": True}
        status, _, text = _call(port, "POST", "/v1/completions", streamed)
        assert status == 200, text
        usages.append(_usage_of_stream(text))
        status, _, text = _call(port, "POST", "/v1/chat/completions", {**chat, "n": 2, "max_tokens": 3})
        assert status == 200, text
        usages.append(json.loads(text)["usage"])
        assert _call(port, "GET", "/v1/models")[0] == 401  # (no key sent) while /metrics answered without one

        scheduler.running, scheduler.waiting = 2, 5  # read when scraped
        after = _scrape(port)

    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    assert (prompt, completion) == (len("userHi") * 2 + len("Hello"), 2 + 3 + 3 * 2)
    assert _value(after, "anyquant:prompt_tokens_total") == prompt
    assert _value(after, "anyquant:generation_tokens_total") == completion
    reasons = {r: _value(after, "anyquant:request_success_total", finished_reason=r) for r in ("stop", "length")}
    assert reasons == {"stop": 1, "length": 3}  # one per choice: the stream's stop, the chat's 1 + 2 lengths
    for other in ("tool_calls", "abort", "timeout", "error"):
        assert _value(after, "anyquant:request_success_total", finished_reason=other) == 0
    assert _value(after, "anyquant:request_prompt_tokens_count") == 3  # HTTP requests
    assert _value(after, "anyquant:request_prompt_tokens_sum") == prompt
    assert _value(after, "anyquant:request_generation_tokens_sum") == completion
    for name in (
        "anyquant:request_generation_tokens",
        "anyquant:time_to_first_token_seconds",
        "anyquant:request_time_per_output_token_seconds",
        "anyquant:e2e_request_latency_seconds",
    ):
        assert _value(after, name + "_count") == 4, name  # choices
        assert _value(after, name + "_bucket", le="+Inf") == 4, name
    assert (
        0
        < _value(after, "anyquant:time_to_first_token_seconds_sum")
        < _value(after, "anyquant:e2e_request_latency_seconds_sum")
    )
    assert _value(after, "anyquant:request_time_per_output_token_seconds_sum") > 0
    assert _value(after, "anyquant:num_requests_running") == 2
    assert _value(after, "anyquant:num_requests_waiting") == 5


def test_each_app_has_its_own_registry_and_metrics_can_be_off() -> None:
    from anyquant_serve.app import ServerConfig, build_app

    build_app(FakeScheduler(), ServerConfig(NAME))  # a second app in the process: no duplicated series
    with _server(FakeScheduler()) as first, _server(FakeScheduler()) as second:
        chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        assert _call(first, "POST", "/v1/chat/completions", chat)[0] == 200
        assert _value(_scrape(first), "anyquant:generation_tokens_total") == 1
        assert _value(_scrape(second), "anyquant:generation_tokens_total") == 0
    with _server(FakeScheduler(), metrics=False) as port:
        assert _call(port, "GET", "/metrics")[0] == 404


def test_finished_reasons() -> None:
    """The engine's reason, or the answer's when the app gives one (``stop`` becomes ``tool_calls``); a client gone
    mid-stream counts its choices with the engine's reason, or ``abort`` for those cancelled."""
    from anyquant_serve.metrics import Metrics

    metrics = Metrics(FakeScheduler(), NAME)
    stats = metrics.request(5, time.monotonic())
    stats.finished(0, "stop", 3)
    stats.outcome(0, "tool_calls")
    stats.finished(1, "stop", 1)  # never answered: the client went away after it ended
    stats.finished(2, "timeout", 0)
    stats.finished(3, "error", 0)
    stats.close()
    stats.finished(4, "cancelled", 2)  # ended after the client went away
    stats.outcome(0, "stop")  # counted once
    counts = {r: c._value.get() for r, c in metrics.success.items()}
    assert counts == {"stop": 1, "length": 0, "tool_calls": 1, "abort": 1, "timeout": 1, "error": 1}
    assert metrics.generation_tokens._value.get() == 6
