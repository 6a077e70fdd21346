"""MLX checkpoints converted by mlx-lm 0.32.2 on mlx 0.32.4's CPU build (``make_mlx_fixtures.py``), judged by mlx:
``mx.dequantize`` of every quantized module (sha256 of its values, in mlx's own dtype) and the float32 logits and
greedy tokens of mlx-lm's ``dequantize_model`` of the same checkpoint (recorded in mlx's venv: mlx does not install
beside this project's torch on every host). mlx-lm stacks a MoE layer's experts (``switch_mlp``): anyquant serves them
as the per-expert linears of a Hugging Face checkpoint, slices of the stack."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import anyquant as sdk
from anyquant.errors import ConfigError, FormatConflictError, UnsupportedFormatError
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
STACKED = ("qwen3moe_q4_g64",)
DENSE = NAMES


def record(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def test_fixtures_present() -> None:
    want = {"llama_q2_g32", "llama_q3_g64", "llama_q4_g64", "llama_q6_g128", "llama_q8_g64", "llama_mixed"}
    assert want | {"llama_q4_tied", "qwen3_q4_g64", "llama_mxfp4", "llama_nvfp4", "llama_mxfp8"} <= set(DENSE)


@pytest.mark.parametrize("name", NAMES)
def test_detect(name: str) -> None:
    det = sdk.detect(FIXTURES / name)
    assert det.format == "mlx" and det.details["modules"] == len(record(name)["weights"])
    assert det.variant == record(name)["quantization"]["mode"] and not det.details["problems"]


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("backend", ["reference", "dequantized"])
def test_exact_backends_are_mlx(name: str, backend: str) -> None:
    """Every quantized module (linears, the embedding, the head) decodes to ``mx.dequantize``'s values; the
    logits are mlx-lm's dequantized model's in float32."""
    rec = record(name)
    model = sdk.load(FIXTURES / name, backend=backend)
    for mod_name, w in rec["weights"].items():
        if ".switch_mlp." in mod_name:
            continue  # per expert: test_stacked_experts_are_served_per_expert
        mod = model.module.get_submodule(mod_name)
        dq = mod.dequantize() if hasattr(mod, "dequantize") else mod.weight
        assert sha256_f32(dq) == w["sha256_f32"], (mod_name, dq.flatten()[:4].tolist(), w["first4"])
        assert not hasattr(mod, "dequantize") or backend == "dequantized" or str(dq.dtype) == f"torch.{w['dtype']}"
    assert rel_error(forward_logits(model, rec["prompt_ids"]), torch.tensor(rec["logits_dequantized"])) <= 1e-5
    assert greedy_tokens(model, rec["prompt_ids"], 8) == rec["greedy_dequantized"]


@pytest.mark.parametrize("name", DENSE)
def test_cpu_fast_default(name: str) -> None:
    rec = record(name)
    model = sdk.load(FIXTURES / name)
    tol = 1e-5
    if model.backend == "cpu-fast":  # Q4_1 blocks on the compiled kernel (4-bit) or bfloat16 prepacked (AVX512-BF16)
        tol = 3e-2
        exact = sdk.load(FIXTURES / name, backend="reference")
        names = [n for n in rec["weights"] if "embed_tokens" not in n and ".switch_mlp." not in n]
        assert assert_fast_modules_exact(model, exact, names) > 0
    got, want = forward_logits(model, rec["prompt_ids"]), torch.tensor(rec["logits_dequantized"])
    if name in STACKED and tol > 1e-5:
        # bfloat16 activations flip a near-tie of this tiny model's (8-bit) router at a few positions, which moves
        # those positions' logits past any per-token tolerance (docs/status.md, MoE): the typical position holds it
        per_position = (got - want).abs().amax(-1) / want.abs().max()
        assert float(per_position.median()) <= tol
    else:
        assert rel_error(got, want) <= tol
    assert_greedy_or_near_tie(
        lambda: sdk.load(FIXTURES / name, backend="reference"),
        rec["prompt_ids"],
        rec["greedy_dequantized"],
        greedy_tokens(model, rec["prompt_ids"], 8),
        tol,
    )


def test_stacked_experts_are_served_per_expert() -> None:
    """mlx-lm's ``switch_mlp`` stacks become one linear per expert; each decodes to its slice of mlx's stack."""
    rec = record("qwen3moe_q4_g64")
    model = sdk.load(FIXTURES / "qwen3moe_q4_g64", backend="reference")
    for name, w in rec["weights"].items():
        if ".switch_mlp." not in name:
            continue
        head, _, leaf = name.partition(".switch_mlp.")
        stack = torch.stack(
            [model.module.get_submodule(f"{head}.experts.{e}.{leaf}").dequantize() for e in range(w["shape"][0])]
        )
        assert sha256_f32(stack) == w["sha256_f32"], name
    assert model.info["unused_tensors"] == []


def _variant(tmp_path: Path, config: Any = None, tensors: Any = None) -> Path:
    path = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama_mixed", path)
    if config is not None:
        cfg = json.loads((path / "config.json").read_text())
        config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(path / "model.safetensors")
        tensors(t)
        save_file(t, path / "model.safetensors", metadata={"format": "mlx"})
    return path


def test_a_per_layer_entry_the_shapes_contradict(tmp_path: Path) -> None:
    """config.json says q_proj of layer 1 is 4-bit; its tensors are 3-bit: a conflict, not a guess."""

    def cfg(c: dict[str, Any]) -> None:
        for key in ("quantization", "quantization_config"):
            c[key]["model.layers.1.self_attn.q_proj"] = {"group_size": 64, "bits": 4, "mode": "affine"}

    with pytest.raises(FormatConflictError, match="q_proj"):
        sdk.load(_variant(tmp_path, config=cfg))


def test_unknown_mode_is_named(tmp_path: Path) -> None:
    def cfg(c: dict[str, Any]) -> None:
        c["quantization"]["mode"] = "tq1"

    with pytest.raises(UnsupportedFormatError, match="tq1"):
        sdk.load(_variant(tmp_path, config=cfg))


def test_bad_bits_is_a_config_error(tmp_path: Path) -> None:
    def cfg(c: dict[str, Any]) -> None:
        c["quantization"]["bits"] = 7

    with pytest.raises(ConfigError, match="bits"):
        sdk.load(_variant(tmp_path, config=cfg))


def test_nan_scale_is_refused(tmp_path: Path) -> None:
    from anyquant.errors import NumericalError

    def t(d: dict[str, torch.Tensor]) -> None:
        d["model.layers.0.mlp.up_proj.scales"][1, 0] = float("nan")

    with pytest.raises(NumericalError, match="scales"):
        sdk.load(_variant(tmp_path, tensors=t), backend="reference")


@pytest.mark.parametrize("name", ["llama_q4_tied", "llama_q4_g64", "llama_mxfp4"])
def test_quantized_tables_stay_packed_on_the_fast_backend(name: str) -> None:
    """A fast backend's embedding (and a tied head's exact table) read mlx's packed table a few rows at a time
    (``MlxRows``), each row bit for bit the decoded table's; no decoded copy of it is held, and the logits are those
    of the table decoded into memory (``cpu_fast_tables="memory"``)."""
    from anyquant_mlx.dequant import MlxRows, dequantize

    fast = sdk.load(FIXTURES / name, backend="cpu-fast")
    if fast.backend != "cpu-fast":
        pytest.skip("cpu-fast does not run here")
    table = fast.module.get_input_embeddings().file
    assert isinstance(table, MlxRows)
    tensors = load_file(FIXTURES / name / "model.safetensors")
    whole = dequantize(
        tensors["model.embed_tokens.weight"],
        tensors["model.embed_tokens.scales"],
        tensors.get("model.embed_tokens.biases"),
        table.bits,
        table.group,
        table.mode,
    )
    ids = torch.tensor([[0, 5, 17, whole.shape[0] - 1], [3, 3, 2, 1]])
    assert torch.equal(table.rows(ids), whole[ids]) and torch.equal(table.read_all(), whole)
    assert torch.equal(table.slice(5, 7), whole[5:12]) and table.nbytes < whole.numel() * whole.element_size()
    held = sdk.load(FIXTURES / name, backend="cpu-fast", cpu_fast_tables="memory")
    assert not hasattr(held.module.get_input_embeddings(), "file") or held.module.get_input_embeddings().file is None
    with torch.no_grad():
        assert torch.equal(fast.module(ids).logits, held.module(ids).logits)
