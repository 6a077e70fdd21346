"""``anyquant serve``'s prefix cache and chunked prefill (issue #43, sections 3 and 4).

The bookkeeping (what a prompt reuses, the budget, least-recently-used eviction, 0 = off) on small caches; then on
the bundled model, against the cold path's own numbers: a warm request (its prompt's first chunks from the cache)
samples from the logits a cold server computes for it (greedy tokens equal over 32 steps, the logits within 1e-5
of their largest, a fitted gain of 1), and so does a request whose whole prompt was kept; a served prompt longer
than a chunk gives ``generate``'s logits, warm or cold; a growing chat and concurrent clients sharing a system
prompt hit the cache (counted in ``/metrics`` as vLLM counts it); a tiny budget evicts and stays correct; and a
long prompt is prefilled chunk by chunk while a running stream keeps taking decode steps, never more than one
chunk of prompt tokens between two of them.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import urllib.request
from typing import Any

import pytest
import torch

from anyquant_runtime.native import NativeCache
from anyquant_serve.prefix import PrefixCache

#: a system prompt of about 600 tokens: with a question, a prompt's last chunk of 128 (or of generate's 512) holds
#: over 64 positions (a prompt's row count chooses the bundled model's kernels: a cache reused at any other
#: length than a chunk's start would leave fewer rows to that forward, and change the numbers)
SYSTEM = " ".join(f"Rule {i}: answer politely and cite section {i}." for i in range(44))
QUESTIONS = ["What is rule 7?", "Summarize rule 3.", "Which rule mentions section 12?", "What is rule 30?"]
#: the bound on |warm - cold| / max |cold| (the design gives 0: the same forwards over the same cache contents)
EXACT = 1e-5


def _filled(layers: int, length: int, seed: int = 0) -> NativeCache:
    """A cache of ``length`` random positions (1 batch row, 2 heads of 4)."""
    g = torch.Generator().manual_seed(seed)
    cache = NativeCache(layers)
    for i in range(layers):
        k, v = torch.randn(1, 2, length, 4, generator=g), torch.randn(1, 2, length, 4, generator=g)
        cache.update(i, k, v)
    return cache


# ---------------------------------------------------------------------- bookkeeping (no model)


def test_native_cache_copy_crop_and_bytes() -> None:
    cache = _filled(2, 10)
    copy = cache.copy(6)
    assert copy.lengths == [6, 6] and copy.dtype is cache.dtype
    for held, kept in ((copy.keys, cache.keys), (copy.values, cache.values)):
        for a, b in zip(held, kept, strict=True):
            assert a is not None and b is not None and torch.equal(a, b[:, :, :6])
    assert copy.nbytes() == 2 * 2 * (1 * 2 * 6 * 4 * 4)  # exactly the positions held
    copy.update(0, torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))  # grows, the original untouched
    assert copy.lengths[0] == 7 and not bool((cache.keys[0][:, :, 6] == 1).all())  # type: ignore[index]
    cache.crop(4)
    assert cache.lengths == [4, 4]
    keys, _ = cache.update(1, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert keys.shape[2] == 5 and bool((keys[:, :, 4] == 0).all())  # written at position 4
    assert cache.copy().lengths == [4, 5]
    with pytest.raises(ValueError):
        cache.crop(-1)


def test_prefix_cache_reuses_whole_chunks_short_of_the_last_token() -> None:
    cache = PrefixCache(budget=1 << 30, chunk=4)
    kept = list(range(100, 111))  # 11 tokens
    logits = torch.arange(5.0)
    assert cache.store(kept, _filled(2, 11), logits)
    assert cache.lookup(list(range(100, 103))) is None  # shorter than a chunk: a miss
    hit = cache.lookup([*kept[:9], 7, 7])  # 9 tokens in common: 2 whole chunks
    assert hit is not None and hit.length == 8 and hit.logits is None and hit.cache.lengths == [8, 8]
    hit = cache.lookup(kept[:8])  # 8 in common but the last token is always fed: 1 chunk
    assert hit is not None and hit.length == 4
    hit = cache.lookup(kept)  # the same prompt: all of it, its logits too (a copy)
    assert hit is not None and hit.length == 11 and torch.equal(hit.logits, logits)
    hit.logits.zero_()
    assert torch.equal(cache.entries[tuple(kept)].logits, logits)
    assert cache.lookup([1, *kept[1:]]) is None  # differs in the first chunk
    assert (cache.queries, cache.hits) == (3 + 11 + 8 + 11 + 11, 8 + 4 + 11)
    whole_only = PrefixCache(budget=1 << 30, chunk=0)  # no chunks: equal prompts only
    whole_only.store(kept, _filled(2, 11), logits)
    assert whole_only.lookup([*kept, 5]) is None and whole_only.lookup(kept) is not None


def test_prefix_cache_budget_lru_and_off() -> None:
    one = _filled(2, 8).copy().nbytes() + 5 * 4  # an 8-token entry: its keys, values and logits
    cache = PrefixCache(budget=2 * one, chunk=4)
    prompts = [[i] * 8 for i in range(1, 4)]
    for p in prompts[:2]:
        assert cache.store(p, _filled(2, 8), torch.zeros(5))
    assert cache.bytes == 2 * one and cache.evictions == 0
    assert cache.lookup(prompts[0]) is not None  # prompt 0 used: prompt 1 is now the least recent
    assert cache.store(prompts[2], _filled(2, 8), torch.zeros(5))
    assert set(cache.entries) == {tuple(prompts[0]), tuple(prompts[2])} and cache.evictions == 1
    assert cache.bytes == 2 * one
    # a prompt extending a kept one replaces it (the next chat turn serves all the previous one did)
    assert cache.store([*prompts[0], 9, 9], _filled(2, 10), torch.zeros(5))
    assert tuple(prompts[0]) not in cache.entries and cache.bytes <= 2 * one
    assert not cache.store([1] * 50, _filled(2, 50), torch.zeros(5))  # larger than the budget: not kept
    off = PrefixCache(budget=0, chunk=4)
    assert not off.store(prompts[0], _filled(2, 8), torch.zeros(5))
    assert off.lookup(prompts[0]) is None and (off.queries, off.hits, len(off)) == (0, 0, 0)


def test_defaults_and_flags() -> None:
    from anyquant.errors import ParameterError
    from anyquant_runtime.generate import PREFILL_CHUNK
    from anyquant_serve.plugin import _run, build_parser_for_tests
    from anyquant_serve.scheduler import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB, DEFAULT_SCORE_CHUNK

    assert DEFAULT_PREFILL_CHUNK * 2 == PREFILL_CHUNK  # half generate's: finer reuse, shorter pauses
    parser = build_parser_for_tests()
    args = parser.parse_args([])
    assert (args.prefill_chunk, args.prefix_cache_mb) == (DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB) != (0, 0)
    args = parser.parse_args(["--prefix-cache-mb", "0", "--prefill-chunk", "0"])
    assert (args.prefill_chunk, args.prefix_cache_mb) == (0, 0)
    for bad in (
        ["--prefill-chunk", "-1"],
        ["--prefix-cache-mb", "-5"],
        ["--prefix-cache-mb", "nan"],
        ["--prefix-cache-mb", "inf"],
    ):
        with pytest.raises(ParameterError, match="--prefill-chunk and --prefix-cache-mb"):
            _run(parser.parse_args(bad))
    assert parser.parse_args([]).score_chunk == DEFAULT_SCORE_CHUNK == PREFILL_CHUNK  # generate's: bitwise scores
    assert parser.parse_args(["--score-chunk", "128"]).score_chunk == 128
    for bad in (["--score-chunk", "0"], ["--score-chunk", "-3"]):
        with pytest.raises(ParameterError, match="--score-chunk"):
            _run(parser.parse_args(bad))


def test_score_chunk_reaches_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--score-chunk`` is what the scheduler scores with (not only parsed)."""
    import anyquant
    from anyquant_serve import scheduler as scheduler_module
    from anyquant_serve.plugin import _run, build_parser_for_tests

    class Built(Exception):
        pass

    def capture(adapter: object, **kwargs: object) -> None:
        raise Built(kwargs)

    pytest.importorskip("uvicorn")
    monkeypatch.setattr(anyquant, "load", lambda *a, **k: object())
    monkeypatch.setattr(scheduler_module, "ModelAdapter", lambda model: model)
    monkeypatch.setattr(scheduler_module, "Scheduler", capture)
    with pytest.raises(Built) as built:
        _run(build_parser_for_tests().parse_args(["--score-chunk", "96"]))
    assert built.value.args[0]["score_chunk"] == 96


def test_metrics_expose_the_prefix_cache_counters() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from anyquant_serve.metrics import Metrics

    class Engine:
        running = waiting = 0
        prefix_cache_queries, prefix_cache_hits = 1500, 1024

    def samples(engine: Any) -> dict[str, float]:
        text = Metrics(engine, "m").render()[0].decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    got = samples(Engine())
    assert got["anyquant:prefix_cache_queries_total"] == 1500 and got["anyquant:prefix_cache_hits_total"] == 1024
    got = samples(object())  # an engine without a prefix cache: 0
    assert got["anyquant:prefix_cache_queries_total"] == 0 and got["anyquant:prefix_cache_hits_total"] == 0


# ---------------------------------------------------------------------- the bundled model, in process


@pytest.fixture(scope="module")
def local() -> Any:
    import anyquant

    with anyquant.load(anyquant.default_model()) as model:
        yield model


def _scheduler(local: Any, **kw: Any) -> Any:
    from anyquant_serve.scheduler import ModelAdapter, Scheduler

    return Scheduler(ModelAdapter(local), max_batch=4, max_queue=8, **kw)


def _ids(local: Any, question: str, system: str = SYSTEM) -> list[int]:
    from anyquant_serve.scheduler import ModelAdapter

    return ModelAdapter(local).encode(
        [{"role": "system", "content": system}, {"role": "user", "content": question}], True
    )


def _serve(scheduler: Any, local: Any, prompts: list[list[int]], max_tokens: int = 32) -> list[tuple[list[int], Any]]:
    """Each prompt served greedily, one after another: (its tokens, the logits each was sampled from
    ``[steps, vocab]``), recorded where the scheduler samples."""
    from anyquant_serve.scheduler import Request

    seen: dict[int, tuple[list[int], list[Any]]] = {}
    served: list[Any] = []  # every request kept alive: a freed one's id could come back as a later one's
    sample = scheduler._sample

    def recorded(row: Any, logits: Any) -> Any:
        token, logprob = sample(row, logits)
        tokens, rows = seen.setdefault(id(row.request), ([], []))
        tokens.append(token)
        rows.append(logits.detach().float().clone())
        return token, logprob

    scheduler._sample = recorded
    out = []
    for ids in prompts:
        done = threading.Event()
        ends: list[Any] = []

        def finish(f: Any, ends: list[Any] = ends, done: threading.Event = done) -> None:
            ends.append(f)
            done.set()

        request = Request(ids, local.params(), max_tokens, lambda text: None, finish)
        served.append(request)
        scheduler.submit(request)
        assert done.wait(600)
        assert ends[0].reason in ("stop", "length"), ends[0]
        tokens, rows = seen[id(request)]
        out.append((tokens, torch.cat(rows)))
    return out


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _same(warm: tuple[list[int], Any], cold: tuple[list[int], Any]) -> None:
    """Greedy tokens equal; logits within :data:`EXACT` of the largest, and a least-squares gain warm = g * cold
    of 1 (a scale error would show there before the tokens moved)."""
    (wt, w), (ct, c) = warm, cold
    assert wt == ct
    assert w.shape == c.shape
    err = float((w - c).abs().max() / c.abs().max())
    gain = float((w * c).sum() / (c * c).sum())
    assert err <= EXACT, err
    assert abs(gain - 1) <= EXACT, gain


@pytest.mark.model
@pytest.mark.slow
def test_warm_requests_sample_the_cold_logits(local: Any) -> None:
    """Chunks of 128: a question after another with the same system prompt reuses its first 4 chunks; the same
    prompt again reuses all of it (no forward); each gives the cold server's tokens and logits."""
    prompts = [_ids(local, q) for q in QUESTIONS[:3]]
    assert all(len(p) > 512 for p in prompts)
    cold = _scheduler(local, prefill_chunk=128, prefix_cache_mb=0)
    try:
        want = _serve(cold, local, prompts)
        assert cold.prefix_cache_queries == cold.prefix_cache_hits == 0
    finally:
        cold.close(30)
    warm = _scheduler(local, prefill_chunk=128)
    try:
        got = _serve(warm, local, [*prompts, prompts[0]])
        reused = [max(_common(p, q) for q in prompts[:i]) // 128 * 128 for i, p in enumerate(prompts) if i]
        assert min(reused) >= 512
        assert warm.prefix_cache_queries == sum(map(len, prompts)) + len(prompts[0])
        assert warm.prefix_cache_hits == sum(reused) + len(prompts[0])
    finally:
        warm.close(30)
    for g, w in zip(got, [*want, want[0]], strict=True):
        _same(g, w)


@pytest.mark.model
@pytest.mark.slow
def test_long_prompts_give_generates_logits_warm_or_cold(local: Any) -> None:
    """With generate's chunk (``--prefill-chunk 512``), a prompt over 512 tokens, cold or from the cache, samples from
    the very logits ``generate`` computes for it (its ``observe``)."""
    prompts = [_ids(local, q) for q in QUESTIONS[2:4]]
    gen = local.generator
    want = []
    for ids in prompts:
        rows: list[Any] = []
        tokens = [t for (t,) in gen._token_steps([ids], local.params(max_new_tokens=16), observe=rows.append)]
        want.append((tokens, torch.cat([r.float() for r in rows])))
    from anyquant_runtime.generate import PREFILL_CHUNK

    scheduler = _scheduler(local, prefill_chunk=PREFILL_CHUNK)
    try:
        got = _serve(scheduler, local, prompts, 16)
        assert scheduler.prefix_cache_hits == 512  # the second reused the first's first chunk
    finally:
        scheduler.close(30)
    for g, (tokens, logits) in zip(got, want, strict=True):
        n = len(g[0])
        _same(g, (tokens[:n], logits[:n]))  # generate stops at the end of sequence too


@pytest.mark.model
@pytest.mark.slow
def test_a_growing_chat_reuses_the_previous_turn(local: Any) -> None:
    """Turn 2's prompt (turn 1's messages, its answer, a new question) starts with turn 1's prompt: its whole
    chunks come from the cache, and turn 2 samples what a cold server samples."""
    from anyquant_serve.scheduler import ModelAdapter

    adapter = ModelAdapter(local)
    system = " ".join(f"Fact {i}: the {i}th planet of a made-up star is called P{i}." for i in range(10))
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Name the 3rd planet."}]
    ids1 = adapter.encode(turn1, True)
    warm = _scheduler(local, prefill_chunk=128)
    cold = _scheduler(local, prefill_chunk=128, prefix_cache_mb=0)
    try:
        first = _serve(warm, local, [ids1], 12)[0]
        answer = adapter.decode(first[0][:-1] if first[0][-1] in adapter.eos_ids else first[0])
        turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the 5th?"}]
        ids2 = adapter.encode(turn2, True)
        assert ids2[: len(ids1)] == ids1
        hits = warm.prefix_cache_hits
        got = _serve(warm, local, [ids2], 24)[0]
        assert warm.prefix_cache_hits - hits == len(ids1) // 128 * 128 >= 128
        want = _serve(cold, local, [ids2], 24)[0]
    finally:
        warm.close(30)
        cold.close(30)
    _same(got, want)


@pytest.mark.model
@pytest.mark.slow
def test_a_tiny_budget_evicts_and_stays_exact(local: Any) -> None:
    """A budget for one prompt of about 150 tokens: each new prompt evicts the last one; a prompt evicted is
    prefilled again, one still kept is reused whole; every answer is the cold one."""
    systems = [" ".join(f"Note {j}.{i}: item {i} costs {i * j} coins." for i in range(12)) for j in (1, 2, 3)]
    prompts = [_ids(local, "What does item 4 cost?", s) for s in systems]
    per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers x (keys, values) x kv heads x head dim x float32
    budget_mb = (max(map(len, prompts)) * per_token + 49152 * 4) * 1.5 / 2**20
    assert min(map(len, prompts)) * per_token * 2 > budget_mb * 2**20  # two never fit
    cold = _scheduler(local, prefix_cache_mb=0)
    tiny = _scheduler(local, prefix_cache_mb=budget_mb)
    try:
        want = _serve(cold, local, prompts, 8)
        got = _serve(tiny, local, [*prompts, prompts[0], prompts[0]], 8)
        assert len(tiny.prefix) == 1 and tiny.prefix.bytes <= budget_mb * 2**20
        assert tiny.prefix.evictions == 3  # prompts 0, 1, 2 and 0 again each pushed the previous one out
        assert tiny.prefix_cache_hits == len(prompts[0])  # only the last request: prompt 0 right after itself
    finally:
        cold.close(30)
        tiny.close(30)
    for g, w in zip(got, [*want, want[0], want[0]], strict=True):
        _same(g, w)


@pytest.mark.model
@pytest.mark.slow
def test_a_long_prefill_lets_running_streams_decode(local: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 64: while a 616-token prompt is prefilled (10 chunks, one per round), a running stream takes a
    decode step and receives text after every chunk, and no step waits for more than one chunk of prompt tokens.
    The stream's answer is the one it gets alone."""
    from anyquant_serve.batch import DecodeBatch
    from anyquant_serve.scheduler import ModelAdapter, Request

    events: list[tuple[Any, ...]] = []
    prefill, step = DecodeBatch.prefill, DecodeBatch.step

    def recorded_prefill(self: Any, key: Any, ids: Any, chunks: Any = None, reuse: Any = None) -> Any:
        before = reuse[0] if reuse is not None else self.prefilled(key)
        out = prefill(self, key, ids, chunks, reuse)
        events.append(("prefill", key, (len(ids) if out is not None else self.prefilled(key)) - before))
        return out

    def recorded_step(self: Any, tokens: Any) -> Any:
        events.append(("step", [s.key for s in self.slots]))
        return step(self, tokens)

    monkeypatch.setattr(DecodeBatch, "prefill", recorded_prefill)
    monkeypatch.setattr(DecodeBatch, "step", recorded_step)
    adapter = ModelAdapter(local)
    stream_messages = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]
    long_ids = _ids(local, QUESTIONS[0])
    scheduler = _scheduler(local, prefill_chunk=64, prefix_cache_mb=0)
    texts: list[str] = []
    started, both = threading.Event(), threading.Event()
    ended: list[Any] = []

    def finish(f: Any) -> None:  # on the scheduler's thread: never blocks
        ended.append(f)
        if len(ended) == 2:
            both.set()

    def emit(text: str) -> None:
        texts.append(text)
        events.append(("text", "stream"))
        started.set()

    deadline = time.monotonic() + 600
    stream = Request(adapter.encode(stream_messages, True), local.params(), 60, emit, finish, deadline)
    long = Request(long_ids, local.params(), 2, lambda text: None, finish, deadline)
    try:
        scheduler.submit(stream)
        assert started.wait(120)
        scheduler.submit(long)
        assert both.wait(600)
    finally:
        scheduler.close(30)
    assert [f.reason for f in ended] == ["length", "length"]  # the stream outlived the long prompt's prefill
    chunks = [i for i, e in enumerate(events) if e[0] == "prefill" and e[1] is long]
    assert len(chunks) == math.ceil(len(long_ids) / 64) >= 8
    assert [events[i][2] for i in chunks] == [64] * (len(chunks) - 1) + [len(long_ids) - 64 * (len(chunks) - 1)]
    for a, b in itertools.pairwise(chunks):
        between = events[a + 1 : b]
        assert any(e[0] == "step" and any(k is stream for k in e[1]) for e in between), between
        assert ("text", "stream") in between
    fed = 0
    for e in events:
        fed = fed + e[2] if e[0] == "prefill" else 0 if e[0] == "step" else fed
        assert fed <= 64
    assert "".join(texts) == local.generate(stream_messages, max_new_tokens=60)


@pytest.mark.model
@pytest.mark.slow
def test_a_transformers_model_reuses_its_dynamic_cache() -> None:
    """The bundled model on transformers' class (a ``DynamicCache``): the cache copied and cropped through
    transformers' own API, and the warm prompt's logits are the cold one's."""
    import anyquant
    from anyquant_serve.batch import DecodeBatch
    from anyquant_serve.prefix import cacheable

    with anyquant.load(anyquant.default_model(), runtime="transformers") as model:
        gen: Any = model.generator
        system = " ".join(f"Rule {i}: answer politely and cite section {i}." for i in range(20))
        kept, asked = (
            gen.encode([{"role": "system", "content": system}, {"role": "user", "content": q}], model.params())
            for q in QUESTIONS[:2]
        )

        def greedy(batch: DecodeBatch, ids: list[int], reuse: Any = None) -> tuple[list[int], Any]:
            rows = [batch.prefill("asked", ids, None, reuse).float()]  # type: ignore[union-attr]
            tokens = []
            for _ in range(8):
                tokens.append(int(rows[-1].argmax()))
                rows.append(batch.step([tokens[-1]])[0].float())
            return tokens, torch.stack(rows)

        want = greedy(DecodeBatch(model.module, gen.cache_kw, gen.device, 128), asked)
        warm = DecodeBatch(model.module, gen.cache_kw, gen.device, 128)
        cache = PrefixCache(1 << 30, 128)
        logits = warm.prefill("kept", kept)
        assert type(warm.cache_of("kept")).__name__ == "DynamicCache" and cacheable(warm.cache_of("kept"))
        assert cache.store(kept, warm.cache_of("kept"), logits)
        warm.remove(["kept"])
        hit = cache.lookup(asked)
        assert hit is not None and hit.length == 256 and hit.cache.get_seq_length() == 256
        got = greedy(warm, asked, (hit.length, hit.cache))
    _same(got, want)


# ---------------------------------------------------------------------- a live server


@pytest.mark.model
@pytest.mark.slow
def test_concurrent_clients_sharing_a_system_prompt(local: Any) -> None:
    """A real server with its defaults: after one request, four clients at once with the same 600-token system
    prompt and different questions each reuse its first chunk, answer as ``generate`` does, and ``/metrics``
    counts the tokens looked up and found."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("prometheus_client")
    from concurrent.futures import ThreadPoolExecutor

    from prometheus_client.parser import text_string_to_metric_families

    from plugins.serve.tests.servers import serving

    def messages(q: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]

    with serving("--model-name", "smol", "--max-batch", "8") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)

        def ask(q: str) -> Any:
            return client.chat.completions.create(model="smol", messages=messages(q), max_tokens=12, temperature=0)

        first = ask("Hello.")
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, QUESTIONS))
        with urllib.request.urlopen(base + "/metrics") as r:
            text = r.read().decode()
    for q, answer in zip(QUESTIONS, answers, strict=True):
        assert answer.choices[0].message.content == local.generate(messages(q), max_new_tokens=12)
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    prompt_tokens = first.usage.prompt_tokens + sum(a.usage.prompt_tokens for a in answers)
    assert samples["anyquant:prefix_cache_queries_total"] == prompt_tokens
    assert samples["anyquant:prefix_cache_hits_total"] == 4 * 512
