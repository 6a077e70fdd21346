"""Phi-3's LongRoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) in anyquant's native decoder, judged by transformers'
own ``Phi3ForCausalLM``: tiny random models whose original context (``original_max_position_embeddings``) is 32
positions, so that prompts run past it and generations cross it.

What transformers does, and these tests hold the native decoder to (``anyquant_runtime.native.LongRope``): each
forward turns all its positions by the long factors when its largest position id is at or past the original context,
else by the short ones; keys already cached stay as they were turned (a generation crossing the threshold attends
short-factor keys with long-factor queries); cos and sin are scaled by the attention factor. transformers' class takes
the largest position of the whole batch, the native decoder each row's own: a padded batch's rows get what each gets
from transformers' class alone (these tests judge them so; transformers' own padded batch differs for the short rows).

Measured here (float32 and bfloat16 alike): the logits of single prompts and of cached steps are bitwise
transformers' (max abs diff 0.0: the same ops in the same order on the same shapes); a left-padded row's are within
float rounding of the row alone (its attention runs with a padding mask, another kernel path than the row alone's
causal one: a few 1e-7 in float32), as are :meth:`NativeCausalLM.decode_rows`' rows (the linears run over all rows at
once); the greedy tokens are transformers' ``generate``'s."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant
from anyquant.testing.tiny import make_tiny_dense, tiny_llama_config
from anyquant_runtime.build import choose_runtime
from anyquant_runtime.native import LongRope, NativeCausalLM, NativeConfig, native_runtime_reason, rope_inv_freq

pytestmark = pytest.mark.slow

ORIGINAL = 32  # the tiny models' original context: prompts of 33 positions and more take the long factors


def _factors(n: int, step: float) -> list[float]:
    return [round(1.0 + step * i, 6) for i in range(n)]


#: the tiny models (hidden 128, 4 heads of 32 features, 2 key/value heads, 2 layers)
VARIANTS: dict[str, dict[str, Any]] = {
    # Phi-3-mini-128k's layout (as transformers 5 writes it): the original context at the config's top level, no
    # factor nor attention_factor (sqrt(1 + log(512 / 32) / log(32)) from max_position_embeddings)
    "phi3-longrope": {
        "max_position_embeddings": 512,
        "original_max_position_embeddings": ORIGINAL,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": _factors(16, 0.05),
            "long_factor": _factors(16, 0.5),
        },
    },
    # Phi-4-mini's: partial rotary (24 of each head's 32 features: 12 factors each), tied embeddings
    "phi4-mini-partial": {
        "max_position_embeddings": 1024,
        "original_max_position_embeddings": ORIGINAL,
        "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": _factors(12, 0.02),
            "long_factor": _factors(12, 0.7),
        },
    },
    # the parameters' own factor and attention_factor, a sliding window shorter than the longer prompts
    "phi3-longrope-given": {
        "max_position_embeddings": 512,
        "original_max_position_embeddings": ORIGINAL,
        "sliding_window": 24,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 500.0,
            "short_factor": _factors(16, 0.1),
            "long_factor": _factors(16, 0.3),
            "factor": 4.0,
            "attention_factor": 1.25,
        },
    },
    # a config.json of before transformers 5 (rewritten after saving): rope_scaling of type "su" (transformers takes
    # it only with an original context among its parameters; the config's own, 32, overrides their 16), rope_theta at
    # the top level
    "phi3-su-legacy": {
        "max_position_embeddings": 256,
        "original_max_position_embeddings": ORIGINAL,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": _factors(16, 0.03),
            "long_factor": _factors(16, 0.4),
        },
    },
}


def _legacy(path: Path) -> None:
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = {
        "type": "su",
        "short_factor": rope["short_factor"],
        "long_factor": rope["long_factor"],
        "original_max_position_embeddings": 16,
    }
    (path / "config.json").write_text(json.dumps(cfg))


def _make(root: Path, name: str) -> Path:
    path = make_tiny_dense(root / name, model_type="phi3", **{"sliding_window": None, **VARIANTS[name]})
    if name.endswith("legacy"):
        _legacy(path)
    return path


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, _make(tmp_path_factory.mktemp(request.param), request.param)


def _pair(path: Path, dtype: torch.dtype = torch.float32) -> tuple[anyquant.LoadedModel, Any]:
    """anyquant's native model of ``path`` (``runtime="auto"`` picks it) and transformers' ``Phi3ForCausalLM``."""
    import transformers

    ours = anyquant.load(path, runtime="auto", dtype=dtype)
    assert isinstance(ours.module, NativeCausalLM) and ours.info["runtime"] == "native"
    assert ours.module.config.longrope is not None
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    assert type(theirs).__name__ == "Phi3ForCausalLM" and theirs.model.rotary_emb.rope_type == "longrope"
    return ours, theirs


def _ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def _steps(module: Any, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """The last-position logits after the prompt ``ids[:, :prompt]`` (one forward), then after each further token fed
    one at a time through the module's cache (``cache``: transformers' keyword, the native model's too)."""
    out = module(ids[:, :prompt], use_cache=True)
    logits = [out.logits[:, -1]]
    for i in range(prompt, ids.shape[1]):
        out = module(ids[:, i : i + 1], cache=out.cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


def _padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ids, attention mask and position ids, as anyquant's generator makes them."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_which_longrope_configs_run_natively() -> None:
    phi3 = tiny_llama_config(model_type="phi3", sliding_window=None, original_max_position_embeddings=ORIGINAL)
    good = {"short_factor": [1.0] * 16, "long_factor": [2.0] * 16}
    for rope in (
        {"rope_type": "longrope", **good},
        {"type": "longrope", **good},  # Phi-3.5-mini's and Phi-4-mini's config.json
        {"type": "su", **good, "original_max_position_embeddings": 4096},  # Phi3Config renames it longrope
        {"rope_type": "yarn", **good, "original_max_position_embeddings": 4096},  # and this too
    ):
        cfg = {**phi3, "rope_scaling": rope}
        assert native_runtime_reason(cfg) is None, rope
        assert choose_runtime(cfg, "auto") == "native"
        assert isinstance(NativeConfig(cfg).longrope, LongRope)
    for rope, why in (
        ({"rope_type": "longrope"}, "short_factor None"),
        ({"rope_type": "su", "short_factor": [1.0] * 16}, "'su': long_factor None"),
        # Phi-3-mini-128k's first config.json: transformers 5's Phi3Config refuses it (no original context where
        # it looks for one once it has renamed the type)
        ({"type": "su", **good}, "'su' without original_max_position_embeddings"),
        ({"rope_type": "longrope", **good, "long_factor": [2.0] * 12}, "a list of 16 numbers"),
        ({"rope_type": "longrope", **good, "short_factor": ["1"] * 16}, "short_factor"),
        ({"rope_type": "longrope", **good, "attention_factor": "x"}, "attention_factor"),
        ({"rope_type": "longrope", **good, "factor": None, "attention_factor": None}, None),
    ):
        reason = native_runtime_reason({**phi3, "rope_parameters": rope})
        assert (reason is None) if why is None else why in str(reason), (rope, reason)
    assert "original_max_position_embeddings" in str(
        native_runtime_reason(
            {**phi3, "original_max_position_embeddings": 1, "rope_parameters": {"type": "longrope", **good}}
        )
    )
    # partial rotary: one factor per turned pair (Phi-4-mini: 0.75 of 128 features, 48 factors)
    partial = {**phi3, "partial_rotary_factor": 0.75}
    assert native_runtime_reason({**partial, "rope_parameters": {"rope_type": "longrope", **good}}) is not None
    twelve = {"rope_type": "longrope", "short_factor": [1.0] * 12, "long_factor": [2.0] * 12}
    assert native_runtime_reason({**partial, "rope_parameters": twelve}) is None
    # other models keep refusing it; Phi-3 any other scaling
    assert "'longrope'" in str(native_runtime_reason({**tiny_llama_config(), "rope_parameters": twelve}))
    assert "'llama3'" in str(native_runtime_reason({**phi3, "rope_parameters": {"rope_type": "llama3"}}))


def test_tables_equal_transformers(built: tuple[str, Path]) -> None:
    """The short and long inverse frequencies, the attention factor and the original context are transformers'
    (its config class's reading of the same config.json, the top-level original context over the parameters')."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, path = built
    raw = json.loads((path / "config.json").read_text())
    config = NativeConfig(raw)
    longrope = config.longrope
    assert longrope is not None
    ref = AutoConfig.from_pretrained(path)
    short, scaling = ROPE_INIT_FUNCTIONS["longrope"](ref)
    original = ref.rope_parameters["original_max_position_embeddings"]
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](ref, seq_len=original + 1)
    assert longrope.original_max_position_embeddings == original == ORIGINAL
    assert longrope.attention_factor == scaling and scaling != 1.0
    assert torch.equal(rope_inv_freq(config), short)
    model = NativeCausalLM(raw)
    assert torch.equal(model.inv_freq, short) and model.long_inv_freq is not None
    assert torch.equal(model.long_inv_freq, long) and not torch.equal(long, short)
    if "partial_rotary_factor" in VARIANTS[built[0]]:
        assert config.rotary_dim == 24 < config.head_dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_logits_equal_transformers(built: tuple[str, Path], dtype: torch.dtype) -> None:
    """Single prompts short of, at and past the original context (32: the short factors; 33 and 70: the long ones):
    transformers' logits bit for bit; and the two sets do differ (the long prompt's logits are not the short
    factors')."""
    ours, theirs = _pair(built[1], dtype)
    with torch.no_grad():
        for length in (12, ORIGINAL, ORIGINAL + 1, 70):
            ids = _ids(1, length, length)
            a, b = ours.module(ids).logits, theirs(ids).logits
            assert a.dtype == b.dtype == dtype
            assert torch.equal(a, b), (length, float((a.float() - b.float()).abs().max()))
        long = ours.module.long_inv_freq
        ours.module.long_inv_freq = ours.module.inv_freq  # the short factors everywhere
        try:
            short = ours.module(ids).logits
        finally:
            ours.module.long_inv_freq = long
        assert not torch.equal(short, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_generation_crossing_the_threshold_equals_transformers(built: tuple[str, Path], dtype: torch.dtype) -> None:
    """A 20-token prompt, then 24 tokens fed one at a time (the 13th at position 32: from there on the long factors,
    the keys cached before staying as the short factors turned them): each step's logits bitwise transformers'
    cached steps'; not the full forward's over the same tokens (that turns every position by the long factors); the
    greedy tokens transformers' generate's."""
    ours, theirs = _pair(built[1], dtype)
    ids = _ids(1, 44, 3)
    with torch.no_grad():
        a, b = _steps(ours.module, ids, 20), _steps(theirs, ids, 20)
        if VARIANTS[built[0]].get("sliding_window"):
            # past the window: transformers masks the keys before it, the native cache gives only the window's
            # (the same sum over another length of keys: float rounding, 6e-8 measured)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b), float((a.float() - b.float()).abs().max())
        if dtype == torch.float32:
            # up to position 31 the short factors everywhere: the full forward's numbers (float rounding)
            short = ours.module(ids[:, :ORIGINAL]).logits[:, 19:]
            torch.testing.assert_close(a[:, :13], short, rtol=1e-5, atol=1e-6)
            # past it, not the full forward's, which turns every position by the long factors (the tiny random
            # models attend nearly evenly: the turning moves their logits by about 1e-4)
            full = ours.module(ids).logits[:, ORIGINAL:]
            assert float((a[:, 13:] - full).abs().max()) > 1e-5
        want = theirs.generate(
            ids[:, :20], attention_mask=torch.ones(1, 20, dtype=torch.long), max_new_tokens=24, do_sample=False
        )[0, 20:].tolist()
    ours.generator.eos_ids = set()
    got = ours.generator.generate_ids(ids[0, :20].tolist(), ours.params(max_new_tokens=24))
    assert len(got) == 24 and got[: len(want)] == want  # (transformers' stops at its end-of-sequence id)


def test_left_padded_batch_rows_are_each_row_alone(built: tuple[str, Path]) -> None:
    """A left-padded batch of a short prompt (12: short factors), a long one (40) and one that crosses the
    threshold while generating (28): each row's logits within float rounding of transformers' for that row alone
    (transformers' own padded batch turns the short row by the long factors: not what that row gets alone), and each
    row's greedy tokens transformers' generate's for it alone."""
    ours, theirs = _pair(built[1])
    prompts = [_ids(1, n, 10 + n)[0] for n in (12, 40, 28)]
    ids, mask, positions = _padded(prompts)
    width = ids.shape[1]
    with torch.no_grad():
        batch = ours.module(ids, attention_mask=mask, position_ids=positions).logits
        theirs_batch = theirs(ids, attention_mask=mask, position_ids=positions).logits
        worst = 0.0
        for i, p in enumerate(prompts):
            alone = theirs(p[None]).logits[0]
            row = batch[i, width - len(p) :]
            worst = max(worst, float((row - alone).abs().max()))
            torch.testing.assert_close(row, alone, rtol=1e-5, atol=1e-5)
            if len(p) <= ORIGINAL:  # transformers' batch: the long factors for it too
                assert float((theirs_batch[i, width - len(p) :] - alone).abs().max()) > 1e-5
        assert worst < 1e-5
        want = [
            theirs.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=10)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    params = ours.params(max_new_tokens=10)
    got: list[list[int]] = [[] for _ in prompts]
    for tokens in ours.generator.token_steps([p.tolist() for p in prompts], params, ends=[]):
        for i, token in enumerate(tokens):
            got[i].append(int(token))  # type: ignore[arg-type]
    for i in range(len(prompts)):
        assert got[i][: len(want[i])] == want[i], i


def test_left_padded_batch_past_the_threshold_equals_transformers_batch(built: tuple[str, Path]) -> None:
    """Where every row is past the original context, transformers' padded batch turns each by the long factors as
    alone: the native batch gives its logits bit for bit (so the float rounding between a padded row and the row
    alone above is the padding mask's kernel path, transformers' too)."""
    ours, theirs = _pair(built[1])
    ids, mask, positions = _padded([_ids(1, n, n)[0] for n in (36, 50)])
    with torch.no_grad():
        a = ours.module(ids, attention_mask=mask, position_ids=positions).logits
        b = theirs(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert torch.equal(a[real], b[real]), float((a[real] - b[real]).abs().max())


def test_decode_rows_are_each_row_alone(built: tuple[str, Path]) -> None:
    """The server's shared step (:meth:`NativeCausalLM.decode_rows`, one call for every row, each over its own cache)
    with rows short of, crossing and past the threshold: each row's logits those of transformers' cached steps for
    that row alone (float rounding: the linears run over the three rows at once)."""
    ours, theirs = _pair(built[1])
    lengths, steps = (10, 26, 45), 12
    rows = [_ids(1, n + steps, 20 + n) for n in lengths]
    with torch.inference_mode():
        caches, logits = [], []
        for ids, n in zip(rows, lengths, strict=True):
            out = ours.module(ids[:, :n], use_cache=True)
            caches.append(out.cache)
            logits.append([out.logits[0, -1]])
        for s in range(steps):
            fed = torch.tensor([[int(ids[0, n + s])] for ids, n in zip(rows, lengths, strict=True)])
            out = ours.module.decode_rows(fed, torch.tensor([[n + s] for n in lengths]), caches)
            for i in range(len(rows)):
                logits[i].append(out[i])
        for i, (ids, n) in enumerate(zip(rows, lengths, strict=True)):
            want = _steps(theirs, ids, n)[0]
            torch.testing.assert_close(torch.stack(logits[i]), want, rtol=1e-5, atol=1e-5)


def test_the_servers_shared_pass_answers_as_transformers_alone(built: tuple[str, Path]) -> None:
    """anyquant-serve's batch (each prompt prefilled in one forward, then every request in one shared pass a step):
    each request's greedy tokens those of transformers' generate for it alone."""
    DecodeBatch = pytest.importorskip("anyquant_serve.batch", reason="the server is anyquant-serve's").DecodeBatch

    ours, theirs = _pair(built[1])
    prompts = {"short": _ids(1, 9, 1)[0], "crossing": _ids(1, 27, 2)[0], "long": _ids(1, 41, 3)[0]}
    gen: Any = ours.generator
    batch = DecodeBatch(ours.module, gen.cache_kw, gen.device, 0)
    assert batch.shared
    last = {key: batch.prefill(key, ids.tolist()) for key, ids in prompts.items()}
    tokens: dict[str, list[int]] = {key: [] for key in prompts}
    for _ in range(10):
        keys = [slot.key for slot in batch.slots]
        fed = [int(last[key].argmax()) for key in keys]  # type: ignore[union-attr]
        out = batch.step(fed)
        for i, key in enumerate(keys):
            tokens[key].append(fed[i])
            last[key] = out[i]
    with torch.no_grad():
        for key, ids in prompts.items():
            want = theirs.generate(
                ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=10
            )[0, len(ids) :].tolist()
            assert tokens[key][: len(want)] == want, key


def test_a_prompt_prefilled_in_chunks_is_turned_as_in_one_forward(
    built: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 40-token prompt (past the original context) prefilled in chunks of 8, as generate and the server prefill
    long prompts: every chunk turned by the long factors, as transformers' one forward over the whole prompt turns
    it (``rope_horizon``), so the last position's logits are transformers' (float rounding: the chunks' attention
    over a cache) and the greedy tokens its generate's. Without the horizon the first four chunks took the short
    factors: other logits (the test can fail)."""
    import anyquant_runtime.generate as generate

    DecodeBatch = pytest.importorskip("anyquant_serve.batch", reason="the server is anyquant-serve's").DecodeBatch

    ours, theirs = _pair(built[1])
    ids = _ids(1, 40, 77)
    with torch.no_grad():
        want = theirs(ids).logits[0, -1]

        def chunked(horizon: int | None) -> torch.Tensor:
            out = None
            for start in range(0, 40, 8):
                kw = {"cache": out.cache} if out is not None else {}
                out = ours.module(ids[:, start : start + 8], use_cache=True, rope_horizon=horizon, **kw)
            assert out is not None
            return out.logits[0, -1]

        torch.testing.assert_close(chunked(40), want, rtol=1e-5, atol=1e-5)
        assert float((chunked(None) - want).abs().max()) > 1e-5
        tokens = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    want_tokens = tokens[0, 40:].tolist()
    monkeypatch.setattr(generate, "PREFILL_CHUNK", 8)
    ours.generator.eos_ids = set()
    got = ours.generator.generate_ids(ids[0].tolist(), ours.params(max_new_tokens=8))
    assert got[: len(want_tokens)] == want_tokens
    batch = DecodeBatch(ours.module, ours.generator.cache_kw, ours.generator.device, 8)  # serve's chunks of 8
    logits = batch.prefill("long", ids[0].tolist())
    assert logits is not None
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_the_prefix_cache_keeps_the_factors_apart(built: tuple[str, Path]) -> None:
    """A kept prompt within the original context (its keys turned by the short factors) gives its first chunks to
    another prompt within it, never to one past it (whose every position the long factors turn), and back."""
    from anyquant_serve.prefix import PrefixCache

    ours, _ = _pair(built[1])
    regime = ours.module.rope_regime
    assert (regime(ORIGINAL), regime(ORIGINAL + 1)) == (False, True)
    cache = PrefixCache(1 << 30, 8, regime)
    short, longer = list(range(24)), list(range(40))
    assert cache.reusable(tuple(short), tuple(range(30))) == 24
    assert cache.reusable(tuple(short), tuple(longer)) == 0
    assert cache.reusable(tuple(longer), tuple(range(36))) == 32
    assert cache.reusable(tuple(longer), tuple(short)) == 0
    assert PrefixCache(1 << 30, 8).reusable(tuple(short), tuple(longer)) == 24  # one regime: no such bound
    from anyquant_serve.scheduler import ModelAdapter, Scheduler

    server = Scheduler(ModelAdapter(ours), prefill_chunk=8)  # the server's own cache takes the model's regime
    try:
        assert server.prefix.regime == regime
    finally:
        server.close()


def test_attention_factor_formula() -> None:
    """transformers' default attention factor: 1 when factor <= 1, else sqrt(1 + log(factor) / log(original)),
    factor defaulting to max_position_embeddings / original (Phi-3-mini-128k: 131072 / 4096)."""
    rope = {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}
    mini = tiny_llama_config(
        model_type="phi3",
        hidden_size=3072,
        num_attention_heads=32,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling=rope,
    )
    longrope = NativeConfig(mini).longrope
    assert longrope is not None and longrope.original_max_position_embeddings == 4096
    assert longrope.attention_factor == math.sqrt(1 + math.log(32) / math.log(4096))
    same = NativeConfig({**mini, "max_position_embeddings": 4096}).longrope
    assert same is not None and same.attention_factor == 1.0
    # the config class's original context (4096 where the config leaves it out) over the parameters'
    del mini["original_max_position_embeddings"]
    moved = NativeConfig({**mini, "rope_scaling": {**rope, "original_max_position_embeddings": 64}}).longrope
    assert moved is not None and moved.original_max_position_embeddings == 4096
