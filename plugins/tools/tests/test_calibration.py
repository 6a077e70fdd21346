"""Calibration sources, mixes, user files, the HF cache, the hook, and the overlap guard."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import anyquant
from anyquant.cli import build_parser
from anyquant_tools import calibration as cal
from anyquant_tools.calibration import CalibrationError, CalibrationOverlapError


@pytest.fixture(scope="module", autouse=True)
def _corpus() -> None:
    try:
        cal.corpus_dir()
    except CalibrationError as exc:  # pragma: no cover - the venv installs exllamav3's wheel
        pytest.skip(str(exc))


def _source_of(sample: str) -> list[str]:
    """Which corpora's calibration parts contain the start of ``sample``."""
    head = sample[:120]
    return [name for name in cal.CORPUS_NAMES if head in "\n\n".join(cal.corpus_documents(name))]


# ---------------------------------------------------------------------- corpus


def test_corpus_read_without_importing_exllamav3() -> None:
    code = (
        "import sys\nfrom anyquant_tools import calibration as c\n"
        "assert len(c.sample('wiki', 2, 64, 0)) == 2\n"
        "assert 'exllamav3' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", cal.CORPUS_NAMES)
def test_corpus_split_holds_out_evaluation(name: str) -> None:
    calib, evals, every = (cal.corpus_documents(name, p) for p in ("calibration", "evaluation", "all"))
    assert calib and evals and every == calib + evals
    share = sum(map(len, evals)) / sum(map(len, every))
    assert 0.15 < share < 0.35, share
    raw = (cal.corpus_dir() / f"{name}.utf8").read_text(encoding="utf-8")
    assert evals[-1][-200:].strip() in raw  # real text from the installed file


def test_wiki_documents_are_articles() -> None:
    docs = cal.corpus_documents("wiki", "all")
    assert len(docs) > 1000 and not any(d.startswith("<doc") or "</doc>" in d for d in docs[:50])


# ---------------------------------------------------------------------- sampling and mixes


def test_sample_is_deterministic_by_seed() -> None:
    a = cal.sample("c4:0.5,code:0.25,wiki:0.25", 12, 128, seed=7)
    assert a == cal.sample("c4:0.5,code:0.25,wiki:0.25", 12, 128, seed=7)
    assert a != cal.sample("c4:0.5,code:0.25,wiki:0.25", 12, 128, seed=8)
    assert len(a) == 12 and all(0.8 * 128 * cal.CHARS_PER_TOKEN <= len(t) <= 128 * cal.CHARS_PER_TOKEN for t in a)


def test_mix_allocates_by_weight_and_draws_from_each_source() -> None:
    assert cal.allocate(cal.parse_mix("c4:0.5,code:0.25,wiki:0.25"), 8) == [4, 2, 2]
    assert cal.allocate(cal.parse_mix("c4:0.5,code:0.25,wiki:0.25"), 10) == [5, 3, 2]  # largest remainder
    assert cal.allocate(cal.parse_mix("tiny:1,c4:3"), 7) == [2, 5]
    texts = cal.sample("c4:0.5,code:0.25,wiki:0.25", 8, 64, seed=1)
    sources = [_source_of(t) for t in texts]
    assert all(len(s) == 1 for s in sources), sources
    counts = {n: sum(s == [n] for s in sources) for n in ("c4", "code", "wiki")}
    assert counts == {"c4": 4, "code": 2, "wiki": 2}


def test_samples_come_from_the_calibration_part_only() -> None:
    held_out = cal.evaluation_text("tiny")
    for t in cal.sample("tiny", 20, 64, seed=3):
        assert t[:100] not in held_out


@pytest.mark.parametrize("spec", ["", "c4:0", "c4:-1", "c4:nan", "c4,c4:2", "nope", "wiki:1,nope:1"])
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(CalibrationError):
        cal.sample(spec, 4, 32, registry=anyquant.Registry(entry_points=False))


def test_parse_mix_default_weight() -> None:
    assert cal.parse_mix("wiki, c4:2") == [cal.Component("wiki", 1.0), cal.Component("c4", 2.0)]


# ---------------------------------------------------------------------- user files and the HF cache


TEXT = " ".join(f"sentence number {i} talks about topic {i % 17} and colour {i % 5}." for i in range(400))


def test_txt_file(tmp_path: Path) -> None:
    f = tmp_path / "mine.txt"
    f.write_text(TEXT)
    texts = cal.sample(str(f), 5, 32, seed=0)
    assert len(texts) == 5 and all(t in TEXT for t in texts)
    assert texts == cal.sample(str(f), 5, 32, seed=0)


def test_text_shorter_than_one_sample_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file shorter than one sample gave N copies of itself without a word (a Hessian from one text,
    N times the compute); now a warning says so. Text that only overlaps is an INFO line; enough text, nothing."""
    f = tmp_path / "short.txt"
    f.write_text("one short line of calibration text")
    with caplog.at_level("INFO", logger="anyquant_tools.calibration"):
        texts = cal.sample(str(f), 4, 64, seed=0)
    assert len(set(texts)) == 1
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "all 4 samples are that same text" in caplog.text
    caplog.clear()
    (tmp_path / "some.txt").write_text(TEXT)  # ~26,000 characters: 20 samples of 64 tokens (~256) fit
    with caplog.at_level("INFO", logger="anyquant_tools.calibration"):
        cal.sample(str(tmp_path / "some.txt"), 20, 64, seed=0)
        assert not caplog.records
        cal.sample(str(tmp_path / "some.txt"), 200, 64, seed=0)
    assert [r.levelname for r in caplog.records] == ["INFO"] and "overlap" in caplog.text


def test_jsonl_file(tmp_path: Path) -> None:
    f = tmp_path / "mine.jsonl"
    rows = [{"text": f"row {i}: " + TEXT[i * 50 : i * 50 + 400], "body": f"other {i}"} for i in range(30)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert cal.documents(str(f)) == [r["text"] for r in rows]
    assert cal.documents(f"{f}#body") == [r["body"] for r in rows]
    assert len(cal.sample(f"{f}:1,tiny:1", 6, 32, seed=0)) == 6
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text"}\n')
    with pytest.raises(CalibrationError, match=r"bad.jsonl:2"):
        cal.documents(str(bad))


def test_parquet_file(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "mine.parquet"
    docs = [TEXT[i * 100 : i * 100 + 300] for i in range(20)]
    pq.write_table(pa.table({"id": list(range(20)), "text": docs}), f)
    assert cal.documents(str(f)) == docs
    g = tmp_path / "other.parquet"
    pq.write_table(pa.table({"id": list(range(20)), "content": docs, "lang": ["en"] * 20}), g)
    with pytest.raises(CalibrationError, match="#COLUMN"):
        cal.documents(str(g))
    assert cal.documents(f"{g}#content") == docs


def test_hf_dataset_only_from_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pa = pytest.importorskip("pyarrow")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CalibrationError, match="not in the local cache"):
        cal.sample("hf:someone/corpus", 2, 32)
    d = tmp_path / "datasets" / "someone___corpus" / "default" / "0.0.0" / "abc123"
    d.mkdir(parents=True)
    docs = [TEXT[i * 80 : i * 80 + 500] for i in range(10)]
    table = pa.table({"text": docs})
    with pa.OSFile(str(d / "corpus-train.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    assert cal.documents("hf:someone/corpus") == docs
    assert all(t in TEXT for t in cal.sample("hf:someone/corpus", 3, 32, seed=2))
    with pytest.raises(CalibrationError, match="not in the local cache"):
        cal.documents("hf:someone/corpus@test")


# ---------------------------------------------------------------------- the hook


def _plugin(register_fn: Callable[[Callable[..., None]], None]) -> types.ModuleType:
    mod = types.ModuleType("calib_plugin")

    @anyquant.hookimpl
    def anyquant_register_calibration(register: Callable[..., None]) -> None:
        register_fn(register)

    mod.anyquant_register_calibration = anyquant_register_calibration  # type: ignore[attr-defined]
    return mod


def test_plugin_sources_through_the_hook() -> None:
    def loader(n: int, seq_len: int, seed: int) -> list[str]:
        return [f"plugin text {seed} {i} " * seq_len for i in range(n)]

    reg = anyquant.Registry(entry_points=False, plugins=[("myplug", _plugin(lambda r: r("mine", loader, "mine")))])
    found = cal.sources(reg)
    assert set(cal.CORPUS_NAMES) <= set(found) and found["mine"].origin == "myplug"
    texts = cal.sample("mine:1,tiny:1", 4, 8, seed=0, registry=reg)
    assert sum(t.startswith("plugin text") for t in texts) == 2


def test_plugin_cannot_take_a_builtin_name_or_return_junk(caplog: pytest.LogCaptureFixture) -> None:
    reg = anyquant.Registry(entry_points=False, plugins=[("p", _plugin(lambda r: r("wiki", lambda n, s, seed: [])))])
    assert cal.sources(reg)["wiki"].origin.startswith("anyquant")
    assert "already registered" in caplog.text
    bad = anyquant.Registry(entry_points=False, plugins=[("p", _plugin(lambda r: r("junk", lambda n, s, seed: ["x"])))])
    with pytest.raises(CalibrationError, match="junk"):
        cal.sample("junk", 3, 8, registry=bad)


# ---------------------------------------------------------------------- overlap guard


def test_guard_fires_on_copied_text(tmp_path: Path) -> None:
    evaluation = cal.evaluation_text("wiki")
    copied = tmp_path / "copied.txt"
    copied.write_text(evaluation[:50_000])
    with pytest.raises(CalibrationOverlapError, match=r"\d+\.\d+%") as info:
        cal.sample(str(copied), 16, 128, seed=0, evaluation=evaluation)
    assert "threshold" in str(info.value)
    # one copied sample in ten is enough
    mixed = cal.sample("c4", 9, 128, seed=0) + cal.sample(str(copied), 1, 128, seed=0)
    result = cal.overlap(mixed, evaluation)
    assert 0.05 < result.calibration_fraction < 0.2
    with pytest.raises(CalibrationOverlapError):
        cal.check_overlap(mixed, evaluation)


def test_guard_passes_disjoint_text() -> None:
    for name in ("wiki", "code", "tiny"):  # same corpus, held-out part: disjoint text of the same kind
        result = cal.check_overlap(cal.sample(name, 64, 256, seed=0), cal.evaluation_text(name))
        assert result.fraction < cal.DEFAULT_THRESHOLD / 2
    assert cal.overlap(cal.sample("c4", 32, 256), cal.evaluation_text("wiki")).shared == 0


def test_boilerplate_is_not_counted_as_copying() -> None:
    """A licence header shared by the code corpus's two parts is boilerplate, not contamination."""
    texts, evaluation = cal.sample("code", 16, 128, seed=3), cal.evaluation_text("code")
    raw = cal.overlap(texts, evaluation, ignore_common=False)
    assert raw.calibration_fraction > cal.DEFAULT_THRESHOLD  # 7.2%: a BSD licence header
    filtered = cal.check_overlap(texts, evaluation)
    assert filtered.fraction < cal.DEFAULT_THRESHOLD / 4 and filtered.ignored_common > 0


def test_overlap_counts() -> None:
    a = "one two three four five six seven eight nine ten"
    r = cal.overlap(a, a, n=8)
    assert (r.calibration_ngrams, r.evaluation_ngrams, r.shared, r.fraction) == (3, 3, 3, 1.0)
    r = cal.overlap(a, "ONE two, three four five six seven eight", n=8)  # case and punctuation do not matter
    assert (r.shared, r.evaluation_fraction) == (1, 1.0)


def test_sample_token_ids() -> None:
    from anyquant.testing.tiny import make_tokenizer

    rows = cal.sample_token_ids("wiki", make_tokenizer(), 3, 50, seed=0)
    assert [len(r) for r in rows] == [50, 50, 50]


# ---------------------------------------------------------------------- CLI


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    parser = build_parser()  # the tools' commands are anyquant-tools' plugin's
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    listed = _cli(["calibration", "list", "--json"], capsys)
    assert {s["name"] for s in listed["sources"]} >= set(cal.CORPUS_NAMES)
    one = _cli(
        ["calibration", "sample", "c4:0.5,wiki:0.5", "-n", "4", "--seq-len", "64", "--seed", "3", "--json"], capsys
    )
    assert one["texts"] == cal.sample("c4:0.5,wiki:0.5", 4, 64, 3)
    out = tmp_path / "cal.jsonl"
    _cli(["calibration", "sample", "tiny", "-n", "3", "--output", str(out), "--json"], capsys)
    assert len(out.read_text().splitlines()) == 3
    ok = _cli(["calibration", "check", "c4", "wiki", "-n", "8", "--json"], capsys)
    assert ok["refused"] is False
    evaluation = tmp_path / "eval.txt"
    evaluation.write_text(cal.evaluation_text("tiny"))
    parser = build_parser()  # the tools' commands are anyquant-tools' plugin's
    args = parser.parse_args(["calibration", "sample", str(evaluation), "-n", "4", "--against", str(evaluation)])
    with pytest.raises(CalibrationOverlapError):
        args.func(args)
