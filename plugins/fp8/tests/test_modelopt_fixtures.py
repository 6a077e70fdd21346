"""NVIDIA ModelOpt FP8 checkpoints, quantized and exported by ModelOpt 0.47.0 itself on a CPU
(``make_modelopt_fixtures.py``: ``mtq.quantize`` + ``export_hf_checkpoint``): ``FP8`` (per-tensor weights, static
``input_scale``, FP8 KV cache, an excluded decoder linear), ``FP8_PER_CHANNEL_PER_TOKEN`` (Qwen3) and ``FP8_PB_WO``.

Judges, recorded in ModelOpt's venv:

- weights: ModelOpt's own decompression of the exported tensors (``FP8QTensor.dequantize``: ``float32(e4m3) *
  weight_scale``), bit-exact (sha256 of the float32 values);
- logits: ModelOpt's forward of its fake-quantized model with the exported weights put back
  (``logits_float32_exported_weights``: its input/KV quantizers as calibrated) -- within :data:`EXPORTED_TOL`, greedy
  tokens identical (cpu-fast: :data:`FAST_TOL`, greedy identical or a near-tie); and its forward as calibrated
  (``logits_float32``) -- within :data:`FAKE_TOL` only: its fake-quantized weights are not the ones it exports (the
  export divides the bfloat16 weight by ``amax / 448`` in bfloat16 before the e4m3 cast, the fake quantizer in
  float32: codes one e4m3 step apart here and there), and its greedy tokens part from the checkpoint's after 3-4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant as sdk
from anyquant.errors import AnyquantError, CheckpointError, ConfigError, FormatConflictError, UnsupportedFormatError
from tests.peers.recorded import (
    assert_fast_modules_exact,
    assert_greedy_or_near_tie,
    forward_logits,
    greedy_tokens,
    rel_error,
    sha256_f32,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
VARIANTS = {
    "llama_modelopt_fp8": "modelopt-fp8",
    "qwen3_modelopt_fp8_pcpt": "modelopt-fp8-pc-pt",
    "llama_modelopt_fp8_pb_wo": "modelopt-fp8-pb-wo",
}
#: of the largest logit: ModelOpt's forward with the exported weights (measured 3.1e-7, 5.0e-7, 0: ModelOpt quantizes
#: inputs by ``x * (448 / amax)``, anyquant as vLLM by ``x * (1 / input_scale)``, a float32 rounding apart)
EXPORTED_TOL = 1e-5
#: of the largest logit: ModelOpt's forward as calibrated, whose fake-quantized weights are not the exported ones
#: (measured 0.16, 0.093, 0.0094: one e4m3 step here and there, amplified by the quantized activations)
FAKE_TOL = {"llama_modelopt_fp8": 0.2, "qwen3_modelopt_fp8_pcpt": 0.12, "llama_modelopt_fp8_pb_wo": 2e-2}
#: cpu-fast: of the largest logit (measured 7.0e-3, 6.6e-3, 8.0e-3 where fp8_gemv runs)
FAST_TOL = 3e-2


def record(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def _copy(name: str, dst: Path) -> Path:
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, fn: Any) -> None:
    from safetensors.torch import load_file, save_file

    t = load_file(path / "model.safetensors")
    fn(t)
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("name", list(VARIANTS))
def test_detect_names_the_variant(name: str) -> None:
    rec = record(name)
    det = sdk.detect(FIXTURES / name)
    assert det.format == "fp8" and det.variant == VARIANTS[name]
    assert det.details["quant_algo"] == rec["quant_algo"] and det.details["producer"] == "modelopt 0.47.0"
    assert det.details["modules"] == len(rec["dequantized_weights"]) and not det.details["problems"]
    assert any("modelopt" in e for e in det.evidence)
    rows = {r.name: r for r in sdk.inspect(FIXTURES / name).modules}
    assert rows["model.layers.0.self_attn.q_proj"].format == VARIANTS[name]
    assert rows["lm_head"].format != VARIANTS[name]  # excluded: dense


def test_exclude_modules_and_kv_cache_are_read() -> None:
    det = sdk.detect(FIXTURES / "llama_modelopt_fp8")
    assert "model.layers.1.mlp.down_proj" in det.details["exclude_modules"]
    assert det.details["kv_cache_quant_algo"] == "FP8" and det.details["kv_layers"] == 2
    model = sdk.load(FIXTURES / "llama_modelopt_fp8", backend="reference")
    dense = model.module.get_submodule("model.layers.1.mlp.down_proj")
    assert not hasattr(dense, "dequantize") and dense.weight.dtype != torch.float8_e4m3fn
    assert "k_scale" in model.info["kv_cache"]
    attn = model.module.get_submodule("model.layers.0.self_attn")
    raw = record("llama_modelopt_fp8")["tensors"]
    assert float(attn.kv_quant.k_scale) == raw["model.layers.0.self_attn.k_proj.k_scale"]["values"][0]


def check_hf_quant_config_alone(tmp_path: Path, name: str, variant: str, judge: str, tol: float) -> None:
    """Fixture ``name`` without config.json's quantization_config is detected as ``variant`` from
    ``hf_quant_config.json`` and its reference backend is within ``tol`` of the recorded ``logits_float32_{judge}``
    (shared with ``test_modelopt_nvfp4.py``)."""
    path = _copy(name, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    det = sdk.detect(path)
    assert det.variant == variant and det.details["config_source"] == "hf_quant_config.json"
    rec = record(name)
    model = sdk.load(path, backend="reference")
    logits = forward_logits(model, rec["prompt_ids"])
    assert rel_error(logits, torch.tensor(rec[f"logits_float32_{judge}"])) <= tol


def test_hf_quant_config_alone_is_enough(tmp_path: Path) -> None:
    """ModelOpt before 0.29 wrote only ``hf_quant_config.json``: the same checkpoint without config.json's
    quantization_config is detected and loads the same."""
    check_hf_quant_config_alone(
        tmp_path, "llama_modelopt_fp8_pb_wo", "modelopt-fp8-pb-wo", "exported_weights", EXPORTED_TOL
    )


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("backend", ["reference", "dequantized"])
def test_exact_backends_are_modelopt(name: str, backend: str) -> None:
    rec = record(name)
    model = sdk.load(FIXTURES / name, backend=backend)
    for wname, w in rec["dequantized_weights"].items():
        dq = model.module.get_submodule(wname.removesuffix(".weight")).dequantize()
        assert dq.dtype == torch.float32 and sha256_f32(dq) == w["sha256"], wname
    logits = forward_logits(model, rec["prompt_ids"])
    assert rel_error(logits, torch.tensor(rec["logits_float32_exported_weights"])) <= EXPORTED_TOL
    assert rel_error(logits, torch.tensor(rec["logits_float32"])) <= FAKE_TOL[name]
    got = greedy_tokens(model, rec["prompt_ids"], 8)
    assert got == rec["greedy_float32_exported_weights"]


def check_cpu_fast_default(name: str, judge: str, tol: float, fast_tol: float) -> Any:
    """Fixture ``name`` on the default backend: cpu-fast (where it runs) on every quantized linear, each module exact;
    logits within ``tol`` of the recorded ``logits_float32_{judge}`` (cpu-fast: ``fast_tol``), greedy tokens
    ``greedy_float32_{judge}`` or a near-tie. Returns the model (shared with ``test_modelopt_nvfp4.py``)."""
    rec = record(name)
    model = sdk.load(FIXTURES / name)
    if model.backend == "cpu-fast":
        n = len(rec["dequantized_weights"])
        assert model.info["cpu_fast"]["fast_layers"] == n
        tol = fast_tol
        exact = sdk.load(FIXTURES / name, backend="reference")
        names = [w.removesuffix(".weight") for w in rec["dequantized_weights"]]
        assert assert_fast_modules_exact(model, exact, names) == n
    want = torch.tensor(rec[f"logits_float32_{judge}"])
    assert rel_error(forward_logits(model, rec["prompt_ids"]), want) <= tol
    assert_greedy_or_near_tie(
        lambda: sdk.load(FIXTURES / name, backend="reference"),
        rec["prompt_ids"],
        rec[f"greedy_float32_{judge}"],
        greedy_tokens(model, rec["prompt_ids"], 8),
        tol,
    )
    return model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cpu_fast_default(name: str) -> None:
    check_cpu_fast_default(name, "exported_weights", EXPORTED_TOL, FAST_TOL)


def test_static_input_quantization_is_vllms() -> None:
    """The static ``input_scale`` quantizes a linear's input as vLLM's ``QuantFP8`` (``e4m3(clamp(x * (1 / s)))``,
    times ``s``): the reference layer's output is the float32 GEMM of that input with the exact weight."""
    model = sdk.load(FIXTURES / "llama_modelopt_fp8", backend="reference")
    layer = model.module.get_submodule("model.layers.0.mlp.gate_proj")
    s = layer.input_scale
    x = torch.randn(3, layer.in_features) * float(s) * 600  # some beyond 448 steps: saturated
    q = (x * (1 / s)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    want = torch.nn.functional.linear(q, layer.dequantize())
    with torch.no_grad():
        assert torch.equal(layer(x), want)


# ---------------------------------------------------------------------------------------------------- bad input


def test_unknown_quant_algo_is_refused_by_name(tmp_path: Path) -> None:
    path = _copy("llama_modelopt_fp8_pb_wo", tmp_path / "m")
    _edit_config(path, quant_algo="FP7_MAGIC")
    with pytest.raises(UnsupportedFormatError, match="FP7_MAGIC"):
        sdk.load(path)


def test_awq_is_refused_by_name(tmp_path: Path) -> None:
    path = _copy("llama_modelopt_fp8_pb_wo", tmp_path / "m")
    _edit_config(path, quant_algo="W4A16_AWQ")
    hq = json.loads((path / "hf_quant_config.json").read_text())
    hq["quantization"]["quant_algo"] = "W4A16_AWQ"
    (path / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(UnsupportedFormatError, match="W4A16_AWQ"):
        sdk.load(path)
    assert sdk.detect(path).format == "fp8"  # claimed, refused at load with its name


def test_unknown_kv_cache_algo_is_refused(tmp_path: Path) -> None:
    path = _copy("llama_modelopt_fp8", tmp_path / "m")
    _edit_config(path, kv_cache_scheme={"dynamic": False, "num_bits": 4, "type": "float"})
    with pytest.raises(UnsupportedFormatError, match="kv_cache"):
        sdk.load(path)


def test_files_that_disagree_are_a_config_error(tmp_path: Path) -> None:
    path = _copy("llama_modelopt_fp8", tmp_path / "m")
    hq = json.loads((path / "hf_quant_config.json").read_text())
    hq["quantization"]["quant_algo"] = "FP8_PB_WO"
    (path / "hf_quant_config.json").write_text(json.dumps(hq))
    with pytest.raises(ConfigError, match="hf_quant_config"):
        sdk.load(path)


def test_weights_that_are_not_fp8_are_a_conflict(tmp_path: Path) -> None:
    path = _copy("llama_modelopt_fp8_pb_wo", tmp_path / "m")

    def dense(t: dict[str, torch.Tensor]) -> None:
        for k in [k for k in t if t[k].dtype == torch.float8_e4m3fn]:
            t[k] = t[k].to(torch.bfloat16)

    _edit_tensors(path, dense)
    with pytest.raises(FormatConflictError, match="F8_E4M3"):
        sdk.load(path)


def test_no_quantized_tensor_at_all_is_a_conflict(tmp_path: Path) -> None:
    path = _copy("llama_modelopt_fp8_pb_wo", tmp_path / "m")

    def dense(t: dict[str, torch.Tensor]) -> None:
        for k in [k for k in t if k.endswith("weight_scale")]:
            p = k.removesuffix(".weight_scale")
            t[f"{p}.weight"] = t[f"{p}.weight"].to(torch.bfloat16)
            del t[k]

    _edit_tensors(path, dense)
    with pytest.raises(FormatConflictError):
        sdk.load(path)


def test_missing_weight_scale_is_a_conflict(tmp_path: Path) -> None:
    path = _copy("llama_modelopt_fp8", tmp_path / "m")
    _edit_tensors(path, lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale"))
    with pytest.raises(FormatConflictError, match="weight_scale"):
        sdk.load(path)


def test_missing_input_scale_is_a_conflict(tmp_path: Path) -> None:
    path = _copy("llama_modelopt_fp8", tmp_path / "m")
    _edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.o_proj.input_scale"))
    with pytest.raises(FormatConflictError, match="input_scale"):
        sdk.load(path)


def test_wrong_shaped_scale_is_a_conflict(tmp_path: Path) -> None:
    path = _copy("qwen3_modelopt_fp8_pcpt", tmp_path / "m")

    def cut(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.gate_proj.weight_scale"] = t["model.layers.0.mlp.gate_proj.weight_scale"][:-1].clone()

    _edit_tensors(path, cut)
    with pytest.raises(FormatConflictError, match=r"gate_proj\.weight_scale"):
        sdk.load(path)


def test_fp8_module_listed_as_excluded_is_a_conflict(tmp_path: Path) -> None:
    path = _copy("llama_modelopt_fp8_pb_wo", tmp_path / "m")
    _edit_config(path, ignore=["lm_head", "model.layers.0.mlp*"])
    with pytest.raises(FormatConflictError, match="exclude_modules"):
        sdk.load(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5, 0.0])
@pytest.mark.parametrize("tensor", ["mlp.up_proj.weight_scale", "mlp.up_proj.input_scale", "self_attn.k_proj.k_scale"])
def test_bad_scale_is_refused(tmp_path: Path, tensor: str, value: float) -> None:
    path = _copy("llama_modelopt_fp8", tmp_path / "m")
    key = f"model.layers.1.{tensor}"

    def poison(t: dict[str, torch.Tensor]) -> None:
        t[key] = torch.full_like(t[key], value)

    _edit_tensors(path, poison)
    with pytest.raises(AnyquantError, match=tensor.rpartition(".")[2]) as info:
        sdk.load(path, backend="reference")
    assert isinstance(info.value, (CheckpointError, FormatConflictError))
