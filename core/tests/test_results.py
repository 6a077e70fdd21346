"""Generation results (``complete``/``complete_stream``), token-id prompts, scoring (``loglikelihood``,
``loglikelihood_rolling``), the async methods and the sampling parameters: judged by transformers' forward on a
tiny random Llama, by the loaded module's own forward on the bundled model, by ``anyquant.perplexity``, and by
hand-computed effects."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant
from anyquant.params import GenerationParams
from anyquant.results import GenerationResult, collect
from anyquant.testing.tiny import make_tiny_dense
from anyquant_runtime.generate import sample_next

PROMPT = "The capital of France is"
# llama.cpp 0.3.36 (llama-cpp-python, 2 threads) gives log p(" Paris" | PROMPT) = -0.2644 on the bundled Q4_1 model;
# anyquant gives -0.2576 through its compiled GGUF kernel and -0.2779 through the torch path (ANYQUANT_KERNELS=0).
LLAMA_CPP_PARIS = -0.2644


@pytest.fixture(scope="module")
def bundled() -> Any:
    return anyquant.load(anyquant.default_model())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dense(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def small(tiny: Path) -> Any:
    return anyquant.load(tiny)


@pytest.fixture(scope="module")
def reference(tiny: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def _logprobs_of(module: Any, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) from one forward of ``module`` (the loaded model's or transformers')."""
    with torch.inference_mode():
        logits = module(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


# ------------------------------------------------------------------------------------------------ results


def test_complete_is_generate_with_its_details(bundled: Any) -> None:
    result = bundled.complete(PROMPT, max_new_tokens=6)
    assert isinstance(result, GenerationResult)
    assert result.text == bundled.generate(PROMPT, max_new_tokens=6) == " Paris.\n\nThe answer"
    assert result.finish_reason == "length" and result.stop_string is None and result.capped is None
    prompt_ids = bundled.tokenizer(PROMPT)["input_ids"]
    assert result.usage.prompt_tokens == len(prompt_ids) and result.usage.completion_tokens == 6
    assert bundled.tokenizer.decode(list(result.token_ids)) == result.text
    t = result.timings
    assert t.prefill_seconds > 0 and t.decode_seconds > 0 and t.decode_tokens_per_second is not None
    assert t.prefill_tokens_per_second == pytest.approx(len(prompt_ids) / t.prefill_seconds)
    assert t.decode_tokens_per_second == pytest.approx(5 / t.decode_seconds)
    assert result.logprobs is None
    assert result.to_dict()["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


def test_a_stop_string_ends_with_its_name(bundled: Any) -> None:
    result = bundled.complete(PROMPT, max_new_tokens=20, stop=["\n", "."])
    assert (result.text, result.finish_reason, result.stop_string) == (" Paris", "stop", ".")
    assert result.token_ids == (7042, 30)  # " Paris", "." : the stop string's token is counted, its text left out
    assert result.usage.completion_tokens == 2


def test_end_of_sequence_is_stop_and_logit_bias_forces_it(bundled: Any) -> None:
    eos = bundled.tokenizer.eos_token_id
    result = bundled.complete(PROMPT, max_new_tokens=5, logit_bias={eos: 100})
    assert (result.text, result.token_ids, result.finish_reason, result.stop_string) == ("", (eos,), "stop", None)


def test_logprobs_are_transformers_own(small: Any, reference: Any) -> None:
    prompt = small.tokenizer("hello there")["input_ids"]
    result = small.complete(prompt, max_new_tokens=5, logprobs=True, top_logprobs=3)
    ids = prompt + list(result.token_ids)
    want = _logprobs_of(reference, ids)[-5:]
    with torch.inference_mode():
        top3 = torch.log_softmax(reference(torch.tensor([ids])).logits[0, -6:-1].float(), -1).topk(3)
    assert result.logprobs is not None and len(result.logprobs) == 5
    for i, (lp, token) in enumerate(zip(result.logprobs, result.token_ids, strict=True)):
        assert lp.token_id == token and lp.logprob == pytest.approx(float(want[i]), abs=1e-4)
        assert [t[0] for t in lp.top] == top3.indices[i].tolist()
        assert [t[2] for t in lp.top] == pytest.approx(top3.values[i].tolist(), abs=1e-4)
        assert lp.top[0][0] == token  # greedy: the chosen token is the best
        assert lp.text == small.tokenizer.decode([token])


def test_logprobs_on_the_bundled_model(bundled: Any) -> None:
    result = bundled.complete(PROMPT, max_new_tokens=4, logprobs=True, top_logprobs=2)
    ids = bundled.tokenizer(PROMPT)["input_ids"] + list(result.token_ids)
    want = _logprobs_of(bundled.module, ids)[-4:]  # one forward: the quantized kernels differ a little from decode's
    assert result.logprobs is not None
    assert [lp.logprob for lp in result.logprobs] == pytest.approx(want.tolist(), abs=0.03)
    assert result.logprobs[0].text == " Paris" and result.logprobs[0].logprob == pytest.approx(
        LLAMA_CPP_PARIS, abs=0.02
    )


def test_logit_bias_minus_100_takes_the_runner_up(bundled: Any) -> None:
    first = bundled.complete(PROMPT, max_new_tokens=1, logprobs=True, top_logprobs=2).logprobs[0]
    best, second = first.top[0][0], first.top[1][0]
    biased = bundled.complete(PROMPT, max_new_tokens=1, logit_bias={best: -100})
    assert biased.token_ids == (second,)


def test_stream_chunks_make_the_result(bundled: Any) -> None:
    chunks = list(bundled.complete_stream(PROMPT, max_new_tokens=6, stop="answer", logprobs=True))
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "stop" and last.stop_string == "answer" and last.usage is not None
    assert all(len(c.token_ids) == 1 and c.logprobs is not None and len(c.logprobs) == 1 for c in chunks[:-1])
    result = collect(chunks)
    assert result.text == " Paris.\n\nThe " and len(result.token_ids) == len(result.logprobs or ()) == 6


def test_token_id_prompts(bundled: Any) -> None:
    ids = bundled.tokenizer(PROMPT)["input_ids"]
    assert bundled.complete(ids, max_new_tokens=4).token_ids == bundled.complete(PROMPT, max_new_tokens=4).token_ids
    assert bundled.generate(tuple(ids), max_new_tokens=4) == bundled.generate(PROMPT, max_new_tokens=4)
    with pytest.raises(anyquant.ParameterError, match="token id 49152, outside this model's vocabulary"):
        bundled.generate([1, 49152], max_new_tokens=2)
    with pytest.raises(anyquant.ParameterError, match="not a mix"):
        bundled.generate([1, {"role": "user", "content": "x"}], max_new_tokens=2)
    with pytest.raises(anyquant.ParameterError, match="chat=True needs a string"):
        bundled.generate(ids, max_new_tokens=2, chat=True)


def test_the_context_cap_is_said_at_the_start(tmp_path: Path) -> None:
    short = anyquant.load(make_tiny_dense(tmp_path / "short", max_position_embeddings=32))
    ids = list(range(100, 120))  # 20 tokens: 13 new ones fit
    chunks = list(short.complete_stream(ids, max_new_tokens=50, logit_bias={short.tokenizer.eos_token_id: -100}))
    cap = chunks[0].capped
    assert cap is not None and (cap.requested, cap.allowed, cap.context, cap.prompt_tokens) == (50, 13, 32, 20)
    assert all(c.capped is None for c in chunks[1:])
    result = collect(chunks)
    assert result.capped == cap and result.finish_reason == "length" and result.usage.completion_tokens == 13
    assert "capped at 13 (asked 50)" in result.to_dict()["capped"]["message"]
    assert short.complete(ids, max_new_tokens=13).capped is None


# ------------------------------------------------------------------------------------------------ scoring


def test_loglikelihood_is_transformers_forward(small: Any, reference: Any) -> None:
    tok = small.tokenizer
    pairs = [("hello there", " world"), ("a b c", " d e"), ("one", " two three four five")]
    got = small.loglikelihood(pairs, batch_size=2)
    for (context, continuation), (total, greedy) in zip(pairs, got, strict=True):
        ctx = tok(context)["input_ids"]
        whole = tok(context + continuation)["input_ids"]
        lp = _logprobs_of(reference, whole)[len(ctx) - 1 :]
        assert total == pytest.approx(float(lp.sum()), abs=1e-4)
        with torch.inference_mode():
            argmax = reference(torch.tensor([whole])).logits[0, len(ctx) - 1 : -1].argmax(-1).tolist()
        assert greedy == (argmax == whole[len(ctx) :])
    alone = [small.loglikelihood([p])[0] for p in pairs]  # batching changes nothing
    assert [t for t, _ in got] == pytest.approx([t for t, _ in alone], abs=1e-4)
    assert [g for _, g in got] == [g for _, g in alone]
    # the greedy continuation is greedy
    ids = tok("hello there")["input_ids"]
    new = small.complete(ids, max_new_tokens=3).token_ids
    assert small.loglikelihood([(ids, list(new))])[0][1] is True


def test_loglikelihood_on_the_bundled_model(bundled: Any) -> None:
    (paris, paris_greedy), (london, london_greedy) = bundled.loglikelihood(
        [(PROMPT, " Paris"), (PROMPT + " ", "London")]
    )
    assert paris == pytest.approx(LLAMA_CPP_PARIS, abs=0.02) and paris_greedy  # the logprob complete() reports
    assert london < paris and not london_greedy
    with pytest.raises(anyquant.ParameterError, match="empty continuation"):
        bundled.loglikelihood([(PROMPT, "")])
    with pytest.raises(anyquant.ParameterError, match="list of \\(context, continuation\\) pairs"):
        bundled.loglikelihood([PROMPT])


TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital and most populous city of France. "
    "It is located on the Seine river, in the north of the country. The city is known for its museums."
)


def test_rolling_loglikelihood(bundled: Any) -> None:
    ids = bundled.tokenizer(TEXT)["input_ids"]
    (total,) = bundled.loglikelihood_rolling([TEXT])
    prefix = bundled.tokenizer.bos_token_id  # lm-eval's prefix_token_id: BOS, else EOS
    assert prefix is not None
    assert total == pytest.approx(float(_logprobs_of(bundled.module, [prefix, *ids]).sum()), rel=1e-4)
    # windows of 16 tokens: each token sees at most 16 before it; the windows add up to the whole
    windowed = bundled.loglikelihood_rolling([TEXT], window=16)[0]
    pairs = bundled.generator.rolling_pairs(ids, 16)
    assert [t for _, cont in pairs for t in cont] == ids and all(len(c) <= 16 for c, _ in pairs)
    assert windowed < total  # less context, less likely
    # anyquant eval's perplexity on the same text (one window, its first token unscored) agrees
    # (its figure 9.67, rolling's 10.33: rolling also scores the first token, from the prefix token)
    evaluated = anyquant.perplexity(bundled, TEXT, window=len(ids))
    assert math.exp(-total / len(ids)) == pytest.approx(evaluated["perplexity"], rel=0.1)
    # and exactly when both score the same tokens from the same context
    ((rest, _),) = bundled.loglikelihood([(ids[:1], ids[1:])])
    assert -rest == pytest.approx(evaluated["nll_sum"], rel=1e-4)


# ------------------------------------------------------------------------------------------------ sampling


def test_sampling_parameters_have_their_hand_computed_effect() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0]])
    hist = torch.tensor([[3]])

    def pick(generated: list[int] | None = None, **kw: Any) -> int:
        gen = torch.tensor([generated]) if generated else None
        return int(sample_next(logits, GenerationParams(**kw), hist, None, gen).item())

    assert pick() == 0
    assert pick([0], presence_penalty=0.6) == 1  # 2.0 - 0.6 = 1.4 < 1.5
    assert pick([0], presence_penalty=0.4) == 0  # 1.6 > 1.5
    assert pick([0, 0], frequency_penalty=0.3) == 1  # 2.0 - 2 x 0.3 = 1.4
    assert pick([0], frequency_penalty=0.3) == 0  # 1.7
    assert pick(logit_bias={2: 2.5}) == 2  # 0 + 2.5 > 2.0
    assert pick(logit_bias={0: -100}) == 1
    # min_p: probabilities softmax([2, 1.5, 0, -1]) = .547 .332 .074 .037; min_p 0.1 keeps p >= .0547: tokens 0, 1, 2
    probs = torch.softmax(logits[0], -1)
    keep = {i for i in range(4) if probs[i] >= 0.1 * probs.max()}
    assert keep == {0, 1, 2}
    rng = torch.Generator().manual_seed(0)
    seen = {int(sample_next(logits * 0.1, GenerationParams(temperature=1.0, min_p=0.1), hist, rng)) for _ in range(300)}
    assert seen == {0, 1, 2, 3}  # flat logits: nothing below 0.1 x the best
    seen = {int(sample_next(logits, GenerationParams(temperature=1.0, min_p=0.1), hist, rng)) for _ in range(300)}
    assert seen == keep
    seen = {int(sample_next(logits, GenerationParams(temperature=1.0, min_p=0.7), hist, rng)) for _ in range(50)}
    assert seen == {0}  # .332 < .7 x .547


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("logit_bias", {1: 101}),
        ("logit_bias", {"1": 1.0}),
        ("logit_bias", [1, 2]),
        ("logprobs", 1),
        ("top_logprobs", 21),
        ("top_logprobs", 2),  # without logprobs=True
        ("repetition_penalty", 0),
        ("seed", -1),
    ],
)
def test_bad_sampling_parameters_are_refused(field: str, value: Any) -> None:
    with pytest.raises(anyquant.ParameterError, match=field):
        GenerationParams(**{field: value})


def test_seeded_sampling_repeats_and_penalties_change_the_text(bundled: Any) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 5, "temperature": 1.0, "min_p": 0.05, "seed": 7}
    assert bundled.complete(PROMPT, **kw).token_ids == bundled.complete(PROMPT, **kw).token_ids
    with pytest.raises(anyquant.ParameterError, match="vocabulary has 49152"):
        bundled.generate(PROMPT, max_new_tokens=1, logit_bias={10**6: 1.0})


# ------------------------------------------------------------------------------------------------ async


def test_async_generation(small: Any) -> None:
    prompt = small.tokenizer("hello there")["input_ids"]
    want = small.generate(prompt, max_new_tokens=8)

    async def main() -> tuple[str, str, GenerationResult, int]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        text = await small.agenerate(prompt, max_new_tokens=8)
        pieces = "".join([p async for p in small.astream(prompt, max_new_tokens=8)])
        result = await small.acomplete(prompt, max_new_tokens=8)
        done.set()
        await task
        return text, pieces, result, ticks

    text, pieces, result, ticks = asyncio.run(main())
    assert text == pieces == result.text == want
    assert ticks > 8  # the loop ran while the model did


def test_async_cancellation_stops_the_decode(small: Any) -> None:
    """A consumer that stops reading holds the decode (the worker runs at most ASYNC_AHEAD chunks ahead); cancelling
    it stops the decode at the next token and releases the model's lock."""
    from anyquant.protocols import ASYNC_AHEAD

    calls = 0

    def count(*_: Any) -> None:
        nonlocal calls
        calls += 1

    handle = small.module.register_forward_hook(count)
    bias = {small.tokenizer.eos_token_id: -100}
    seen: list[int] = []

    async def main() -> None:
        async def consume() -> None:
            async for _chunk in small.acomplete_stream("hello", max_new_tokens=400, logit_bias=bias):
                seen.append(calls)
                await asyncio.sleep(60)  # a client that stopped reading

        task = asyncio.create_task(consume())
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
        deadline = time.monotonic() + 30
        while not small.lock.acquire(timeout=0.1):  # the worker let go of the model
            assert time.monotonic() < deadline
        small.lock.release()
        assert len(seen) == 1
        assert calls <= ASYNC_AHEAD + 3, calls  # not 400: held while unread, stopped when cancelled
        settled = calls
        time.sleep(0.2)
        assert calls == settled
    finally:
        handle.remove()


def test_async_checks_parameters_first(small: Any) -> None:
    with pytest.raises(anyquant.ParameterError, match="max_new_tokens"):
        asyncio.run(small.agenerate("hi", max_new_tokens=-1))


# ------------------------------------------------------------------------------------------------ plugins


class PlainGenerator:
    """A plugin's generator with only the three protocol methods."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def generate(self, prompt: Any, params: Any) -> str:
        return str(self.inner.generate(prompt, params))

    def stream(self, prompt: Any, params: Any) -> Any:
        return self.inner.stream(prompt, params)

    def generate_batch(self, prompts: Any, params: Any) -> list[str]:
        return list(self.inner.generate_batch(prompts, params))


def test_a_plugin_generator_without_the_new_methods(tiny: Path) -> None:
    model = anyquant.load(tiny)
    want = model.complete("hello", max_new_tokens=4)
    model.generator = PlainGenerator(model.generator)
    assert isinstance(model.generator, anyquant.Generator)
    got = model.complete("hello", max_new_tokens=4)
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    (got_total, _), (want_total, _) = (m.loglikelihood([("hello", " there")])[0] for m in (model, anyquant.load(tiny)))
    assert got_total == pytest.approx(want_total, abs=1e-5)
    model.close()


# ------------------------------------------------------------------------------------------------ CLI


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-new-tokens", "-1"], "max_new_tokens=-1"),
        (["--temperature", "-1"], "temperature=-1"),
        (["--repetition-penalty", "0"], "repetition_penalty=0"),
        (["--min-p", "2"], "min_p=2"),
        (["--prompt", ""], "--prompt is empty"),
    ],
)
def test_cli_checks_parameters_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    import json

    from anyquant.cli import main

    missing = tmp_path / "no-such-model"  # loading it would be a ProbeError: the parameters fail first
    code = main(["generate", str(missing), "--prompt", "Hi", *flags, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["error"] == "ParameterError" and message in out["message"]


def test_cli_json_gives_the_result(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from anyquant.cli import main

    argv = ["generate", "--prompt", PROMPT, "--max-new-tokens", "4", "--stop", ".", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == " Paris" and out["finish_reason"] == "stop" and out["stop_string"] == "."
    assert out["token_ids"] == [7042, 30] and out["usage"]["prompt_tokens"] == 5 and out["usage"]["total_tokens"] == 7
    assert set(out["timings"]) == {
        "prefill_seconds",
        "decode_seconds",
        "prefill_tokens_per_second",
        "decode_tokens_per_second",
    }
    assert out["format"] == "gguf" and out["capped"] is None


def test_cli_system_and_cap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from anyquant.cli import main

    path = make_tiny_dense(tmp_path / "short", max_position_embeddings=64)
    model = anyquant.load(path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = model.complete(chat, max_new_tokens=3)
    assert (
        main(["generate", str(path), "--prompt", "Hi", "--system", "Be brief.", "--max-new-tokens", "3", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == list(want.token_ids) and out["usage"]["prompt_tokens"] == want.usage.prompt_tokens
    long_prompt = "a" * 50
    n = len(model.tokenizer(long_prompt)["input_ids"])
    assert 50 <= n < 60
    assert main(["generate", str(path), "--prompt", long_prompt, "--max-new-tokens", "40"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"note: max_new_tokens capped at {65 - n} (asked 40)"), err


def test_parameters_stay_hashable_and_equal_by_value() -> None:
    a, b = GenerationParams(logit_bias={1: 2}), GenerationParams(logit_bias={1: 2.0})
    assert a == b and hash(a) == hash(b) and a.logit_bias == {1: 2.0}
    assert a != GenerationParams(logit_bias={1: 3.0})
