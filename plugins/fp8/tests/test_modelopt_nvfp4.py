"""NVIDIA ModelOpt NVFP4 checkpoints (``quant_algo: NVFP4``, what nvidia/*-FP4 repositories ship), quantized and
exported by ModelOpt 0.47.0 itself on a CPU (``make_modelopt_fixtures.py``: ``mtq.quantize`` with ``NVFP4_DEFAULT_CFG``,
max calibration, + ``export_hf_checkpoint``): a Llama with an excluded decoder linear, a Qwen3, and a Llama whose MLP
linears ModelOpt quantized to FP8 instead (its export writes ``MIXED_PRECISION`` with ``quantized_layers``).

Judges, recorded in ModelOpt's venv:

- weights: ModelOpt's own decompression of the exported tensors (``NVFP4QTensor.dequantize``:
  ``E2M1[code] * (float32(weight_scale) * weight_scale_2)`` in float32), bit-exact (sha256 of the float32 values);
  live as well where modelopt imports (not in the test venv);
- logits: the checkpoint as vLLM runs it where the GPU has no FP4 (``logits_float32_vllm_emulation``): ModelOpt's
  model with the exported weights put back (ModelOpt's dequantization) and every NVFP4 linear's input quantized as
  vLLM's NVFP4 emulation does (global scale ``1 / input_scale``, an E4M3 scale per 16 inputs, E2M1 values; written
  out in the fixture script, vLLM is not installed there; ``MIXED_PRECISION``'s FP8 linears' inputs as vLLM's
  ``QuantFP8`` with the static ``input_scale``) -- within :data:`EMULATED_TOL`, greedy tokens identical;
  cpu-fast within :data:`FAST_TOL`, greedy identical or a near-tie. ModelOpt's own fake-quantized forward is not
  recorded: ModelOpt 0.47's NVFP4 fake quantizer runs on CUDA only ("amax must be a CUDA tensor for dynamic block
  quantization"). The same model with 16-bit inputs (``logits_float32_exported_weights``) is 0.37-0.47 of the largest
  logit away on these random tiny models: FP4 activations are coarse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant as sdk
from anyquant.errors import CheckpointError, ConfigError, FormatConflictError, UnsupportedFormatError
from anyquant_runtime.activations import quantize_nvfp4_activations
from plugins.fp8.tests.test_modelopt_fixtures import (
    FIXTURES,
    _copy,
    _edit_tensors,
    check_cpu_fast_default,
    check_hf_quant_config_alone,
    record,
)
from tests.peers.recorded import forward_logits, greedy_tokens, rel_error, sha256_f32

NAMES = ("llama_modelopt_nvfp4", "qwen3_modelopt_nvfp4", "llama_modelopt_mixed")
VARIANTS = {"llama_modelopt_nvfp4": "modelopt-nvfp4", "qwen3_modelopt_nvfp4": "modelopt-nvfp4"}
VARIANTS["llama_modelopt_mixed"] = "modelopt-mixed"
#: of the largest logit: the vLLM-emulation forward recorded in ModelOpt's venv (measured 0 on both)
EMULATED_TOL = 1e-5
#: cpu-fast (the codes on the 4-bit table kernel, float32 group scales, NVFP4 inputs in front): of the largest logit
#: (measured 6.3e-3 and 6.6e-3)
FAST_TOL = 3e-2
#: the 16-bit-input forward is this far at least (a test that NVFP4 inputs are applied at all)
W4A16_AT_LEAST = 0.1


def _set_algo(path: Path, algo: str, **extra: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(quant_algo=algo, **extra)
    (path / "config.json").write_text(json.dumps(cfg))
    hq = json.loads((path / "hf_quant_config.json").read_text())
    hq["quantization"].update(quant_algo=algo, **extra)
    (path / "hf_quant_config.json").write_text(json.dumps(hq))


# ---------------------------------------------------------------------------------------------------- detection


@pytest.mark.parametrize("name", NAMES)
def test_detect_names_the_variant(name: str) -> None:
    rec = record(name)
    det = sdk.detect(FIXTURES / name)
    assert det.format == "fp8" and det.variant == VARIANTS[name]
    assert det.details["quant_algo"] == rec["quant_algo"] and det.details["group_size"] == 16
    assert det.details["producer"] == "modelopt 0.47.0" and not det.details["problems"]
    assert det.details["modules"] == len(rec["dequantized_weights"])
    assert any(rec["quant_algo"] in e for e in det.evidence)
    assert any("U8 weight" in e and "weight_scale_2" in e and "input_scale" in e for e in det.evidence)
    rows = {r.name: r for r in sdk.inspect(FIXTURES / name).modules}
    q = rows["model.layers.0.self_attn.q_proj"]
    assert q.format == "modelopt-nvfp4" and q.bits == 4.0 and q.group_size == 16
    assert rows["lm_head"].format not in ("modelopt-nvfp4", "modelopt-fp8")
    fp8 = [r for r in rows.values() if r.format == "modelopt-fp8"]
    if name == "llama_modelopt_mixed":  # the MLP linears are FP8 (8 bits), the attention's NVFP4
        assert len(fp8) == 6 and all(".mlp." in r.name and r.bits == 8.0 for r in fp8)
        assert det.details["quantized_layers"] == {"FP8": 6, "NVFP4": 8}
    else:
        assert not fp8


def test_excluded_linear_stays_dense() -> None:
    det = sdk.detect(FIXTURES / "llama_modelopt_nvfp4")
    assert "model.layers.1.mlp.down_proj" in det.details["exclude_modules"]
    model = sdk.load(FIXTURES / "llama_modelopt_nvfp4", backend="reference")
    dense = model.module.get_submodule("model.layers.1.mlp.down_proj")
    assert not hasattr(dense, "dequantize")


def test_hf_quant_config_alone_is_enough(tmp_path: Path) -> None:
    check_hf_quant_config_alone(tmp_path, "llama_modelopt_nvfp4", "modelopt-nvfp4", "vllm_emulation", EMULATED_TOL)


# ---------------------------------------------------------------------------------------------------- weights, logits


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["reference", "dequantized"])
def test_exact_backends_are_modelopt_and_vllm(name: str, backend: str) -> None:
    rec = record(name)
    model = sdk.load(FIXTURES / name, backend=backend)
    assert len(rec["dequantized_weights"]) >= 13
    for wname, w in rec["dequantized_weights"].items():
        dq = model.module.get_submodule(wname.removesuffix(".weight")).dequantize()
        assert dq.dtype == torch.float32 and list(dq.shape) == w["shape"], wname
        assert sha256_f32(dq) == w["sha256"], wname
    logits = forward_logits(model, rec["prompt_ids"])
    assert rel_error(logits, torch.tensor(rec["logits_float32_vllm_emulation"])) <= EMULATED_TOL
    assert rel_error(logits, torch.tensor(rec["logits_float32_exported_weights"])) >= W4A16_AT_LEAST
    assert greedy_tokens(model, rec["prompt_ids"], 8) == rec["greedy_float32_vllm_emulation"]


@pytest.mark.parametrize("name", NAMES)
def test_cpu_fast_default(name: str) -> None:
    model = check_cpu_fast_default(name, "vllm_emulation", EMULATED_TOL, FAST_TOL)
    if model.backend == "cpu-fast":
        q = model.module.get_submodule("model.layers.0.self_attn.q_proj")
        assert "nvfp4" in repr(q)  # the input quantization in front of the fast module


def test_live_modelopt_dequantize() -> None:
    """Where ModelOpt imports (its own venv; not the test venv), its ``NVFP4QTensor.dequantize`` of every exported
    weight equals the plugin's :func:`~anyquant_fp8.qlinear.dequantize_nvfp4`, bit for bit (model-free)."""
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    from safetensors.torch import load_file

    from anyquant_fp8.qlinear import dequantize_nvfp4

    for name in NAMES:
        sd = load_file(FIXTURES / name / "model.safetensors")
        for wname in record(name)["dequantized_weights"]:
            p = wname.removesuffix(".weight")
            if sd[wname].dtype != torch.uint8:  # MIXED_PRECISION's FP8 linears: test_modelopt_fixtures.py's kind
                continue
            w, s, s2 = sd[wname], sd[f"{p}.weight_scale"], sd[f"{p}.weight_scale_2"]
            qt = qtensor.NVFP4QTensor(torch.Size((w.shape[0], 2 * w.shape[1])), torch.float32, w)
            want = qt.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16})
            assert torch.equal(dequantize_nvfp4(w, s, s2, 16), want), p


def test_input_quantization_known_values() -> None:
    """vLLM's NVFP4 emulation of one group of 16 by hand: global scale ``g``, ``s = e4m3(g * max|x| / 6)``, values
    ``E2M1(x * (1 / (s * (1 / g))))`` (ties 0.25, 1.25, 2.5 down; 0.75, 1.75, 3.5 up), back times ``s / g``."""
    x = torch.tensor([6.0, -3.2, 1.3, 0.25, 0.75, 2.5, -5.1, 0.1, 1.75, 3.5, 4.9, -0.3, 0.0, 1.25, 2.6, -6.0])
    want = torch.tensor([6.0, -3.0, 1.5, 0.0, 1.0, 2.0, -6.0, 0.0, 2.0, 4.0, 4.0, -0.5, 0.0, 1.0, 3.0, -6.0])
    assert torch.equal(quantize_nvfp4_activations(x[None], torch.tensor(1.0))[0], want)
    # max 12 with g = 1: s = 2, every value halved before the rounding and doubled after
    assert torch.equal(quantize_nvfp4_activations(2 * x[None], torch.tensor(1.0))[0], 2 * want)
    # g = 1 / 0.01: s = e4m3(100 * 6 / 6) = 96 (the nearest E4M3 to 100), the step s / g = 0.96
    q = quantize_nvfp4_activations(torch.tensor([[6.0] + [0.0] * 15]), torch.tensor(100.0))
    assert float(q[0, 0]) == pytest.approx(6 * 96 / 100, rel=1e-6)


def test_reference_layer_is_the_gemm_of_quantized_inputs() -> None:
    model = sdk.load(FIXTURES / "llama_modelopt_nvfp4", backend="reference")
    layer = model.module.get_submodule("model.layers.0.mlp.down_proj")
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    g = 1.0 / torch.tensor(
        record("llama_modelopt_nvfp4")["tensors"]["model.layers.0.mlp.down_proj.input_scale"]["values"][0]
    )
    want = torch.nn.functional.linear(quantize_nvfp4_activations(x, g.to(torch.float32)), layer.dequantize())
    assert torch.equal(layer(x), want)
    assert not torch.equal(layer(x), torch.nn.functional.linear(x, layer.dequantize()))


# ---------------------------------------------------------------------------------------------------- bad input

Q = "model.layers.1.self_attn.o_proj"


def _expect(tmp_path: Path, fn: Any, error: type[Exception], match: str) -> None:
    path = _copy("llama_modelopt_nvfp4", tmp_path / "m")
    _edit_tensors(path, fn)
    with pytest.raises(error, match=match):
        sdk.load(path, backend="reference")


def test_wrong_shaped_weight_scale_is_a_conflict(tmp_path: Path) -> None:
    def cut(t: dict[str, torch.Tensor]) -> None:
        t[f"{Q}.weight_scale"] = t[f"{Q}.weight_scale"][:, :-1].clone()

    _expect(tmp_path, cut, FormatConflictError, r"o_proj\.weight_scale")


def test_weight_scale_not_e4m3_is_a_conflict(tmp_path: Path) -> None:
    def widen(t: dict[str, torch.Tensor]) -> None:
        t[f"{Q}.weight_scale"] = t[f"{Q}.weight_scale"].to(torch.float32)

    _expect(tmp_path, widen, FormatConflictError, "F8_E4M3")


def test_weight_not_packed_fp4_is_a_conflict(tmp_path: Path) -> None:
    def dense(t: dict[str, torch.Tensor]) -> None:
        t[f"{Q}.weight"] = t[f"{Q}.weight"].to(torch.bfloat16)

    _expect(tmp_path, dense, FormatConflictError, "U8")


def test_missing_input_scale_is_a_conflict(tmp_path: Path) -> None:
    _expect(tmp_path, lambda t: t.pop(f"{Q}.input_scale"), FormatConflictError, "input_scale")


def test_weight_scale_2_not_one_value_is_a_conflict(tmp_path: Path) -> None:
    def grow(t: dict[str, torch.Tensor]) -> None:
        t[f"{Q}.weight_scale_2"] = t[f"{Q}.weight_scale_2"].reshape(1).repeat(4)

    _expect(tmp_path, grow, FormatConflictError, "weight_scale_2")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5, 0.0])
@pytest.mark.parametrize("tensor", ["weight_scale_2", "input_scale"])
def test_bad_global_scale_is_refused(tmp_path: Path, tensor: str, value: float) -> None:
    def poison(t: dict[str, torch.Tensor]) -> None:
        t[f"{Q}.{tensor}"] = torch.full_like(t[f"{Q}.{tensor}"], value)

    _expect(tmp_path, poison, CheckpointError, tensor)


@pytest.mark.parametrize("value", [float("nan"), -1.0])
def test_bad_group_scale_is_refused(tmp_path: Path, value: float) -> None:
    def poison(t: dict[str, torch.Tensor]) -> None:
        s = t[f"{Q}.weight_scale"].clone()
        s[3, 2] = torch.tensor(value).to(torch.float8_e4m3fn)
        t[f"{Q}.weight_scale"] = s

    _expect(tmp_path, poison, CheckpointError, "weight_scale")


def test_other_group_size_is_refused(tmp_path: Path) -> None:
    path = _copy("llama_modelopt_nvfp4", tmp_path / "m")
    _set_algo(path, "NVFP4", group_size=32)
    with pytest.raises(UnsupportedFormatError, match="group_size 32"):
        sdk.load(path)


def test_fp8_weights_labelled_nvfp4_are_a_conflict(tmp_path: Path) -> None:
    path = _copy("llama_modelopt_fp8_pb_wo", tmp_path / "m")
    _set_algo(path, "NVFP4")
    assert sdk.detect(path).variant == "modelopt-nvfp4"
    with pytest.raises(FormatConflictError, match="U8"):
        sdk.load(path)


@pytest.mark.parametrize("algo", ["NVFP4_AWQ", "W4A8_NVFP4_FP8", "W4A16_NVFP4"])
def test_other_fp4_algos_are_refused_by_name(tmp_path: Path, algo: str) -> None:
    path = _copy("llama_modelopt_nvfp4", tmp_path / "m")
    _set_algo(path, algo)
    with pytest.raises(UnsupportedFormatError, match=algo):
        sdk.load(path)
    assert sdk.detect(path).format == "fp8"  # claimed, refused at load with its name


# ---------------------------------------------------------------------------------------------------- MIXED_PRECISION


def _edit_layers(path: Path, fn: Any) -> None:
    for fname, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        cfg = json.loads((path / fname).read_text())
        fn(cfg[key]["quantized_layers"])
        (path / fname).write_text(json.dumps(cfg))


def test_mixed_layers_are_their_own_kinds() -> None:
    model = sdk.load(FIXTURES / "llama_modelopt_mixed", backend="reference")
    up, q = (model.module.get_submodule(f"model.layers.1.{n}") for n in ("mlp.up_proj", "self_attn.q_proj"))
    assert type(up).__name__ == "FP8Linear" and up.input_quant == "static"
    assert type(q).__name__ == "NVFP4Linear"


#: (an edit of ``quantized_layers``, the error, its message)
MIXED_REFUSALS = {
    "unknown-layer-algo-by-name": (
        lambda layers: layers.update({"model.layers.0.mlp.up_proj": {"quant_algo": "W4A16_AWQ"}}),
        UnsupportedFormatError,
        r"up_proj is quant_algo .W4A16_AWQ",
    ),
    "without-quantized-layers-config-error": (lambda layers: layers.clear(), ConfigError, "quantized_layers"),
    "unnamed-quantized-linear-conflict": (
        lambda layers: layers.pop("model.layers.1.mlp.down_proj"),
        FormatConflictError,
        "does not name",
    ),
    "named-but-dense-linear-conflict": (
        lambda layers: layers.update({"lm_head": {"quant_algo": "FP8"}}),
        FormatConflictError,
        "no weight_scale",
    ),
    "layer-stored-as-the-other-kind-conflict": (
        lambda layers: layers.update({"model.layers.0.mlp.up_proj": {"quant_algo": "NVFP4"}}),
        FormatConflictError,
        "U8",
    ),
}


@pytest.mark.parametrize(("edit", "error", "match"), list(MIXED_REFUSALS.values()), ids=list(MIXED_REFUSALS))
def test_mixed_bad_quantized_layers_are_refused(tmp_path: Path, edit: Any, error: type[Exception], match: str) -> None:
    path = _copy("llama_modelopt_mixed", tmp_path / "m")
    _edit_layers(path, edit)
    with pytest.raises(error, match=match):
        sdk.load(path)
