"""evaluate / compare: perplexity against transformers' own loss, the measurements, table, plot, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant
from anyquant.cli import build_parser
from anyquant.testing.tiny import make_tiny_dense
from anyquant_tools import evaluate as ev
from anyquant_tools.evaluate import EvaluationError

TEXT = (
    "Once upon a time there was a small robot who liked to count the stars. Every night it climbed the hill, "
    "looked up, and wrote numbers in a little book: one, two, three, four. "
) * 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dense(tmp_path_factory.mktemp("tiny") / "a", seed=0)


@pytest.fixture(scope="module")
def tiny_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dense(tmp_path_factory.mktemp("tiny") / "b", seed=1)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("text") / "story.txt"
    f.write_text(TEXT)
    return f


@pytest.fixture(scope="module")
def loaded(tiny: Path) -> Any:
    return anyquant.load(tiny)


@pytest.fixture(scope="module")
def reference(tiny: Path) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(tiny)


def _reference_ppl(reference: Any, text: str, window: int, max_tokens: int) -> tuple[float, int]:
    """Perplexity with transformers' own model and loss (labels=input_ids), window by window."""
    model, tokenizer = reference
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(ids) // window):
            x = torch.tensor([ids[i * window : (i + 1) * window]])
            loss = model(x, labels=x).loss  # mean over the window's window-1 predicted tokens
            nll += float(loss) * (window - 1)
            count += window - 1
    return math.exp(nll / count), count


def test_perplexity_matches_transformers_loss(loaded: Any, reference: Any) -> None:
    want, count = _reference_ppl(reference, TEXT, 64, 1000)
    got = ev.perplexity(loaded, TEXT, window=64, max_tokens=1000)
    assert got["perplexity"] == pytest.approx(want, rel=1e-5)
    assert (got["window"], got["windows"], got["tokens"], got["predicted_tokens"]) == (64, 15, 960, count)
    assert got["tokens_available"] == len(TEXT) and got["tokens_read"] == 1000 and got["tokens_dropped"] == 40
    # a different window length gives a different (but still transformers-equal) value
    want32, _ = _reference_ppl(reference, TEXT, 32, 1000)
    assert ev.perplexity(loaded, TEXT, window=32, max_tokens=1000)["perplexity"] == pytest.approx(want32, rel=1e-5)
    assert want32 != pytest.approx(want, rel=1e-4)


def test_perplexity_of_token_ids_equals_text(loaded: Any) -> None:
    ids = loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    by_text = ev.perplexity(loaded, TEXT, window=100)
    assert ev.perplexity(loaded, ids, window=100)["perplexity"] == by_text["perplexity"]
    assert ev.perplexity(loaded, torch.tensor([ids]), window=100)["perplexity"] == by_text["perplexity"]


def test_perplexity_refuses_short_text(loaded: Any) -> None:
    with pytest.raises(EvaluationError, match="fewer than one"):
        ev.perplexity(loaded, "short", window=64)
    with pytest.raises(EvaluationError):
        ev.perplexity(loaded, TEXT, window=1)


def test_evaluate_measures_everything(tiny: Path, text_file: Path, loaded: Any) -> None:
    r = ev.evaluate(tiny, text=str(text_file), window=64, max_tokens=640, prefill_tokens=128, decode_tokens=4)
    assert (r.format, r.window, r.windows, r.tokens, r.text) == ("dense", 64, 10, 640, str(text_file))
    assert r.perplexity == pytest.approx(ev.perplexity(loaded, TEXT, window=64, max_tokens=640)["perplexity"], rel=1e-6)
    assert r.load_s > 0 and r.memory_kind == "rss"
    assert r.peak_memory_bytes is not None and r.peak_memory_bytes > 50 * 2**20  # a Python process with torch
    assert r.prefill_tokens == 128 and r.prefill_tok_s is not None and r.prefill_tok_s > 0
    assert r.decode_tok_s is None or r.decode_tok_s > 0
    assert r.bits_per_weight == 32.0 and r.parameters and r.bytes_on_disk
    json.dumps(r.to_dict())


def test_compare_alternates_and_reports(
    tiny: Path, tiny_b: Path, text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    real_open = ev._open

    def recording_open(path: Any, load_kwargs: dict[str, Any]) -> Any:
        order.append(Path(path).name)
        return real_open(path, load_kwargs)

    monkeypatch.setattr(ev, "_open", recording_open)
    seen: list[tuple[str, float]] = []
    results = ev.compare(
        [tiny, tiny_b],
        text=str(text_file),
        window=64,
        max_tokens=384,
        prefill_tokens=64,
        decode_tokens=3,
        rounds=2,
        progress=lambda stage, frac: seen.append((stage, frac)),
    )
    assert order == ["a", "b", "b", "a"]  # same text and windows, alternating order for the timings
    assert seen == [
        ("a (round 1)", 0.0),
        ("b (round 1)", 0.25),
        ("b (round 2)", 0.5),
        ("a (round 2)", 0.75),
        ("done", 1.0),
    ]
    assert [r.label for r in results] == ["a", "b"] and all(r.rounds == 2 for r in results)
    assert {(r.window, r.windows, r.tokens) for r in results} == {(64, 6, 384)}
    assert results[0].perplexity != results[1].perplexity  # two different random models

    md = ev.to_markdown(results)
    assert md.splitlines()[0].startswith("| checkpoint | format | bits/w | perplexity")
    assert "| a | dense f32 |" in md and "| b | dense f32 |" in md and "6 windows x 64 tokens" in md
    png = ev.plot(results, tmp_path / "out" / "cmp.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[0] > 100


def test_cli_eval_and_compare(tiny: Path, tiny_b: Path, text_file: Path, tmp_path: Path, capsys: Any) -> None:
    parser = build_parser()  # the tools' commands are anyquant-tools' plugin's
    common = ["--text", str(text_file), "--window", "64", "--max-tokens", "256", "--prefill-tokens", "32"]
    args = parser.parse_args(["eval", str(tiny), *common, "--decode-tokens", "2", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["windows"] == 4 and out["perplexity"] > 1
    png = tmp_path / "c.png"
    args = parser.parse_args(
        ["compare", str(tiny), str(tiny_b), *common, "--rounds", "1", "--png", str(png), "--markdown"]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "| a |" in printed and "| b |" in printed and png.is_file()


@pytest.mark.model
def test_smollm2_perplexity_on_held_out_tiny_stories() -> None:
    """The packaged SmolLM2-135M (Q4_1 GGUF) on TinyStories: ENVIRONMENT.md measured ~9.4 at 20k tokens."""
    r = ev.evaluate(
        anyquant.default_model(), text="tiny", window=512, max_tokens=1024, prefill_tokens=64, decode_tokens=2
    )
    assert r.format == "gguf" and r.windows == 2
    assert 4 < r.perplexity < 20, r.perplexity


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": -5},
        {"decode_tokens": -3},
        {"prefill_tokens": 0},
        {"rounds": 0},
        {"rounds": -2},
        {"max_tokens": 1.5},
    ],
)
def test_bad_counts_are_refused_before_any_load(kwargs: dict) -> None:
    """max_tokens=-5 sliced ids[:-5] (the whole 363k-token corpus) and rounds=0 ran one round, silently."""
    with pytest.raises(anyquant.EvaluationError, match=next(iter(kwargs))):
        anyquant.compare(["/nonexistent/a", "/nonexistent/b"], **kwargs)
