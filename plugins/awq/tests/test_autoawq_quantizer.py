"""anyquant.quantize(method="awq", quantizer_backend="autoawq"): AutoAWQ 0.2.9's own quantizer in
``anyquant_awq.autoawq_worker``. The result detects as AWQ GEMM, anyquant's reference backend decodes
it to exactly what AutoAWQ's ``dequantize_gemm`` gives (computed in a subprocess: ``import awq``
resets the warning filters of the process that imports it), and its logits stay close to the dense
model's. The checks anyquant runs first (shapes, calibration lengths, the package) need no AutoAWQ."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import anyquant
from anyquant.errors import QuantizeError
from anyquant.protocols import QuantizeSpec
from anyquant.testing.tiny import make_tiny_dense
from anyquant_awq.native import pseudo_quantize
from anyquant_awq.quantize import AWQQuantizer
from anyquant_tools.calibration import CalibrationError
from anyquant_tools.quantize import WorkerError

# byte-level tiny tokenizer: ~160 tokens per text, 16 texts -> 9 blocks of 256 tokens
TEXTS = [f"Sample {i}: the quick brown fox jumps over the lazy dog while the cat watches. " * 2 for i in range(16)]
SEQ_LEN = 256
GROUP = 32
#: max |logits - dense logits| / max |dense logits| on the skewed tiny model below, measured: AutoAWQ
#: 0.064 (zero_point) and 0.062 (symmetric); with its CPU scale-search bug unmended 0.53 / 0.50.
MAX_REL_LOGITS_ERROR = 0.15

ORACLE = r"""
import json, sys, warnings
from pathlib import Path
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from awq.utils.packing_utils import dequantize_gemm
except Exception as exc:
    print(json.dumps({"unavailable": repr(exc)}))
    sys.exit(77)
from safetensors.torch import load_file, save_file
ckpt = Path(sys.argv[1])
group = json.loads((ckpt / "config.json").read_text())["quantization_config"]["group_size"]
t = load_file(str(ckpt / "model.safetensors"))
out = {}
for name in t:
    if name.endswith(".qweight"):
        m = name.removesuffix(".qweight")
        out[m] = dequantize_gemm(t[name], t[m + ".qzeros"], t[m + ".scales"], 4, group).contiguous()
save_file(out, sys.argv[2])
"""


def _skip_without_autoawq() -> None:
    if importlib.util.find_spec("awq") is None:
        pytest.skip("autoawq is not installed (pip install autoawq==0.2.9)")


#: input columns of the linears behind each norm scaled by log-uniform factors in [1/4, 4] and the norm
#: divided by the same factors: the same function, but per-channel weight magnitudes as uneven as a
#: trained model's (a random model's are even, so AWQ's scales stay near 1 and hide scaling mistakes)
SKEWED = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_dense(tmp_path_factory.mktemp("src") / "tiny", dtype="float16")
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for layer in range(2):
        for norm, linears in SKEWED.items():
            pre = f"model.layers.{layer}."
            f = 4.0 ** (torch.rand(tensors[pre + norm + ".weight"].shape[0], generator=gen) * 2 - 1)
            tensors[pre + norm + ".weight"] = (tensors[pre + norm + ".weight"].float() / f).half()
            for lin in linears:
                tensors[pre + lin + ".weight"] = (tensors[pre + lin + ".weight"].float() * f).half()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["zero_point", "symmetric"])
def quantized(request: pytest.FixtureRequest, src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    _skip_without_autoawq()
    try:
        return anyquant.quantize(
            src,
            tmp_path_factory.mktemp("q") / "awq",
            method="awq",
            bits=4,
            group_size=GROUP,
            zero_point=request.param,
            calibration=TEXTS,
            calibration_seq_len=SEQ_LEN,
            quality=False,
            quantizer_backend="autoawq",
        )
    except WorkerError as exc:
        if "autoawq is not importable" in str(exc):
            pytest.skip(f"autoawq is installed but cannot be imported: {str(exc)[-300:]}")
        raise


@pytest.fixture
def pretend_autoawq(monkeypatch: pytest.MonkeyPatch) -> None:
    """find_spec("awq") answers as if AutoAWQ were installed (the checks before it need no AutoAWQ)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "awq" else real(name, *a))


@pytest.fixture
def no_worker(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """run_worker recorded, not run."""
    jobs: list[dict[str, Any]] = []
    monkeypatch.setattr(
        "anyquant_tools.quantize.run_worker", lambda module, job, **kw: jobs.append({**job, "module": module})
    )
    return jobs


# --------------------------------------------------------------------------- AutoAWQ end to end


@pytest.mark.slow
@pytest.mark.peer
def test_result_detects_as_awq_gemm(quantized: Path) -> None:
    d = anyquant.detect(quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    zero_point = cfg["quantization_config"]["zero_point"]
    assert (d.format, d.variant, d.details["group_size"], d.details["zero_point"]) == ("awq", "gemm", GROUP, zero_point)
    assert cfg["quantization_config"]["quantizer"] == "autoawq-0.2.9"
    assert cfg["use_cache"] is True  # AutoAWQ saves the use_cache=False it quantized with; restored
    assert (quantized / "tokenizer.json").is_file()  # save_quantized writes no tokenizer; copied


@pytest.mark.slow
@pytest.mark.peer
def test_reference_backend_equals_autoawq_dequantize_gemm(quantized: Path, tmp_path: Path) -> None:
    oracle = tmp_path / "oracle.safetensors"
    r = subprocess.run(
        [sys.executable, "-c", ORACLE, str(quantized), str(oracle)], capture_output=True, text=True, timeout=300
    )
    if r.returncode == 77:
        pytest.skip(f"autoawq cannot be imported: {r.stdout.strip()}")
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = load_file(oracle)  # {module: [in, out]}
    assert len(theirs) == 14  # 2 layers x 7 linears
    model = anyquant.load(quantized, backend="reference")
    for name, weight_in_out in theirs.items():
        got = model.module.get_submodule(name).dequantize()
        assert torch.equal(got, weight_in_out.t().to(got.dtype)), name


@pytest.mark.slow
@pytest.mark.peer
def test_logits_are_close_to_the_dense_models(quantized: Path, src: Path) -> None:
    ids = torch.tensor([list(range(40, 104))])
    dense = anyquant.load(src, dtype="float32")
    model = anyquant.load(quantized, backend="reference", dtype="float32")
    with torch.no_grad():
        want = dense.module(ids).logits.float()
        got = model.module(ids).logits.float()
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < MAX_REL_LOGITS_ERROR, f"max relative logit error {rel:.3g}"


@pytest.mark.slow
@pytest.mark.peer
def test_scaled_linears_keep_the_dense_function(quantized: Path, src: Path) -> None:
    """Behind each norm AWQ stores ``Q(W * s)`` and the norm divided by ``s``: their product must stay
    as close to the dense ``W * norm`` as plain round-to-nearest of ``W`` is. AutoAWQ's scale search
    on a CPU, unmended, leaves ``Q(W * s0 * s)`` (see ``anyquant_awq.autoawq_worker``): measured
    round-to-nearest's error on this model (3.8x), 0.2-0.6x with the worker's fix."""
    dense = load_file(src / "model.safetensors")
    model = anyquant.load(quantized, backend="reference", dtype="float32").module
    group = json.loads((quantized / "config.json").read_text())["quantization_config"]["group_size"]
    for layer in range(2):
        for norm, linears in SKEWED.items():
            n_dense = dense[f"model.layers.{layer}.{norm}.weight"].float()
            n_quant = model.get_submodule(f"model.layers.{layer}.{norm}").weight.float()
            for lin in linears:
                w = dense[f"model.layers.{layer}.{lin}.weight"].float()
                want = w * n_dense
                got = model.get_submodule(f"model.layers.{layer}.{lin}").dequantize().float() * n_quant
                err = float((got - want).norm() / want.norm())
                rtn = float((pseudo_quantize(w, group) * n_dense - want).norm() / want.norm())
                assert err < 2 * rtn, f"layer {layer} {lin}: {err:.3f} vs round-to-nearest {rtn:.3f}"


# --------------------------------------------------------------------------- checks before any work


def test_out_features_not_a_multiple_of_64_fails_before_any_work(
    tmp_path: Path, no_worker: list[dict[str, Any]]
) -> None:
    src = make_tiny_dense(tmp_path / "src", dtype="float16", intermediate_size=160)  # gate/up: 160 outputs
    with pytest.raises(QuantizeError, match=r"mlp\.gate_proj has out_features=160, not a multiple of 64"):
        anyquant.quantize(
            src, tmp_path / "out" / "o", method="awq", group_size=GROUP, calibration=TEXTS, quantizer_backend="autoawq"
        )
    assert not (tmp_path / "out").exists() and not no_worker


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantizer_backend": "AutoAWQ"}, "is not one of"),
        ({"quantizer_backend": "autoawq", "group_size": -1}, "positive group_size"),
        ({"quantizer_backend": "autoawq", "dtype": "bfloat16"}, "float16 only"),
        ({"quantizer_backend": "autoawq", "calibration_seq_len": 64}, "longer than calibration_seq_len=64"),
        ({"quantizer_backend": "autoawq", "calibration": ["short", "texts"]}, "needs at least one"),
    ],
)
@pytest.mark.usefixtures("pretend_autoawq")
def test_bad_options_fail_before_any_work(
    src: Path, tmp_path: Path, no_worker: list[dict[str, Any]], options: dict[str, Any], message: str
) -> None:
    kwargs = {"group_size": GROUP, "calibration": TEXTS, "calibration_seq_len": SEQ_LEN, **options}
    with pytest.raises(QuantizeError, match=message):
        anyquant.quantize(src, tmp_path / "o", method="awq", **kwargs)
    assert not list(tmp_path.iterdir()) and not no_worker


def test_missing_autoawq_names_the_pip_requirement(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_worker: list[dict[str, Any]]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "awq" else real(name, *a))
    with pytest.raises(QuantizeError, match=r"pip install autoawq==0\.2\.9"):
        anyquant.quantize(
            src, tmp_path / "o", method="awq", group_size=GROUP, calibration=TEXTS, quantizer_backend="autoawq"
        )
    assert not list(tmp_path.iterdir()) and not no_worker


def test_job_maps_the_spec_and_warns_about_the_deprecation(
    src: Path, tmp_path: Path, no_worker: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    spec = QuantizeSpec(
        "awq",
        group_size=64,
        calibration_samples=5,
        calibration_seq_len=SEQ_LEN,
        options={"quantizer_backend": "autoawq", "texts": TEXTS, "zero_point": False, "apply_clip": False},
    )
    with caplog.at_level(logging.WARNING, logger="anyquant_awq.quantize"):
        out = AWQQuantizer().quantize(src, tmp_path, spec)
    assert "deprecated upstream" in caplog.text
    (job,) = no_worker
    assert job["module"] == "anyquant_awq.autoawq_worker" and Path(job["dst"]) == out.resolve()
    assert (job["bits"], job["group_size"], job["zero_point"], job["apply_clip"]) == (4, 64, False, False)
    assert (job["max_calib_samples"], job["max_calib_seq_len"]) == (5, SEQ_LEN)
    assert json.loads(Path(job["calibration_file"]).read_text()) == TEXTS[:5]  # AutoAWQ stops after 5 anyway


def test_sampled_calibration_is_cut_to_fit(src: Path, tmp_path: Path, no_worker: list[dict[str, Any]]) -> None:
    """Texts anyquant samples are ~seq_len tokens, some longer: cut at a token boundary, never dropped."""
    from transformers import AutoTokenizer

    spec = QuantizeSpec(
        "awq",
        group_size=GROUP,
        calibration="wiki",
        calibration_samples=4,
        calibration_seq_len=128,
        options={"quantizer_backend": "autoawq"},
    )
    try:
        AWQQuantizer().quantize(src, tmp_path, spec)
    except CalibrationError as exc:
        pytest.skip(f"the bundled calibration corpus is not installed: {exc}")
    texts = json.loads(Path(no_worker[0]["calibration_file"]).read_text())
    tok = AutoTokenizer.from_pretrained(src)
    lengths = [len(tok.encode(t.strip())) for t in texts]
    assert len(texts) == 4 and all(100 <= n <= 128 for n in lengths), lengths


def test_auto_never_picks_autoawq() -> None:
    assert AWQQuantizer().backend(QuantizeSpec("awq")) in ("anyquant", "gptqmodel")
    assert AWQQuantizer().backend(QuantizeSpec("awq", options={"quantizer_backend": "autoawq"})) == "autoawq"
