"""anyquant.quantize(method="awq") with both quantizers, GPTQModel's AWQ (GEMM, fp16) in the shared
worker and anyquant's own: the result loads in anyquant and in transformers (+ gptqmodel on CPU)
with the same greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import anyquant
from anyquant.errors import QuantizeError
from anyquant.testing.tiny import make_tiny_dense

pytestmark = pytest.mark.peer

TEXTS = [f"Sample {i}: the quick brown fox jumps over the lazy dog while the cat watches. " * 6 for i in range(16)]
PROMPT = [72, 101, 108, 108, 111, 44, 32, 109]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dense(tmp_path_factory.mktemp("src") / "tiny", dtype="float16")


@pytest.fixture(scope="module", params=["gptqmodel", "anyquant"])
def quantized(request: pytest.FixtureRequest, src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "gptqmodel":
        pytest.importorskip("gptqmodel")
    return anyquant.quantize(
        src,
        tmp_path_factory.mktemp("q") / "awq",
        method="awq",
        bits=4,
        group_size=32,
        zero_point=True,
        calibration=TEXTS,
        quantizer_backend=request.param,
    )


def test_result_is_awq_gemm_with_zero_points(quantized: Path) -> None:
    d = anyquant.detect(quantized)
    assert (d.format, d.variant, d.details["group_size"], d.details["zero_point"]) == ("awq", "gemm", 32, True)
    assert json.loads((quantized / "anyquant_quality.json").read_text())["ratio"] <= 3.0


def test_transformers_loads_it_with_the_same_greedy_tokens(quantized: Path) -> None:
    worker = Path(__file__).resolve().parents[3] / "tests" / "peers" / "hf_generate_worker.py"
    r = subprocess.run(
        [sys.executable, str(worker), str(quantized), json.dumps(PROMPT), "8", "float16"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TORCH_COMPILE_DISABLE": "1", "GPTQMODEL_CPU_WORKERS": "2"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    model = anyquant.load(quantized, dtype="float16", backend="dequantized")
    assert model.generator.generate_ids(PROMPT, model.params(max_new_tokens=8)) == theirs["tokens"]


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"bits": 3}, "bits=3"), ({"version": "gemv"}, "GEMM"), ({"dtype": "float32"}, "float16")]
)
def test_bad_parameters_fail_early(src: Path, tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(QuantizeError, match=message):
        anyquant.quantize(src, tmp_path / "o", method="awq", calibration=TEXTS, group_size=32, **kwargs)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantizer_backend": "gptqmodel", "n_grid": 10}, r"'gptqmodel' does not read \['n_grid'\] .*'anyquant' does"),
        (
            {"quantizer_backend": "gptqmodel", "apply_clip": False},
            r"does not read \['apply_clip'\] \(quantizer_backend 'anyquant' or 'autoawq' does\)",
        ),
        ({"quantizer_backend": "autoawq", "n_grid": 10}, r"'autoawq' does not read \['n_grid'\]"),
        ({"dynamic": {"-:.*down_proj": {}}}, "dynamic= is GPTQ's per-module override"),
        ({"desc_act": True}, "AWQ has no act-order"),  # GPTQ's per-module overrides: no AWQ quantizer applies them
    ],
)
def test_options_the_quantizer_does_not_read_are_refused(src: Path, tmp_path: Path, kwargs: dict, message: str) -> None:
    """Before, GPTQModel's AWQ ran without n_grid / duo_scaling / apply_clip, and every AWQ quantizer without
    ``dynamic``, silently."""
    with pytest.raises(QuantizeError, match=message):
        anyquant.quantize(src, tmp_path / "o", method="awq", calibration=TEXTS, group_size=32, **kwargs)
    assert not list(tmp_path.iterdir())


def test_auto_picks_the_quantizer_that_reads_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from anyquant.protocols import QuantizeSpec
    from anyquant_awq import quantize as awq_quantize

    def spec(**options: object) -> QuantizeSpec:
        return QuantizeSpec(method="awq", bits=4, options=options)

    q = awq_quantize.AWQQuantizer()
    for cuda, default in ((True, "gptqmodel"), (False, "anyquant")):
        monkeypatch.setattr(awq_quantize, "_cuda_visible", lambda cuda=cuda: cuda)
        assert q.backend(spec()) == default
        assert q.backend(spec(batch_size=2)) == default  # read by every AWQ quantizer
        assert q.backend(spec(n_grid=10)) == "anyquant"  # on CUDA too: GPTQModel's AWQ has no grid option
        assert q.backend(spec(duo_scaling=False)) == "anyquant"  # "auto" never picks AutoAWQ
        assert q.backend(spec(quantizer_backend="autoawq", apply_clip=False)) == "autoawq"
