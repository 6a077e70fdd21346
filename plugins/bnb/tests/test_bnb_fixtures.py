"""bitsandbytes checkpoints quantized and saved by transformers 5.24 + bitsandbytes 0.50.2 on a CPU
(``make_bnb_fixtures.py``), judged by bitsandbytes: ``dequantize_4bit`` of the reloaded model (int8: transformers'
``dequantize()``), sha256 per linear, and the float32 logits and greedy tokens of the dequantized model, recorded in a
venv of the same torch and transformers. Live where bitsandbytes imports here (``peer``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import anyquant as sdk
from anyquant.errors import CheckpointError, FormatConflictError, NumericalError
from tests.peers.recorded import (
    assert_fast_modules_exact,
    assert_greedy_or_near_tie,
    forward_logits,
    greedy_tokens,
    rel_error,
    sha256_f32,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.json") if (FIXTURES / p.stem / "config.json").is_file())


#: the recorded logits are transformers' ``dequantize()``d model's, which rounds LLM.int8's exact float32 weights
#: (bitsandbytes' own dequantization, what anyquant keeps) to the model's bfloat16: 4.7e-3 of the largest logit here
INT8_ROUNDING = 1e-2


def exact_tol(name: str) -> float:
    return INT8_ROUNDING if "int8" in name else 1e-6


def record(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def test_fixtures_present() -> None:
    assert {"llama_nf4", "llama_nf4_dq", "llama_fp4", "llama_fp4_dq", "llama_int8", "qwen3_nf4"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_detect(name: str) -> None:
    det = sdk.detect(FIXTURES / name)
    assert det.format == "bnb" and det.variant == ("8bit" if "int8" in name else "4bit")
    assert det.details["modules"] == len(record(name)["weights"]) and not det.details["problems"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["reference", "dequantized"])
def test_exact_backends_are_bitsandbytes(name: str, backend: str) -> None:
    rec = record(name)
    model = sdk.load(FIXTURES / name, backend=backend)
    for mod_name, w in rec["weights"].items():
        dq = model.module.get_submodule(mod_name).dequantize()
        assert sha256_f32(dq) == w["sha256"], (mod_name, dq.flatten()[:4].tolist(), w["first4"])
        assert backend == "dequantized" or str(dq.dtype) == f"torch.{w['dtype']}"
    assert rel_error(forward_logits(model, rec["prompt_ids"]), torch.tensor(rec["logits_dequantized"])) <= exact_tol(
        name
    )
    assert greedy_tokens(model, rec["prompt_ids"], 8) == rec["greedy_dequantized"]


@pytest.mark.parametrize("name", NAMES)
def test_cpu_fast_default(name: str) -> None:
    rec = record(name)
    model = sdk.load(FIXTURES / name)
    tol = exact_tol(name)
    if model.backend == "cpu-fast":  # 4-bit: the table kernel; int8: bfloat16 prepacked (AVX512-BF16 hosts)
        assert model.info["cpu_fast"]["fast_layers"] == len(rec["weights"])
        tol = 3e-2
        exact = sdk.load(FIXTURES / name, backend="reference")
        assert assert_fast_modules_exact(model, exact, rec["weights"]) == len(rec["weights"])
    assert rel_error(forward_logits(model, rec["prompt_ids"]), torch.tensor(rec["logits_dequantized"])) <= tol
    assert_greedy_or_near_tie(
        lambda: sdk.load(FIXTURES / name, backend="reference"),
        rec["prompt_ids"],
        rec["greedy_dequantized"],
        greedy_tokens(model, rec["prompt_ids"], 8),
        tol,
    )


@pytest.mark.peer
@pytest.mark.parametrize("name", ["llama_nf4_dq", "llama_fp4", "llama_nf4_storage_bf16"])
def test_live_dequantize_4bit(name: str) -> None:
    """bitsandbytes itself (its CPU backend) dequantizes the saved tensors to the same weights."""
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import QuantState, dequantize_4bit

    raw = load_file(FIXTURES / name / "model.safetensors")
    model = sdk.load(FIXTURES / name, backend="reference")
    for mod_name in record(name)["weights"]:
        prefix = f"{mod_name}.weight"
        qs_items = {k[len(prefix) + 1 :]: v for k, v in raw.items() if k.startswith(prefix + ".")}
        state = QuantState.from_dict(qs_items, device=torch.device("cpu"))
        theirs = dequantize_4bit(raw[prefix].view(torch.uint8), state)
        ours = model.module.get_submodule(mod_name).dequantize()
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), mod_name
    del bnb


@pytest.mark.peer
def test_live_int8_dequantize() -> None:
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import int8_vectorwise_dequant

    raw = load_file(FIXTURES / "llama_int8" / "model.safetensors")
    model = sdk.load(FIXTURES / "llama_int8", backend="reference")
    for mod_name in record("llama_int8")["weights"]:
        theirs = int8_vectorwise_dequant(raw[f"{mod_name}.weight"], raw[f"{mod_name}.SCB"])
        ours = model.module.get_submodule(mod_name).dequantize()
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), mod_name


def _variant(tmp_path: Path, name: str, change: Any) -> Path:
    path = tmp_path / name
    shutil.copytree(FIXTURES / name, path)
    t = load_file(path / "model.safetensors")
    change(t)
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    return path


P = "model.layers.0.self_attn.q_proj"


def test_nan_absmax_is_refused(tmp_path: Path) -> None:
    def change(t: dict[str, torch.Tensor]) -> None:
        t[f"{P}.weight.absmax"][3] = float("nan")

    with pytest.raises(NumericalError, match="absmax"):
        sdk.load(_variant(tmp_path, "llama_nf4", change), backend="reference")


def test_quant_state_that_disagrees_with_the_layer(tmp_path: Path) -> None:
    def change(t: dict[str, torch.Tensor]) -> None:
        key = f"{P}.weight.quant_state.bitsandbytes__nf4"
        state = json.loads(bytes(t[key].tolist()))
        state["shape"] = [64, 256]
        t[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)

    with pytest.raises(CheckpointError, match="shape"):
        sdk.load(_variant(tmp_path, "llama_nf4_dq", change), backend="reference")


def test_absmax_of_the_wrong_count_is_refused(tmp_path: Path) -> None:
    def change(t: dict[str, torch.Tensor]) -> None:
        t[f"{P}.weight.absmax"] = t[f"{P}.weight.absmax"][:-1].clone()

    with pytest.raises(CheckpointError, match="absmax"):
        sdk.load(_variant(tmp_path, "llama_nf4", change), backend="reference")


def test_int8_scales_of_the_wrong_length_are_a_conflict(tmp_path: Path) -> None:
    def change(t: dict[str, torch.Tensor]) -> None:
        t[f"{P}.SCB"] = t[f"{P}.SCB"][:5].clone()

    with pytest.raises(FormatConflictError, match="SCB"):
        sdk.load(_variant(tmp_path, "llama_int8", change))


@pytest.mark.parametrize("name", ["llama_nf4", "qwen3_nf4"])
def test_compiled_decode_step_runs_the_table_kernel(name: str) -> None:
    """cpu-fast's 4-bit table linears in the native decoder's compiled decode step: every layer planned, its
    logits the module path's bit for bit (where the table kernel is built)."""
    from anyquant_cpu import kernels
    from tests.decoding import assert_step_is_module_path

    if not kernels.lut_available():
        pytest.skip("the compiled 4-bit table kernel is not built")
    model = sdk.load(FIXTURES / name, backend="cpu-fast")
    assert_step_is_module_path(model, int(model.module.config.vocab_size))
