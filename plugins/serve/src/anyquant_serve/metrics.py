"""``GET /metrics`` of ``anyquant serve``: Prometheus' text format, named like vLLM's metrics (``anyquant:`` for
``vllm:``) where the meaning is the same, every series labelled with ``model_name``.

Each app owns its :class:`~prometheus_client.CollectorRegistry` (never the process-wide default one): anyquant is
a library, and two servers in one process keep their own counts. The running and waiting gauges and the prefix
cache's counters (tokens looked up and found, as vLLM's ``prefix_cache_queries``/``prefix_cache_hits``) are read
from the scheduler when scraped (0 for an engine without them); the rest is counted as requests end
(:class:`RequestStats`, one per HTTP request, its methods called from the scheduler's thread and the event loop
alike).
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["Metrics", "RequestStats"]

# vLLM's buckets, the slow end extended: a CPU prefill of a long prompt takes minutes
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
TPOT_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(20.0, 40.0, 80.0),
)
E2E_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0),
    *(480.0, 960.0, 1920.0, 7680.0),
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

#: how a request ended (``finished_reason``): the answer's ``finish_reason`` (``stop``, ``length``, ``tool_calls``),
#: or ``abort`` (the client went away), ``timeout`` (past ``--timeout``), ``error`` (generation failed)
REASONS = ("stop", "length", "tool_calls", "abort", "timeout", "error")


class Metrics:
    """The server's metrics in a registry of their own; :meth:`render` is the body of ``GET /metrics``."""

    def __init__(self, scheduler: Any, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        name = ("model_name",)
        kw: dict[str, Any] = {"registry": self.registry}

        def gauge(metric: str, doc: str, read: Any) -> None:
            g = Gauge(metric, doc, name, **kw)
            g.labels(model_name).set_function(lambda: float(read()))

        gauge(
            "anyquant:num_requests_running", "Requests in the running batch.", lambda: getattr(scheduler, "running", 0)
        )
        gauge(
            "anyquant:num_requests_waiting",
            "Requests waiting for a place in the batch.",
            lambda: getattr(scheduler, "waiting", 0),
        )
        self.registry.register(_SchedulerCounters(scheduler, model_name))
        self.prompt_tokens = Counter(
            "anyquant:prompt_tokens",
            "Prompt tokens taken (a prompt once per HTTP request, as usage counts).",
            name,
            **kw,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "anyquant:generation_tokens", "Tokens generated (usage's completion_tokens).", name, **kw
        ).labels(model_name)
        success = Counter(
            "anyquant:request_success",
            "Requests (one per choice) ended, by finished_reason.",
            (*name, "finished_reason"),
            **kw,
        )
        self.success = {reason: success.labels(model_name, reason) for reason in REASONS}
        self.request_prompt_tokens = Histogram(
            "anyquant:request_prompt_tokens", "Prompt tokens per HTTP request.", name, buckets=TOKEN_BUCKETS, **kw
        ).labels(model_name)
        self.request_generation_tokens = Histogram(
            "anyquant:request_generation_tokens", "Tokens generated per request.", name, buckets=TOKEN_BUCKETS, **kw
        ).labels(model_name)
        self.ttft = Histogram(
            "anyquant:time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token leaving the engine.",
            name,
            buckets=TTFT_BUCKETS,
            **kw,
        ).labels(model_name)
        self.tpot = Histogram(
            "anyquant:request_time_per_output_token_seconds",
            "A request's mean seconds per output token after its first.",
            name,
            buckets=TPOT_BUCKETS,
            **kw,
        ).labels(model_name)
        self.e2e = Histogram(
            "anyquant:e2e_request_latency_seconds",
            "Seconds from a request's arrival to its end.",
            name,
            buckets=E2E_BUCKETS,
            **kw,
        ).labels(model_name)

    def render(self) -> tuple[bytes, str]:
        """The exposition and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def request(self, choices: int, start: float) -> RequestStats:
        return RequestStats(self, choices, start)


class _SchedulerCounters:
    """Counters the scheduler keeps itself, read when scraped: the prefix cache's prompt tokens looked up and found
    there (vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits``, counted in tokens)."""

    COUNTERS = (
        ("anyquant:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.", "prefix_cache_queries"),
        ("anyquant:prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached.", "prefix_cache_hits"),
    )

    def __init__(self, scheduler: Any, model_name: str) -> None:
        self.scheduler = scheduler
        self.model_name = model_name

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        for metric, doc, attribute in self.COUNTERS:
            family = CounterMetricFamily(metric, doc, labels=("model_name",))
            family.add_metric((self.model_name,), float(getattr(self.scheduler, attribute, 0) or 0))
            yield family


class RequestStats:
    """One HTTP request's ``choices`` (each an engine request) from ``start`` (``time.monotonic()`` at arrival).

    :meth:`token` and :meth:`finished` come from the engine's thread; :meth:`outcome` gives the answer's
    ``finish_reason`` once the app has made it (``stop`` may become ``tool_calls``), and :meth:`close` counts what
    the app never answered (a stream whose client went away)."""

    def __init__(self, metrics: Metrics, choices: int, start: float) -> None:
        self.metrics = metrics
        self.start = start
        self._lock = threading.Lock()
        self._first: list[float | None] = [None] * choices
        self._ended: list[str | None] = [None] * choices  # the engine's stop/length, awaiting the app's reason
        self._counted = [False] * choices
        self._closed = False

    def prompt(self, tokens: int) -> None:
        self.metrics.prompt_tokens.inc(tokens)
        self.metrics.request_prompt_tokens.observe(tokens)

    def token(self, index: int) -> None:
        """Generated output of choice ``index`` left the engine (text or a token's log-probability)."""
        if self._first[index] is None:
            now = time.monotonic()
            self._first[index] = now
            self.metrics.ttft.observe(now - self.start)

    def finished(self, index: int, reason: str, completion_tokens: int) -> None:
        """Choice ``index`` ended (the scheduler's :class:`~.scheduler.Finished` reason)."""
        m = self.metrics
        if completion_tokens > 0:
            self.token(index)  # an end-of-sequence token alone emits no text: still the first token
        now = time.monotonic()
        m.generation_tokens.inc(completion_tokens)
        m.request_generation_tokens.observe(completion_tokens)
        m.e2e.observe(now - self.start)
        first = self._first[index]
        if first is not None and completion_tokens > 1:
            m.tpot.observe((now - first) / (completion_tokens - 1))
        reason = "abort" if reason == "cancelled" else reason
        with self._lock:
            if reason in ("stop", "length") and not self._closed:
                self._ended[index] = reason
                return
            self._count(index, reason)

    def outcome(self, index: int, reason: str) -> None:
        """The answer's ``finish_reason`` for choice ``index``."""
        with self._lock:
            self._count(index, reason)

    def close(self) -> None:
        """The app is done with the request: choices that ended unanswered count with the engine's reason (those
        still running count when they end, as ``abort``)."""
        with self._lock:
            self._closed = True
            for index, reason in enumerate(self._ended):
                if reason is not None:
                    self._count(index, reason)

    def _count(self, index: int, reason: str) -> None:
        if self._counted[index]:
            return
        self._counted[index] = True
        self._ended[index] = None
        self.metrics.success.get(reason, self.metrics.success["error"]).inc()
