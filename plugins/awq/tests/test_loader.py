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
