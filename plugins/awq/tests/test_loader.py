"""anyquant.load on AWQ checkpoints GPTQModel made (tiny Llama, GEMM g32 zero-point and g64 symmetric)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import anyquant
from tests.peers.catalog import GPTQMODEL_AWQ_VARIANTS, gptqmodel_awq_quantized_dir

pytestmark = pytest.mark.peer

VARIANTS = [v["name"] for v in GPTQMODEL_AWQ_VARIANTS]


@pytest.fixture(scope="module")
def root() -> Path:
    return gptqmodel_awq_quantized_dir()


@pytest.mark.parametrize("variant", VARIANTS)
def test_detect(root: Path, variant: str) -> None:
    d = anyquant.detect(root / "quantized" / variant)
    assert (d.format, d.variant) == ("awq", "gemm")


@pytest.mark.parametrize("backend", ["reference", "dequantized"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_weights_and_logits_match_gptqmodel(root: Path, variant: str, backend: str) -> None:
    model = anyquant.load(root / "quantized" / variant, backend=backend)
    theirs = load_file(root / "judges" / variant / "gptqmodel_dequant.safetensors")
    modules = dict(model.module.named_modules())
    for key, weight_in_out in theirs.items():
        ours = modules[key.removesuffix(".weight")]
        got = ours.dequantize() if backend == "reference" else ours._weight
        assert torch.equal(got, weight_in_out.t().to(got.dtype)), key
    ref = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")
    with torch.no_grad():
        logits = model.module(ref["input_ids"]).logits
    rel = (logits - ref["logits"].float()).abs().max() / ref["logits"].float().abs().max()
    assert rel < 1e-3, f"max relative logit difference {rel:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp16_greedy_tokens_identical(root: Path, variant: str) -> None:
    model = anyquant.load(root / "quantized" / variant, backend="dequantized", dtype="float16")
    ref = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")
    with torch.no_grad():
        logits = model.module(ref["input_ids"]).logits.float()
    rel = (logits - ref["logits"].float()).abs().max() / ref["logits"].float().abs().max()
    assert rel < 1e-3
    tokens = ref["greedy_tokens"][0].tolist()
    assert model.generator.generate_ids(tokens[:8], model.params(max_new_tokens=8)) == tokens[8:]


def test_gptq_tensors_under_an_awq_label_conflict(root: Path, tmp_path: Path) -> None:
    import json
    import shutil

    from tests.peers.catalog import gptqmodel_gptq_quantized_dir

    src = gptqmodel_gptq_quantized_dir() / "quantized" / "b4_g128_sym_nodesc_gptq"
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "quantize_config.json").unlink(missing_ok=True)
    with pytest.raises(anyquant.FormatConflictError, match="gptq"):
        anyquant.load(dst)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"group_size": "x"}, anyquant.ConfigError, "group_size='x': expected an integer"),  # was a bare ValueError
        ({"group_size": 32.7}, anyquant.ConfigError, "group_size=32.7: expected an integer"),  # was read as 32
        ({"group_size": 0}, anyquant.ConfigError, "group_size=0: expected -1"),
        (
            {"group_size": -1},
            anyquant.CheckpointError,
            "scale groups do not match group_size=-1",
        ),  # was a forward error
        ({"bits": True}, anyquant.ConfigError, "bits=True: expected an integer"),
    ],
)
def test_bad_quantization_config_values_fail_at_load(
    root: Path, tmp_path: Path, change: dict, error: type, message: str
) -> None:
    import json
    import shutil

    dst = tmp_path / "m"
    shutil.copytree(root / "quantized" / VARIANTS[0], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "quantize_config.json").unlink(missing_ok=True)
    with pytest.raises(error, match=message):
        anyquant.load(dst, backend="reference")


def test_reference_backend_checks_the_packed_tensors_at_load(root: Path, tmp_path: Path) -> None:
    """qzeros with fewer groups than scales loaded under the reference backend and failed at the first
    forward with a bare ValueError; each layer is now decoded once at load."""
    import shutil

    from safetensors.torch import save_file

    dst = tmp_path / "m"
    shutil.copytree(root / "quantized" / VARIANTS[0], dst)
    (weights,) = dst.glob("*.safetensors")
    t = load_file(weights)
    key = "model.layers.0.self_attn.q_proj.qzeros"
    t[key] = t[key][:2].clone()
    save_file(t, weights, metadata={"format": "pt"})
    with pytest.raises(anyquant.CheckpointError, match="qweight / qzeros / scales shapes do not agree"):
        anyquant.load(dst, backend="reference")
