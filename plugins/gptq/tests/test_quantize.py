"""anyquant.quantize(method="gptq"): GPTQModel in a worker, atomic output, early validation, and a
checkpoint that transformers (+ gptqmodel/optimum on CPU) loads with the same greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import anyquant
from anyquant.errors import QuantizeError
from anyquant.testing.tiny import make_tiny_dense

pytestmark = pytest.mark.peer

TEXTS = [f"Sample {i}: the quick brown fox jumps over the lazy dog while the cat watches. " * 6 for i in range(16)]
PROMPT = [72, 101, 108, 108, 111, 44, 32, 109]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dense(tmp_path_factory.mktemp("src") / "tiny", dtype="float16")


@pytest.fixture(scope="module")
def quantized(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gptqmodel")
    stages: list[str] = []
    out = anyquant.quantize(
        src,
        tmp_path_factory.mktemp("q") / "gptq",
        method="gptq",
        bits=4,
        group_size=32,
        calibration=TEXTS,
        progress=lambda stage, frac: stages.append(stage),
    )
    assert stages[-1] == "done" and "checking the result" in stages
    return out


def test_result_detects_and_passed_the_quality_gate(quantized: Path) -> None:
    d = anyquant.detect(quantized)
    assert (d.format, d.variant, d.details["bits"], d.details["group_size"]) == ("gptq", "v1", 4, 32)
    quality = json.loads((quantized / "anyquant_quality.json").read_text())
    assert quality["ratio"] <= 3.0 and quality["tokens"] > 100
    assert not [p for p in quantized.parent.iterdir() if p.name.startswith(".")], "temporary directory left behind"


def test_transformers_loads_it_with_the_same_greedy_tokens(quantized: Path) -> None:
    worker = Path(__file__).resolve().parents[3] / "tests" / "peers" / "hf_generate_worker.py"
    env_cmd = [sys.executable, str(worker), str(quantized), json.dumps(PROMPT), "8", "float16"]
    r = subprocess.run(
        env_cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "TORCH_COMPILE_DISABLE": "1", "GPTQMODEL_CPU_WORKERS": "2"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    model = anyquant.load(quantized, dtype="float16", backend="dequantized")
    ours = model.generator.generate_ids(PROMPT, model.params(max_new_tokens=8))
    assert ours == theirs["tokens"]
    with torch.no_grad():
        logits = model.module(torch.tensor([PROMPT])).logits[0, -1].float()
    ref = torch.tensor(theirs["logits"])
    assert (logits - ref).abs().max() / ref.abs().max() < 1e-2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 5}, "bits=5"),
        ({"group_size": 48}, "does not divide"),
        ({"group_size": 0}, "group_size"),
        ({"format": "marlin"}, "format"),
    ],
)
def test_bad_parameters_fail_before_any_work(src: Path, tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(QuantizeError, match=message):
        anyquant.quantize(src, tmp_path / "out", method="gptq", calibration=TEXTS, **kwargs)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_paths_are_checked(src: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match="inside the source"):
        anyquant.quantize(src, src / "inner", method="gptq", calibration=TEXTS)
    with pytest.raises(QuantizeError, match="does not exist"):
        anyquant.quantize(tmp_path / "missing", tmp_path / "o", method="gptq", calibration=TEXTS)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(QuantizeError, match="overwrite=True"):
        anyquant.quantize(src, tmp_path / "busy", method="gptq", calibration=TEXTS)
    assert (tmp_path / "busy" / "keep.txt").read_text() == "x"


def test_quantized_source_is_refused(quantized: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match="not a dense checkpoint"):
        anyquant.quantize(quantized, tmp_path / "o", method="gptq", calibration=TEXTS)


def test_worker_failure_leaves_nothing(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from anyquant_gptq.quantize import GPTQQuantizer
    from anyquant_tools._staging import _host_tag

    job = GPTQQuantizer.job  # a dtype the worker cannot use, past validate (which refuses it now)
    monkeypatch.setattr(GPTQQuantizer, "job", lambda self, *a: {**job(self, *a), "dtype": "no_such_dtype"})

    # and removes what a killed run (SIGKILL: no cleanup) left beside the same destination
    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    (tmp_path / f".o.anyquant-{_host_tag()}-{pid}-killed" / "model").mkdir(parents=True)
    with pytest.raises(QuantizeError, match="exited with code"):  # the worker dies after it started
        anyquant.quantize(src, tmp_path / "o", method="gptq", calibration=TEXTS, group_size=32)
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_quality_gate_rejects_a_broken_result(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A result far worse than its source is an error, never an output: the quantizer's output is
    broken on purpose before the gate runs (its head x 40: confident, wrong predictions; on a random
    tiny Llama the RMSNorms absorb broken layer scales, so the head is what moves perplexity)."""
    from safetensors.torch import load_file, save_file

    from anyquant_gptq.quantize import GPTQQuantizer

    original = GPTQQuantizer.quantize

    def broken(self, src_, dst_, spec, progress=None):  # type: ignore[no-untyped-def]
        out = original(self, src_, dst_, spec, progress)
        tensors = load_file(out / "model.safetensors")
        tensors["lm_head.weight"] = tensors["lm_head.weight"] * 40
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return out

    monkeypatch.setattr(GPTQQuantizer, "quantize", broken)
    with pytest.raises(QuantizeError, match="far worse"):
        anyquant.quantize(src, tmp_path / "o", method="gptq", bits=4, group_size=32, calibration=TEXTS)
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_calibration_texts_are_cut_to_seq_len_tokens(tmp_path: Path) -> None:
    """Samples are drawn by characters and GPTQModel trims only to the context: a 512-token request gave
    2,047 tokens per text with a byte-level tokenizer."""
    from anyquant.testing.tiny import make_tiny_dense
    from anyquant_runtime.tokenizer import load_tokenizer
    from anyquant_tools.gptqmodel_quantizer import _cut_to_tokens

    src = make_tiny_dense(tmp_path / "m")
    tok = load_tokenizer(anyquant.Probe.open(src))
    texts = ["short", "word " * 400]
    cut = _cut_to_tokens(src, texts, 64)
    assert cut[0] == "short" and cut[1] != texts[1] and texts[1].startswith(cut[1])
    assert [len(tok(t, add_special_tokens=False)["input_ids"]) for t in cut] == [5, 64]
