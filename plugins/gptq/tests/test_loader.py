"""anyquant.load on checkpoints GPTQModel made (tiny Llama, 16 variants): GPTQModel is the judge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import anyquant
from tests.peers.catalog import GPTQ_QUANT_VARIANTS, gptqmodel_gptq_quantized_dir

pytestmark = pytest.mark.peer

VARIANTS = [v["name"] for v in GPTQ_QUANT_VARIANTS]


@pytest.fixture(scope="module")
def root() -> Path:
    return gptqmodel_gptq_quantized_dir()


@pytest.mark.parametrize("variant", VARIANTS)
def test_detect(root: Path, variant: str) -> None:
    spec = next(v for v in GPTQ_QUANT_VARIANTS if v["name"] == variant)
    d = anyquant.detect(root / "quantized" / variant)
    assert d.format == "gptq"
    assert d.variant == {"gptq": "v1", "gptq_v2": "v2"}[spec["format"]]
    assert d.details["bits_from_shapes"] == [spec["bits"]]


@pytest.mark.parametrize("backend", ["reference", "dequantized"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_weights_and_logits_match_gptqmodel(root: Path, variant: str, backend: str) -> None:
    """Weights bit-exact; fp32 logits within 1e-3 of GPTQModel's fp16 CPU forward."""
    path = root / "quantized" / variant
    model = anyquant.load(path, backend=backend)
    assert model.backend == backend and model.dtype == "float32"
    theirs = load_file(root / "judges" / variant / "gptqmodel_dequant.safetensors")
    modules = dict(model.module.named_modules())
    for key, weight_in_out in theirs.items():
        ours = modules[key.removesuffix(".weight")]
        if backend == "reference":
            assert torch.equal(ours.dequantize(), weight_in_out.t().contiguous()), key
        else:  # cached in fp32: the fp16 values, exactly
            assert torch.equal(ours._weight, weight_in_out.t().float()), key
    ref = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")
    with torch.no_grad():
        logits = model.module(ref["input_ids"]).logits
    rel = (logits - ref["logits"].float()).abs().max() / ref["logits"].float().abs().max()
    assert rel < 1e-3, f"max relative logit difference {rel:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp16_logits_within_rounding_and_greedy_tokens_identical(root: Path, variant: str) -> None:
    """In GPTQModel's own dtype (fp16) the logits agree to fp16 rounding (bitwise on CPUs where both sides'
    fp16 GEMMs sum alike, as on an AMX Xeon; 5e-4 to 8e-4 apart on an AMD EPYC, where GPTQModel's
    ``matmul(x, W)`` and anyquant's ``linear(x, W.T)`` sum in other orders), and greedy decoding is identical.
    (In fp32 a near-tie can flip: b2_g32_asym_desc's top-2 gap is 0.005.)"""
    model = anyquant.load(root / "quantized" / variant, backend="dequantized", dtype="float16")
    ref = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")
    with torch.no_grad():
        got = model.module(ref["input_ids"]).logits.float()
    want = ref["logits"].to(torch.float16).float()
    assert (got - want).abs().max() / want.abs().max() < 2e-3
    tokens = ref["greedy_tokens"][0].tolist()
    prompt, want = tokens[:8], tokens[8:]
    assert model.generator.generate_ids(prompt, model.params(max_new_tokens=len(want))) == want


def test_mislabelled_checkpoint_trusts_the_tensors(root: Path, tmp_path: Path) -> None:
    import shutil

    src = root / "quantized" / "b4_g128_sym_nodesc_gptq"
    dst = tmp_path / "mislabelled"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq_v2"
    cfg["quantization_config"]["format"] = "gptq_v2"
    (dst / "config.json").write_text(json.dumps(cfg))
    if (dst / "quantize_config.json").exists():
        (dst / "quantize_config.json").unlink()
    model = anyquant.load(dst, backend="reference")
    theirs = load_file(root / "judges" / src.name / "gptqmodel_dequant.safetensors")
    key = next(iter(theirs))
    ours = dict(model.module.named_modules())[key.removesuffix(".weight")]
    assert ours.checkpoint_format == "gptq"
    assert torch.equal(ours.dequantize(), theirs[key].t().contiguous())


def test_asymmetric_v1_of_unknown_producer_is_refused(root: Path, tmp_path: Path) -> None:
    import shutil

    src = root / "quantized" / "b4_g32_asym_desc_gptq"
    dst = tmp_path / "unknown"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].pop("meta", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    if (dst / "quantize_config.json").exists():
        (dst / "quantize_config.json").unlink()
    with pytest.raises(anyquant.CheckpointError, match="refuses to guess"):
        anyquant.load(dst)


def test_inspect_reports_bits_and_groups(root: Path) -> None:
    report = anyquant.inspect(root / "quantized" / "b4_g32_asym_desc_gptq")
    q = [m for m in report.modules if m.format == "gptq"]
    assert len(q) == 14 and {m.bits for m in q} == {4.0} and {m.group_size for m in q} == {32}
    assert 4.0 < report.totals["avg_bits_quantized"] < 6.0


def _copy(root: Path, tmp_path: Path, variant: str, name: str) -> Path:
    import shutil

    dst = tmp_path / name
    shutil.copytree(root / "quantized" / variant, dst)
    return dst


def test_reference_backend_checks_the_packed_tensors_at_load(root: Path, tmp_path: Path) -> None:
    """The reference backend decodes on every forward; a g_idx past its groups used to load and fail at the
    first forward with a bare ValueError. Now each layer is decoded once at load and dropped."""
    from safetensors.torch import save_file

    dst = _copy(root, tmp_path, "b4_g32_asym_desc_gptq", "gidx")
    (weights,) = dst.glob("*.safetensors")
    t = load_file(weights)
    t["model.layers.0.self_attn.q_proj.g_idx"][5] = 99
    save_file(t, weights, metadata={"format": "pt"})
    with pytest.raises(anyquant.CheckpointError, match=r"g_idx values must lie in \[0, \d+\)"):
        anyquant.load(dst, backend="reference")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"meta": {"quantizer": 5}}, "refuses to guess"),  # names no producer: asymmetric v1 is refused as without meta
        ({"dynamic": {"x": 5}}, "dynamic must map module patterns to objects"),
    ],
)
def test_malformed_quantization_config_is_a_checkpoint_error(
    root: Path, tmp_path: Path, change: dict, message: str
) -> None:
    """Both made the GPTQ detect hook raise a TypeError: the load said the tensors did not match GPTQ's
    signature, and `anyquant plugins` showed the plugin as broken."""
    dst = _copy(root, tmp_path, "b4_g32_asym_desc_gptq", "cfg")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (dst / "config.json").write_text(json.dumps(cfg))
    if (dst / "quantize_config.json").exists():
        (dst / "quantize_config.json").unlink()
    with pytest.raises(anyquant.CheckpointError, match=message):
        anyquant.load(dst)
    assert not [p for p in anyquant.list_plugins() if p.error and p.name == "anyquant-gptq"]
    assert anyquant.detect(root / "quantized" / "b4_g32_asym_desc_gptq").format == "gptq"


@pytest.mark.parametrize("backend", ["auto", "reference", "dequantized"])
@pytest.mark.parametrize(
    ("bias", "what"), [(torch.zeros(3), r"float32\[3\]"), (torch.zeros(128, dtype=torch.int32), "int32")]
)
def test_a_bias_that_does_not_fit_its_layer_fails_at_load(
    root: Path, tmp_path: Path, backend: str, bias: torch.Tensor, what: str
) -> None:
    """Before, a quantized layer took any bias and the first forward failed on the shapes (or an integer
    bias was read as numbers)."""
    from safetensors.torch import save_file

    dst = _copy(root, tmp_path, "b4_g128_sym_nodesc_gptq", "bias")
    (weights,) = dst.glob("*.safetensors")
    t = load_file(weights)
    t["model.layers.0.self_attn.q_proj.bias"] = bias
    save_file(t, weights, metadata={"format": "pt"})
    with pytest.raises(anyquant.CheckpointError, match=rf"model.layers.0.self_attn.q_proj: a bias of {what}"):
        anyquant.load(dst, backend=backend)
