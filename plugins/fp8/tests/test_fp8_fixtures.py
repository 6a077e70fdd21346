"""FP8 (``quant_method: "fp8"``) checkpoints quantized by transformers' own ``Fp8Quantize`` (``make_fp8_fixtures.py``),
judged by transformers' ``FineGrainedFP8Config(dequantize=True)``: its dequantized weights (sha256, recorded in a
venv of the same torch/transformers) and the float32 logits and greedy tokens of its dequantized model; live where
transformers runs it here (``peer``). The partial-block fixture, which transformers 5.24 refuses, is judged by
DeepSeek-V3's reference rule written out below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant as sdk
from anyquant.errors import AnyquantError, FormatConflictError
from tests.peers.recorded import (
    assert_fast_modules_exact,
    assert_greedy_or_near_tie,
    forward_logits,
    greedy_tokens,
    rel_error,
    sha256_f32,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
JUDGED = ("llama_fp8_block", "qwen3_fp8_block", "llama_fp8_tensor")


def record(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


@pytest.mark.parametrize("name", JUDGED)
def test_detect(name: str) -> None:
    det = sdk.detect(FIXTURES / name)
    assert det.format == "fp8" and det.variant == ("tensor" if "tensor" in name else "block")
    assert det.details["modules"] == 14 and not det.details["problems"]


@pytest.mark.parametrize("name", JUDGED)
@pytest.mark.parametrize("backend", ["reference", "dequantized"])
def test_exact_backends_are_transformers(name: str, backend: str) -> None:
    rec = record(name)
    model = sdk.load(FIXTURES / name, backend=backend)
    for wname, w in rec["dequantized_weights"].items():
        dq = model.module.get_submodule(wname.removesuffix(".weight")).dequantize()
        assert sha256_f32(dq) == w["sha256"], wname  # dequantized: held in float32 (equal values)
        assert backend == "dequantized" or str(dq.dtype) == f"torch.{w['dtype']}"
    logits = forward_logits(model, rec["prompt_ids"])
    assert rel_error(logits, torch.tensor(rec["logits_float32"])) <= 1e-6
    assert greedy_tokens(model, rec["prompt_ids"], 8) == rec["greedy_float32"]


@pytest.mark.parametrize("name", JUDGED)
def test_cpu_fast_default(name: str) -> None:
    rec = record(name)
    model = sdk.load(FIXTURES / name)
    tol = 1e-6
    if model.backend == "cpu-fast":  # AVX512F: the FP8 bytes on fp8_gemv; else bfloat16 prepacked (AVX512-BF16)
        assert model.info["cpu_fast"]["fast_layers"] == 14
        tol = 3e-2
        exact = sdk.load(FIXTURES / name, backend="reference")
        names = [w.removesuffix(".weight") for w in rec["dequantized_weights"]]
        assert assert_fast_modules_exact(model, exact, names) == 14
    assert rel_error(forward_logits(model, rec["prompt_ids"]), torch.tensor(rec["logits_float32"])) <= tol
    assert_greedy_or_near_tie(
        lambda: sdk.load(FIXTURES / name, backend="reference"),
        rec["prompt_ids"],
        rec["greedy_float32"],
        greedy_tokens(model, rec["prompt_ids"], 8),
        tol,
    )


def test_partial_blocks_read_as_deepseeks_reference() -> None:
    """A dimension not a multiple of 128 (intermediate 320): the edge blocks are short and read their block's scale,
    as DeepSeek-V3's ``weight_dequant`` (one scale per 128x128 tile of the unpadded weight)."""
    from safetensors.torch import load_file

    raw = load_file(FIXTURES / "llama_fp8_block_partial" / "model.safetensors")
    model = sdk.load(FIXTURES / "llama_fp8_block_partial", backend="reference")
    for name in ("model.layers.0.mlp.gate_proj", "model.layers.1.mlp.down_proj"):
        w, s = raw[f"{name}.weight"], raw[f"{name}.weight_scale_inv"]
        want = torch.empty(w.shape, dtype=torch.float32)
        for i in range(0, w.shape[0], 128):
            for j in range(0, w.shape[1], 128):
                want[i : i + 128, j : j + 128] = w[i : i + 128, j : j + 128].float() * s[i // 128, j // 128]
        got = model.module.get_submodule(name).dequantize()
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_scale_grid_that_disagrees_is_a_conflict(tmp_path: Path) -> None:
    """The config says 64x64 blocks; the stored scales are 128x128's grid: refused before any weight is read."""
    path = _copy(FIXTURES / "llama_fp8_block", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatConflictError, match="weight_scale_inv"):
        sdk.load(path)


def test_nan_scale_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _copy(FIXTURES / "llama_fp8_block", tmp_path / "m")
    t = load_file(path / "model.safetensors")
    t["model.layers.1.mlp.up_proj.weight_scale_inv"][0, 1] = float("nan")
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(AnyquantError, match=r"up_proj.*NaN|NaN.*up_proj|weight_scale_inv"):
        sdk.load(path, backend="reference")


def test_block_size_not_a_pair_is_a_config_error(tmp_path: Path) -> None:
    from anyquant.errors import ConfigError

    path = _copy(FIXTURES / "llama_fp8_block", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [128, "x"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="weight_block_size"):
        sdk.load(path)


@pytest.mark.parametrize("name", ["llama_fp8_block", "qwen3_fp8_block"])
def test_compiled_decode_step_runs_the_fp8_kernel(name: str) -> None:
    """cpu-fast's FP8 linears in the native decoder's compiled decode step: every layer planned, its logits the
    module path's bit for bit (where fp8_gemv has its vector path: AVX512F)."""
    from anyquant_cpu.kernels.lut import fp8_kernel_runs
    from tests.decoding import assert_step_is_module_path

    if not fp8_kernel_runs():
        pytest.skip("fp8_gemv's vector path does not run here (AVX512F)")
    model = sdk.load(FIXTURES / name, backend="cpu-fast")
    assert_step_is_module_path(model, int(model.module.config.vocab_size))
