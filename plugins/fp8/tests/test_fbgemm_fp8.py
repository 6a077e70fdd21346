"""transformers' ``fbgemm_fp8`` checkpoints (``FbgemmFp8Config``), made by transformers 5.24's own quantizer and
``save_pretrained`` on a CPU (``make_fbgemm_fp8_fixtures.py``), fbgemm's two CUDA kernels (``quantize_fp8_per_row``,
``f8f8bf16_rowwise``) written out there from fbgemm's source: ``fbgemm-gpu-cpu`` has neither, and no GPU ran them.

Judges, recorded in a venv of the same torch/transformers:

- weights: ``float32(weight) * weight_scale`` of each ``FbgemmFp8Linear`` transformers loaded back (the factor
  fbgemm's rowwise GEMM applies; transformers has no dequantize for this method), bit-exact (sha256);
- logits: transformers' module graph with those ops in float32 (``logits_float32``: the per-row input rule on the
  float32 activations, the GEMM in float32) within :data:`EXACT_TOL`, greedy tokens identical; and as transformers
  runs it, in bfloat16 (``logits_bf16``, fbgemm's bfloat16-only arithmetic) within :data:`BF16_TOL` only, greedy
  tokens identical (transformers' own bfloat16 forward is 7.2% / 6.9% of the largest logit from its float32 one
  here: the activations' FP8 codes move with bfloat16's rounding).

Live (``peer``): the same module graph of transformers, run here on the fixture with the maker's written-out ops;
on a CUDA machine with ``fbgemm_gpu``, one layer against fbgemm's real kernels.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant as sdk
from anyquant.errors import AnyquantError, ConfigError, FormatConflictError, UnsupportedFormatError
from plugins.fp8.tests.test_modelopt_fixtures import _copy, _edit_config, _edit_tensors, record  # shared fixture edits
from tests.peers.recorded import (
    assert_fast_modules_exact,
    assert_greedy_or_near_tie,
    forward_logits,
    greedy_tokens,
    rel_error,
    sha256_f32,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAMES = ("llama_fbgemm_fp8", "qwen3_fbgemm_fp8")
#: of the largest logit, against transformers' float32 graph (measured 3.3e-7 and 1.4e-5: float32 summation order,
#: and now and then an input's FP8 code one step apart after it)
EXACT_TOL = 1e-4
#: against transformers' bfloat16 forward (measured 7.2e-2 and 6.8e-2: bfloat16's own distance here)
BF16_TOL = 0.12
#: cpu-fast (measured 3.9e-2 and 9.0e-3: bfloat16 prefill and the Q8_0 head, FP8 modules exact)
FAST_TOL = 6e-2


@pytest.mark.parametrize("name", NAMES)
def test_detect_and_inspect_name_the_variant(name: str) -> None:
    rec = record(name)
    det = sdk.detect(FIXTURES / name)
    assert det.format == "fp8" and det.variant == "fbgemm-fp8" and not det.details["problems"]
    assert det.details["modules"] == len(rec["dequantized_weights"])
    assert det.details["activation_scale_ub"] == rec["quantization_config"]["activation_scale_ub"]
    assert any("fbgemm_fp8" in e for e in det.evidence) and any("weight_scale [out, 1]" in e for e in det.evidence)
    rows = {r.name: r for r in sdk.inspect(FIXTURES / name).modules}
    for wname in rec["dequantized_weights"]:
        assert rows[wname.removesuffix(".weight")].format == "fbgemm-fp8"
    # transformers' FbgemmFp8Linear set is anyquant's FP8 set; lm_head (and Qwen3's excluded down_proj) dense
    fp8 = {n for n, c in rec["linear_classes"].items() if c == "FbgemmFp8Linear"}
    assert fp8 == {r.name for r in rows.values() if r.format == "fbgemm-fp8"}
    assert rows["lm_head"].format != "fbgemm-fp8"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["reference", "dequantized"])
def test_exact_backends_are_transformers_fbgemm(name: str, backend: str) -> None:
    rec = record(name)
    model = sdk.load(FIXTURES / name, backend=backend)
    for wname, w in rec["dequantized_weights"].items():
        dq = model.module.get_submodule(wname.removesuffix(".weight")).dequantize()
        assert dq.dtype == torch.float32 and sha256_f32(dq) == w["sha256"], wname
    logits = forward_logits(model, rec["prompt_ids"])
    assert rel_error(logits, torch.tensor(rec["logits_float32"])) <= EXACT_TOL
    assert rel_error(logits, torch.tensor(rec["logits_bf16"])) <= BF16_TOL
    got = greedy_tokens(model, rec["prompt_ids"], 8)
    assert got == rec["greedy_float32"] == rec["greedy_bf16"]


@pytest.mark.parametrize("name", NAMES)
def test_cpu_fast_default(name: str) -> None:
    rec = record(name)
    model = sdk.load(FIXTURES / name)
    tol = EXACT_TOL
    if model.backend == "cpu-fast":
        n = len(rec["dequantized_weights"])
        assert model.info["cpu_fast"]["fast_layers"] == n
        tol = FAST_TOL
        exact = sdk.load(FIXTURES / name, backend="reference")
        names = [w.removesuffix(".weight") for w in rec["dequantized_weights"]]
        assert assert_fast_modules_exact(model, exact, names) == n
    assert rel_error(forward_logits(model, rec["prompt_ids"]), torch.tensor(rec["logits_float32"])) <= tol
    assert_greedy_or_near_tie(
        lambda: sdk.load(FIXTURES / name, backend="reference"),
        rec["prompt_ids"],
        rec["greedy_float32"],
        greedy_tokens(model, rec["prompt_ids"], 8),
        tol,
    )


def test_input_rows_are_quantized_as_fbgemm() -> None:
    """Each input row as fbgemm's ``quantize_fp8_per_row(x, scale_ub=activation_scale_ub)``: its max bounded by the
    upper bound (1.0 in the Qwen3 fixture: larger rows saturate at +-448), ``x / s`` (a division), e4m3; not vLLM's
    per-token rule (core's ``quantize_fp8_activations``: no bound, ``x * (1 / s)``)."""
    from anyquant_runtime.activations import quantize_fp8_activations

    model = sdk.load(FIXTURES / "qwen3_fbgemm_fp8", backend="reference")
    layer = model.module.get_submodule("model.layers.0.mlp.gate_proj")
    assert float(layer.scale_ub) == 1.0
    x = torch.randn(5, layer.in_features) * torch.tensor([0.01, 0.3, 1.0, 4.0, 40.0]).reshape(-1, 1)
    x[1] = 0.0  # an all-zero row: the least scale, 1 / (448 * 512)
    s = (torch.minimum(x.abs().amax(-1, keepdim=True), torch.tensor(1.0)) / 448).clamp(min=1 / (448 * 512))
    q = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    with torch.no_grad():
        got = layer(x)
        assert torch.equal(got, torch.nn.functional.linear(q, layer.dequantize()))
        vllm = torch.nn.functional.linear(quantize_fp8_activations(x, None), layer.dequantize())
    assert not torch.equal(got, vllm)


def test_stored_input_scale_ub_is_ignored_as_transformers_does(tmp_path: Path) -> None:
    """transformers 5.24's ``input_scale_ub`` is a non-persistent buffer filled from the config: a stored one (older
    exports) changes nothing."""
    path = _copy("llama_fbgemm_fp8", tmp_path / "m")
    _edit_tensors(path, lambda t: t.update({"model.layers.0.self_attn.q_proj.input_scale_ub": torch.tensor([0.5])}))
    det = sdk.detect(path)
    assert det.variant == "fbgemm-fp8" and not det.details["problems"]
    rec = record("llama_fbgemm_fp8")
    model = sdk.load(path, backend="reference")
    assert float(model.module.get_submodule("model.layers.0.self_attn.q_proj").scale_ub) == 1200.0
    assert rel_error(forward_logits(model, rec["prompt_ids"]), torch.tensor(rec["logits_float32"])) <= EXACT_TOL


# ---------------------------------------------------------------------------------------------------- bad input


def test_missing_weight_scale_is_a_conflict(tmp_path: Path) -> None:
    path = _copy("llama_fbgemm_fp8", tmp_path / "m")
    _edit_tensors(path, lambda t: t.pop("model.layers.0.self_attn.q_proj.weight_scale"))
    with pytest.raises(FormatConflictError, match=r"without a weight_scale.*q_proj"):
        sdk.load(path)


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.reshape(-1),  # [out] instead of [out, 1]
        lambda s: s.to(torch.bfloat16),
        lambda s: s.reshape(1, -1),
    ],
    ids=["flat", "bf16", "transposed"],
)
def test_weight_scale_of_the_wrong_shape_or_dtype_is_a_conflict(tmp_path: Path, change: Any) -> None:
    path = _copy("llama_fbgemm_fp8", tmp_path / "m")
    key = "model.layers.1.mlp.up_proj.weight_scale"
    _edit_tensors(path, lambda t: t.update({key: change(t[key]).contiguous()}))
    with pytest.raises(FormatConflictError, match=r"up_proj.weight_scale.*F32 \[128, 1\]"):
        sdk.load(path)


def test_weight_not_fp8_is_a_conflict(tmp_path: Path) -> None:
    path = _copy("llama_fbgemm_fp8", tmp_path / "m")
    key = "model.layers.0.mlp.gate_proj.weight"
    _edit_tensors(path, lambda t: t.update({key: t[key].to(torch.bfloat16)}))
    with pytest.raises(FormatConflictError, match=r"gate_proj.weight is BF16"):
        sdk.load(path)


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0])
def test_bad_scale_value_is_refused(tmp_path: Path, bad: float) -> None:
    path = _copy("llama_fbgemm_fp8", tmp_path / "m")
    key = "model.layers.1.self_attn.o_proj.weight_scale"

    def poison(t: dict[str, torch.Tensor]) -> None:
        t[key][3, 0] = bad

    _edit_tensors(path, poison)
    with pytest.raises(AnyquantError, match=r"o_proj.weight_scale.*positive finite"):
        sdk.load(path, backend="reference")


@pytest.mark.parametrize("ub", [0, -5.0, True, "1200", None])
def test_bad_activation_scale_ub_is_a_config_error(tmp_path: Path, ub: Any) -> None:
    path = _copy("llama_fbgemm_fp8", tmp_path / "m")
    _edit_config(path, activation_scale_ub=ub)
    assert sdk.detect(path).variant == "fbgemm-fp8"
    with pytest.raises(ConfigError, match="activation_scale_ub"):
        sdk.load(path)


def test_fp8_module_that_modules_to_not_convert_names_is_a_conflict(tmp_path: Path) -> None:
    path = _copy("llama_fbgemm_fp8", tmp_path / "m")
    _edit_config(path, modules_to_not_convert=["lm_head", "model.layers.0.mlp"])  # a module-boundary prefix
    with pytest.raises(FormatConflictError, match=r"model.layers.0.mlp.down_proj is FP8.*modules_to_not_convert"):
        sdk.load(path)


def test_dense_linear_not_excluded_is_a_conflict(tmp_path: Path) -> None:
    path = _copy("qwen3_fbgemm_fp8", tmp_path / "m")
    _edit_config(path, modules_to_not_convert=None)  # transformers' default: lm_head only
    with pytest.raises(FormatConflictError, match=r"dense but not in modules_to_not_convert.*layers.1.mlp.down_proj"):
        sdk.load(path)


def test_llama4_experts_are_refused_by_name(tmp_path: Path) -> None:
    """transformers' ``FbgemmFp8Llama4TextExperts`` (3-D ``gate_up_proj``/``down_proj`` with ``*_proj_scale``)."""
    path = _copy("llama_fbgemm_fp8", tmp_path / "m")
    experts = "model.layers.0.feed_forward.experts"

    def add(t: dict[str, torch.Tensor]) -> None:
        t[f"{experts}.gate_up_proj"] = torch.zeros(2, 64, 256).to(torch.float8_e4m3fn)
        t[f"{experts}.gate_up_proj_scale"] = torch.ones(2, 1, 256)
        t[f"{experts}.down_proj"] = torch.zeros(2, 128, 64).to(torch.float8_e4m3fn)
        t[f"{experts}.down_proj_scale"] = torch.ones(2, 64, 1)

    _edit_tensors(path, add)
    det = sdk.detect(path)
    assert det.format == "fp8" and det.variant == "fbgemm-fp8"
    with pytest.raises(UnsupportedFormatError, match="FbgemmFp8Llama4TextExperts"):
        sdk.load(path)


# ---------------------------------------------------------------------------------------------------- live peers


def _maker() -> Any:
    spec = importlib.util.spec_from_file_location(
        "make_fbgemm_fp8_fixtures", Path(__file__).with_name("make_fbgemm_fp8_fixtures.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.peer
def test_live_transformers_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.24 reads the fixture itself (``from_pretrained``: ``replace_with_fbgemm_fp8_linear``,
    ``modules_to_not_convert``, ``input_scale_ub`` from the config) and runs ``FbgemmFp8Linear.forward`` in float32
    with the maker's written-out fbgemm ops (its CUDA check skipped): anyquant's reference backend within
    :data:`EXACT_TOL` of it, the same modules FP8."""
    pytest.importorskip("transformers.integrations.fbgemm_fp8")
    from transformers import AutoModelForCausalLM
    from transformers.integrations import fbgemm_fp8 as tf_fbgemm
    from transformers.quantizers.quantizer_fbgemm_fp8 import FbgemmFp8HfQuantizer

    maker = _maker()
    monkeypatch.setattr(tf_fbgemm, "get_quantize_fp8_per_row", lambda: maker.quantize_fp8_per_row)
    monkeypatch.setattr(torch.ops.fbgemm, "f8f8bf16_rowwise", maker.f8f8bf16_rowwise, raising=False)
    monkeypatch.setattr(FbgemmFp8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    monkeypatch.setitem(maker._MODE, "ops", "float32")
    name = "qwen3_fbgemm_fp8"
    rec = record(name)
    peer = AutoModelForCausalLM.from_pretrained(FIXTURES / name, device_map="cpu")
    torch.nn.Module.float(peer)
    ours = sdk.load(FIXTURES / name, backend="reference")
    fp8 = {n for n, m in peer.named_modules() if isinstance(m, tf_fbgemm.FbgemmFp8Linear)}
    assert fp8 == {w.removesuffix(".weight") for w in rec["dequantized_weights"]}
    assert {float(peer.get_submodule(n).input_scale_ub) for n in fp8} == {1.0}
    with torch.no_grad():
        want = peer(torch.tensor([rec["prompt_ids"]])).logits[0]
    assert rel_error(forward_logits(ours, rec["prompt_ids"]), want) <= EXACT_TOL


@pytest.mark.peer
def test_live_fbgemm_kernels_on_cuda() -> None:
    """One layer against fbgemm's own CUDA kernels (transformers' ``FbgemmFp8Linear``), where they run."""
    if not torch.cuda.is_available():
        pytest.skip("fbgemm's quantize_fp8_per_row / f8f8bf16_rowwise run on CUDA only; no GPU here")
    pytest.importorskip("fbgemm_gpu.experimental.gen_ai", reason="fbgemm_gpu (CUDA) not installed")
    from safetensors.torch import load_file
    from transformers.integrations import fbgemm_fp8 as tf_fbgemm

    name = "model.layers.0.mlp.gate_proj"
    t = load_file(FIXTURES / "qwen3_fbgemm_fp8" / "model.safetensors")
    tf_fbgemm.quantize_fp8_per_row = tf_fbgemm.get_quantize_fp8_per_row()
    peer = tf_fbgemm.FbgemmFp8Linear(64, 128, False).cuda()
    peer.weight.data, peer.weight_scale.data = t[f"{name}.weight"].cuda(), t[f"{name}.weight_scale"].cuda()
    peer.input_scale_ub.fill_(1.0)
    ours = sdk.load(FIXTURES / "qwen3_fbgemm_fp8", backend="reference", dtype="bfloat16")
    x = (torch.randn(7, 64) * 2).to(torch.bfloat16)
    with torch.no_grad():
        want = peer(x.cuda()).float().cpu()
        got = ours.module.get_submodule(name)(x).float()
    assert rel_error(got, want) <= 2e-2
