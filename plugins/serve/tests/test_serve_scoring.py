"""``echo`` with ``logprobs``: prompts scored in chunks (issue #43, "echo+logprobs unchunked").

The scheduler scores a prompt in chunks of ``score_chunk`` positions (starting at multiples of it), keeping every
position's logits one chunk at a time and turning them into the positions' ``TokenLogprob`` before the next chunk
runs: no forward's logits hold more than a chunk's positions, whatever the prompt's length. On the bundled model
loaded exact (``backend="dequantized"``: float32 everywhere, so the chunking is all that differs) with 16-position
chunks (scoring and prefill) and a 100-token prompt: every forward's logits are at most 16 x the vocabulary, the
scores are one forward's over the whole prompt (within :data:`EXACT`), the generation that follows starts from the
scoring's own cache (the prompt's first position is fed once) and samples what a cold server samples, bit for bit;
a prompt kept in the prefix cache is still scored at every position; scoring chunks alternate with a running
stream's decode steps; the same holds on transformers' class (its ``DynamicCache``). On the bundled model as served
(cpu-fast kernels, the default chunks: scoring 512, prefill 256), a 600-token prompt's scores are the one forward's
within the serve tests' logprob tolerance (measured: equal) and its answer is the one it gets without ``echo``.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.model, pytest.mark.slow]

#: the bound on |chunked - one forward| of a log-probability, float32 weights and activations (measured: 1.1e-6)
EXACT = 1e-5
#: the bound the serve tests hold served log-probabilities to (``test_serve.py``'s ``_close``)
LOGPROB_TOL = 2e-3
CHUNK = 16
TOP = 3
TEXT = " ".join(f"Rule {i}: answer politely and cite section {i} of the handbook." for i in range(40))


@pytest.fixture(scope="module")
def exact() -> Iterator[Any]:
    import anyquant

    with anyquant.load(anyquant.default_model(), backend="dequantized") as model:
        yield model


def _prompt(model: Any, n: int = 100) -> list[int]:
    from anyquant_serve.scheduler import ModelAdapter

    ids = ModelAdapter(model).encode(TEXT, chat=False)
    assert len(ids) >= n
    return ids[:n]


def _scheduler(model: Any, **kw: Any) -> Any:
    from anyquant_serve.scheduler import ModelAdapter, Scheduler

    kw.setdefault("prefill_chunk", CHUNK)
    kw.setdefault("score_chunk", CHUNK)
    return Scheduler(ModelAdapter(model), max_batch=4, max_queue=8, **kw)


class _Answer:
    """What one request received: its prompt's scores, its text, its tokens' log-probabilities, its end."""

    def __init__(self) -> None:
        self.prompt: list[Any] | None = None
        self.text: list[str] = []
        self.logprobs: list[Any] = []
        self.ended: Any = None
        self.done = threading.Event()

    def finish(self, f: Any) -> None:
        self.ended = f
        self.done.set()


def _request(model: Any, ids: list[int], max_tokens: int, echo: bool, answer: _Answer) -> Any:
    from anyquant_serve.scheduler import Request

    params = model.params(logprobs=True, top_logprobs=TOP)
    work = Request(list(ids), params, max_tokens, answer.text.append, answer.finish, time.monotonic() + 600)
    work.logprob = answer.logprobs.append
    if echo:
        work.prompt_logprobs, work.prompt_top = (lambda items: setattr(answer, "prompt", items)), TOP
    return work


def _serve(scheduler: Any, model: Any, ids: list[int], max_tokens: int, echo: bool = True) -> _Answer:
    answer = _Answer()
    scheduler.submit(_request(model, ids, max_tokens, echo, answer))
    assert answer.done.wait(600)
    assert answer.ended.reason in ("stop", "length"), answer.ended
    return answer


def _one_forward(model: Any, ids: list[int]) -> list[Any]:
    """The unchunked reference: one forward over the whole prompt, every position's logits at once (what the
    server ran before, up to 4,096 tokens)."""
    from anyquant_serve.scheduler import ModelAdapter

    adapter = ModelAdapter(model)
    with torch.inference_mode():
        logits = model.module(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return [None] + [adapter.token_logprob(logits[i - 1 : i], ids[i], TOP) for i in range(1, len(ids))]


def _close(got: list[Any], want: list[Any], tol: float = EXACT) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.token_id == w.token_id and abs(g.logprob - w.logprob) <= tol, (g, w)
        assert [t for t, _, _ in g.top] == [t for t, _, _ in w.top], (g.top, w.top)
        assert max(abs(a - b) for (_, _, a), (_, _, b) in zip(g.top, w.top, strict=True)) <= tol


def _same_run(got: _Answer, want: _Answer) -> None:
    """The same tokens sampled from the same log-probabilities, bit for bit."""
    assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in want.logprobs]
    assert [(lp.logprob, lp.top) for lp in got.logprobs] == [(lp.logprob, lp.top) for lp in want.logprobs]
    assert "".join(got.text) == "".join(want.text) and got.ended == want.ended


class _Forwards:
    """Every forward of a module: (first position, positions fed, logits' shape)."""

    def __init__(self, module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int, tuple[int, ...]]] = []
        forward = module.forward

        @functools.wraps(forward)  # the signature kept: the batch asks it whether it takes logits_to_keep
        def recorded(*args: Any, **kw: Any) -> Any:
            out = forward(*args, **kw)
            ids, positions = kw["input_ids"], kw.get("position_ids")
            first = int(positions[0, 0]) if positions is not None else -1
            self.calls.append((first, int(ids.shape[1]), tuple(out.logits.shape)))
            return out

        monkeypatch.setattr(module, "forward", recorded)


def test_scores_come_in_bounded_chunks_equal_to_one_forward(exact: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = _prompt(exact)
    want = _one_forward(exact, ids)
    cold = _scheduler(exact, prefix_cache_mb=0)
    try:
        plain = _serve(cold, exact, ids, 6, echo=False)
    finally:
        cold.close(30)
    forwards = _Forwards(exact.module, monkeypatch)
    scheduler = _scheduler(exact)
    try:
        scored = _serve(scheduler, exact, ids, 6)
        only = _serve(scheduler, exact, ids, 0)  # max_tokens 0: the scored prompt alone
    finally:
        scheduler.close(30)
    width = exact.module.lm_head.out_features
    assert max(math.prod(shape) for _, _, shape in forwards.calls) <= CHUNK * width
    chunks = [(first, fed) for first, fed, shape in forwards.calls if shape[1] == fed > 1]
    n = len(ids)
    starts = list(range(0, n, CHUNK))
    assert chunks == [(s, min(CHUNK, n - s)) for s in starts] * 2  # every position's logits, chunk by chunk, twice
    # the generation after the first scoring started from the scoring's cache: only the last chunk prefilled again
    prefills = [(first, fed) for first, fed, shape in forwards.calls if fed > 1 and shape[1] == 1]
    assert prefills == [(starts[-1], n - starts[-1])]
    assert scored.prompt is not None and only.prompt is not None
    _close(scored.prompt, want)
    assert [(lp.token_id, lp.logprob, lp.top) for lp in only.prompt[1:]] == [
        (lp.token_id, lp.logprob, lp.top) for lp in scored.prompt[1:]
    ]
    assert only.ended.completion_tokens == 0 and only.text == []
    _same_run(scored, plain)


def test_a_kept_prefix_is_scored_again(exact: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt the prefix cache keeps (whole, or its first chunks) holds no logits but the last position's: its
    scoring feeds every position again, and gives a cold server's scores and answer."""
    ids = _prompt(exact)
    longer = [*ids, *_prompt(exact, 120)[100:]]
    cold = _scheduler(exact, prefix_cache_mb=0)
    try:
        want = [_serve(cold, exact, p, 4) for p in (ids, longer)]
    finally:
        cold.close(30)
    warm = _scheduler(exact)
    try:
        _serve(warm, exact, ids, 4, echo=False)  # kept
        hits = warm.prefix_cache_hits
        forwards = _Forwards(exact.module, monkeypatch)
        got = [_serve(warm, exact, p, 4) for p in (ids, longer)]
        assert warm.prefix_cache_hits - hits == len(ids)  # the whole prompt kept: its generation took it
    finally:
        warm.close(30)
    starts = [first for first, fed, shape in forwards.calls if shape[1] == fed > 1]
    assert starts.count(0) == 2  # each scoring fed the prompt from its first position
    for g, w in zip(got, want, strict=True):
        assert g.prompt is not None and w.prompt is not None and len(g.prompt) == len(w.prompt)
        assert [(lp.logprob, lp.top) for lp in g.prompt[1:]] == [(lp.logprob, lp.top) for lp in w.prompt[1:]]
        _same_run(g, w)


def test_scoring_chunks_alternate_with_decode_steps(exact: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A running stream takes a decode step between every two scoring chunks of a prompt admitted meanwhile."""
    from anyquant_serve.batch import DecodeBatch

    events: list[tuple[str, int]] = []
    score, step = DecodeBatch.score, DecodeBatch.step

    def recorded_score(self: Any, ids: Any, done: int, cache: Any, chunk: int) -> Any:
        out = score(self, ids, done, cache, chunk)
        events.append(("score", out[0] - done))
        return out

    def recorded_step(self: Any, tokens: Any) -> Any:
        events.append(("step", len(self.slots)))
        return step(self, tokens)

    monkeypatch.setattr(DecodeBatch, "score", recorded_score)
    monkeypatch.setattr(DecodeBatch, "step", recorded_step)
    ids = _prompt(exact)
    scheduler = _scheduler(exact, prefix_cache_mb=0)
    stream, scored = _Answer(), _Answer()
    started = threading.Event()
    try:
        work = _request(exact, _prompt(exact, 20), 40, False, stream)
        work.emit = lambda text: (stream.text.append(text), started.set())  # type: ignore[func-returns-value]
        scheduler.submit(work)
        assert started.wait(120)
        scheduler.submit(_request(exact, ids, 0, True, scored))
        assert scored.done.wait(600) and stream.done.wait(600)
    finally:
        scheduler.close(30)
    chunks = [i for i, e in enumerate(events) if e[0] == "score"]
    assert [events[i][1] for i in chunks] == [min(CHUNK, len(ids) - s) for s in range(0, len(ids), CHUNK)]
    for a, b in itertools.pairwise(chunks):
        assert any(e[0] == "step" for e in events[a + 1 : b]), events[a : b + 1]
    assert stream.ended.reason == "length" and scored.prompt is not None and len(scored.prompt) == len(ids)


def test_transformers_class_scores_and_reuses_its_dynamic_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """On transformers' class the scoring's ``DynamicCache`` is cut to the last chunk's start for the generation:
    scores within :data:`EXACT` of one forward, the answer a cold server's, the prompt's first position fed once."""
    import anyquant

    with anyquant.load(anyquant.default_model(), backend="dequantized", runtime="transformers") as model:
        ids = _prompt(model, 40)
        want = _one_forward(model, ids)
        cold = _scheduler(model, prefix_cache_mb=0)
        try:
            plain = _serve(cold, model, ids, 4, echo=False)
        finally:
            cold.close(30)
        forwards = _Forwards(model.module, monkeypatch)
        scheduler = _scheduler(model)
        try:
            got = _serve(scheduler, model, ids, 4)
        finally:
            scheduler.close(30)
    assert got.prompt is not None
    _close(got.prompt, want)
    _same_run(got, plain)
    assert [first for first, fed, _ in forwards.calls if fed > 1] == [0, 16, 32, 32]  # scored, then the last chunk
    assert max(shape[1] for _, _, shape in forwards.calls) <= CHUNK


def test_default_chunks_on_the_served_kernels_give_the_one_forward_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled model as served (cpu-fast), the default chunks (scoring: generate's 512; prefill: 256): a
    600-token prompt is scored in two forwards of at most 512 positions whose scores are the whole prompt's one
    forward's (what the server computed before; chunks of 256 moved them by 0.014 here), and the answer that
    follows is the one the prompt gets without ``echo`` (its own prefill: the scoring's forwards are not the
    prefill's, so their cache is not reused)."""
    import anyquant
    from anyquant_runtime.generate import PREFILL_CHUNK
    from anyquant_serve.scheduler import DEFAULT_PREFILL_CHUNK, DEFAULT_SCORE_CHUNK

    assert DEFAULT_SCORE_CHUNK == PREFILL_CHUNK != DEFAULT_PREFILL_CHUNK
    with anyquant.load(anyquant.default_model()) as model:
        ids = _prompt(model, 600)
        want = _one_forward(model, ids)
        cold = _scheduler(model, prefill_chunk=DEFAULT_PREFILL_CHUNK, score_chunk=DEFAULT_SCORE_CHUNK)
        try:
            plain = _serve(cold, model, ids, 4, echo=False)
        finally:
            cold.close(30)
        forwards = _Forwards(model.module, monkeypatch)
        scheduler = _scheduler(model, prefill_chunk=DEFAULT_PREFILL_CHUNK, score_chunk=DEFAULT_SCORE_CHUNK)
        try:
            got = _serve(scheduler, model, ids, 4)
        finally:
            scheduler.close(30)
    assert got.prompt is not None
    _close(got.prompt, want, LOGPROB_TOL)
    _same_run(got, plain)
    scoring = [(first, fed) for first, fed, shape in forwards.calls if shape[1] == fed > 1]
    assert scoring == [(0, 512), (512, 88)]
    assert max(shape[1] for _, _, shape in forwards.calls) <= DEFAULT_SCORE_CHUNK
