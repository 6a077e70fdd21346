"""GPTQ dequantization: known values, and bit-for-bit judges from GPTQModel 7.x run out of process.

Peer tests (``@pytest.mark.peer``) use fixtures built by ``tests/peers/gptqmodel_worker.py``:

* ``packer``: every bits x group x sym x desc_act x format combination packed by
  GPTQModel's ``TorchLinear.pack_block``/``pack_original`` on random codes, saved the
  way its writer saves it, reloaded the way its loader loads it, dequantized by
  ``TorchLinear.dequantize_weight``.
* ``quantized``: a tiny random Llama quantized by ``GPTQModel.quantize`` (16 variants,
  ``tests.peers.catalog``), dequantized by GPTQModel after ``GPTQModel.load(backend=TORCH)``.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from anyquant_gptq.dequant import (
    dequantize_gptq,
    gptq_zero_format_shown,
    gptq_zero_label_check,
    gptq_zero_points,
)
from anyquant_runtime.packing import pack_cols, pack_rows
from tests.peers.catalog import GPTQ_BF16_VARIANT, GPTQ_QUANT_VARIANTS, gptq_case_name, gptqmodel_gptq_quantized_dir
from tests.peers.fixtures import peer_fixture_or_skip


def _word(unsigned: int) -> int:
    return unsigned - (1 << 32) if unsigned >= 1 << 31 else unsigned


def _qzeros(*unsigned: int) -> torch.Tensor:
    return torch.tensor([[_word(w) for w in unsigned]], dtype=torch.int32)


# --------------------------------------------------------------------------- known values


def _python_reference(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor):
    """Exact (q - z) * s in Python floats (double), rounded once by the fp16 constructor."""
    k, n = codes.shape
    rows = [
        [(int(codes[i, j]) - int(zeros[g_idx[i], j])) * float(scales[g_idx[i], j]) for i in range(k)] for j in range(n)
    ]
    return torch.tensor(rows, dtype=torch.float64).to(scales.dtype)


def _random_layer(bits: int, k: int, n: int, groups: int, seed: int, permute: bool):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=gen, dtype=torch.int32)
    scales = (torch.randn(groups, n, generator=gen) * 0.05).half()
    g_idx = torch.arange(k, dtype=torch.int32) * groups // k
    if permute:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return codes, zeros, scales, g_idx


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    k_blocks=st.integers(1, 3),
    n_blocks=st.integers(1, 2),
    groups=st.integers(1, 4),
    seed=st.integers(0, 2**31),
    permute=st.booleans(),
)
def test_v2_matches_exact_single_rounding(
    bits: int, k_blocks: int, n_blocks: int, groups: int, seed: int, permute: bool
) -> None:
    k, n = 32 * k_blocks, 32 * n_blocks
    codes, zeros, scales, g_idx = _random_layer(bits, k, n, groups, seed, permute)
    weight = dequantize_gptq(
        pack_rows(codes, bits),
        pack_cols(zeros, bits),
        scales,
        g_idx,
        bits=bits,
        sym=False,
        checkpoint_format="gptq_v2",
    )
    assert weight.shape == (n, k) and weight.dtype == torch.float16
    assert torch.equal(weight, _python_reference(codes, zeros, scales, g_idx.long()))


def test_tiny_known_layer() -> None:
    # K=8 inputs, N=8 outputs, 4-bit, 2 groups, v2 zeros.
    codes = torch.arange(64, dtype=torch.int32).reshape(8, 8) % 16
    zeros = torch.tensor([[8] * 8, [3] * 8], dtype=torch.int32)
    scales = torch.tensor([[0.5] * 8, [0.25] * 8], dtype=torch.float16)
    g_idx = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)
    weight = dequantize_gptq(
        pack_rows(codes, 4), pack_cols(zeros, 4), scales, g_idx, bits=4, sym=False, checkpoint_format="gptq_v2"
    )
    # weight[n, k]; input row k=0 has codes 0..7, group 0 (z=8, s=0.5)
    assert weight[:, 0].tolist() == [(c - 8) * 0.5 for c in range(8)]
    # input row k=5 has codes (40..47) % 16 = 8..15, group 1 (z=3, s=0.25)
    assert weight[:, 5].tolist() == [(c - 3) * 0.25 for c in range(8, 16)]


def test_g_idx_is_a_gather_not_a_range() -> None:
    codes, zeros, scales, _ = _random_layer(4, 64, 32, 4, 1, False)
    g_idx = torch.tensor([(7 * i) % 4 for i in range(64)], dtype=torch.int32)
    weight = dequantize_gptq(
        pack_rows(codes, 4), pack_cols(zeros, 4), scales, g_idx, bits=4, sym=False, checkpoint_format="gptq_v2"
    )
    assert torch.equal(weight, _python_reference(codes, zeros, scales, g_idx.long()))
    ranged = dequantize_gptq(
        pack_rows(codes, 4), pack_cols(zeros, 4), scales, None, bits=4, sym=False, checkpoint_format="gptq_v2"
    )
    assert not torch.equal(weight, ranged)
    assert torch.equal(ranged, _python_reference(codes, zeros, scales, torch.arange(64) // 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_dtype_follows_scales(dtype: torch.dtype) -> None:
    codes, zeros, scales, g_idx = _random_layer(8, 32, 32, 2, 3, True)
    scales = scales.to(dtype)
    weight = dequantize_gptq(
        pack_rows(codes, 8), pack_cols(zeros, 8), scales, g_idx, bits=8, sym=False, checkpoint_format="gptq_v2"
    )
    assert weight.dtype == dtype
    assert torch.equal(weight, _python_reference(codes, zeros, scales, g_idx.long()))


def test_v1_carry_example_from_format_doc() -> None:
    """Stored v1 fields [15, 3]: packed-word add gives [0, 5], per field masked [0, 4]."""
    qzeros = pack_cols(torch.tensor([[15, 3, 7, 7, 7, 7, 7, 7]]), 4)
    common = {"bits": 4, "checkpoint_format": "gptq"}
    assert gptq_zero_points(qzeros, **common)[0, :2].tolist() == [0, 5]
    assert gptq_zero_points(qzeros, zero_convention="per_field_masked", **common)[0, :2].tolist() == [0, 4]
    assert gptq_zero_points(qzeros, zero_convention="per_field", **common)[0, :2].tolist() == [16, 4]


def test_v1_top_field_carry_is_dropped() -> None:
    qzeros = _qzeros(0xF7777777)  # top nibble 15: its +1 carries out of the word
    zeros = gptq_zero_points(qzeros, bits=4, checkpoint_format="gptq")
    assert zeros[0].tolist() == [8] * 7 + [0]


@pytest.mark.parametrize(
    ("bits", "v1_word", "v2_word", "zero"),
    [(2, 0x55555555, 0xAAAAAAAA, 2), (4, 0x77777777, 0x88888888, 8), (8, 0x7F7F7F7F, 0x80808080, 128)],
)
def test_symmetric_words_decode_the_same_everywhere(bits: int, v1_word: int, v2_word: int, zero: int) -> None:
    for convention in ("gptqmodel", "per_field_masked", "per_field"):
        v1 = gptq_zero_points(_qzeros(v1_word), bits=bits, checkpoint_format="gptq", zero_convention=convention)
        assert v1.unique().tolist() == [zero]
    assert gptq_zero_points(_qzeros(v2_word), bits=bits, checkpoint_format="gptq_v2").unique().tolist() == [zero]
    implicit = gptq_zero_points(
        _qzeros(0), bits=bits, checkpoint_format="gptq", zero_convention="implicit_symmetric", sym=True
    )
    assert implicit.unique().tolist() == [zero]


def test_three_bit_v1_is_per_field() -> None:
    fields = torch.tensor([[7, 3] + [3] * 30])  # stored v1: 7 -> (7+1)&7 = 0, 3 -> 4
    zeros = gptq_zero_points(pack_cols(fields, 3), bits=3, checkpoint_format="gptq")
    assert zeros[0, :3].tolist() == [0, 4, 4]


def test_label_check() -> None:
    assert gptq_zero_format_shown(_qzeros(0x77777777), 4) == "gptq"
    assert gptq_zero_format_shown(_qzeros(0x88888888), 4) == "gptq_v2"
    assert gptq_zero_format_shown(_qzeros(0x78777777), 4) is None
    assert gptq_zero_label_check(_qzeros(0x77777777), 4, "gptq") is None
    assert gptq_zero_label_check(_qzeros(0x88888888), 4, "gptq") == "gptq_v2"
    assert gptq_zero_label_check(_qzeros(0x77777777), 4, "gptq_v2") == "gptq"
    assert gptq_zero_label_check(_qzeros(0x12345678), 4, "gptq") is None
    assert gptq_zero_label_check(_qzeros(0x7F7F7F7F), 8, "gptq_v2") == "gptq"
    assert gptq_zero_label_check(_qzeros(0xAAAAAAAA), 2, "gptq") == "gptq_v2"
    three_v1 = pack_cols(torch.full((1, 32), 3), 3)
    assert gptq_zero_label_check(three_v1, 3, "gptq_v2") == "gptq"
    assert gptq_zero_label_check(pack_cols(torch.full((1, 32), 4), 3), 3, "gptq") == "gptq_v2"
    padded = pack_cols(torch.tensor([[8] * 4]), 4)  # 4 real columns, 4 zero padding fields
    assert gptq_zero_format_shown(padded, 4) is None
    assert gptq_zero_format_shown(padded, 4, out_features=4) == "gptq_v2"


def test_argument_errors() -> None:
    codes, zeros, scales, g_idx = _random_layer(4, 32, 32, 2, 0, False)
    args = (pack_rows(codes, 4), pack_cols(zeros, 4), scales)
    with pytest.raises(ValueError, match="checkpoint_format"):
        dequantize_gptq(*args, g_idx, bits=4, sym=True, checkpoint_format="marlin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="zero_convention"):
        dequantize_gptq(*args, g_idx, bits=4, sym=True, checkpoint_format="gptq", zero_convention="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sym=True"):
        dequantize_gptq(*args, g_idx, bits=4, sym=None, checkpoint_format="gptq", zero_convention="implicit_symmetric")
    with pytest.raises(ValueError, match="packed rows"):
        dequantize_gptq(*args, g_idx[:-8], bits=4, sym=True, checkpoint_format="gptq")
    with pytest.raises(ValueError, match="g_idx has"):
        dequantize_gptq(*args, g_idx[:-1], bits=4, sym=True, checkpoint_format="gptq", in_features=32)
    with pytest.raises(ValueError, match="g_idx values"):
        dequantize_gptq(*args, g_idx + 5, bits=4, sym=True, checkpoint_format="gptq")
    with pytest.raises(ValueError, match="unsupported bit width"):
        dequantize_gptq(*args, g_idx, bits=5, sym=True, checkpoint_format="gptq")


def test_v1_word_add_inverts_gptqmodel_word_subtract() -> None:
    """GPTQModel saves v1 by subtracting 0x11111111 from each word; z=0 borrows from its neighbour."""
    zeros = torch.zeros(1, 8, dtype=torch.int32)
    zeros[0, 1] = 5
    stored = pack_cols(zeros, 4).to(torch.int64) - 0x11111111  # GPTQModel's v2 -> v1 save
    stored = torch.where(stored < -(2**31), stored + 2**32, stored).to(torch.int32)
    assert gptq_zero_points(stored, bits=4, checkpoint_format="gptq")[0].tolist() == zeros[0].tolist()
    masked = gptq_zero_points(stored, bits=4, checkpoint_format="gptq", zero_convention="per_field_masked")
    assert masked[0].tolist() != zeros[0].tolist()


# --------------------------------------------------------------------------- peer: GPTQModel packers

_PACKER_SHAPE = {"in_features": 256, "out_features": 128}


PACKER_CASES = [
    {"name": gptq_case_name(b, g, s, d, f), "bits": b, "group_size": g, "sym": s, "desc_act": d, "format": f}
    for b in (2, 3, 4, 8)
    for g in (-1, 32, 64, 128)
    for s in (True, False)
    for d in (False, True)
    for f in ("gptq", "gptq_v2")
]
_PACKER_BY_NAME = {case["name"]: case for case in PACKER_CASES}
_PACKER_PARAMS = {"mode": "packer", "seed": 1234, "cases": PACKER_CASES, **_PACKER_SHAPE}


@cache
def _packer_dir() -> Path:
    return peer_fixture_or_skip("gptqmodel_worker", _PACKER_PARAMS, packages=("gptqmodel", "torch"))


@cache
def _packer_case(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(_packer_dir() / f"{name}.safetensors"))


def _ours_from_ckpt(case: dict[str, Any], data: dict[str, torch.Tensor], **kwargs: Any) -> torch.Tensor:
    return dequantize_gptq(
        data["ckpt_qweight"],
        data["ckpt_qzeros"],
        data["ckpt_scales"],
        data["ckpt_g_idx"],
        bits=case["bits"],
        sym=case["sym"],
        checkpoint_format=case["format"],
        **kwargs,
    )


@pytest.mark.peer
@pytest.mark.parametrize("name", list(_PACKER_BY_NAME))
def test_packer_dequant_matches_torchlinear(name: str) -> None:
    case, data = _PACKER_BY_NAME[name], _packer_case(name)
    ours = _ours_from_ckpt(case, data)
    assert ours.dtype == data["dequant_eval"].dtype == torch.float16
    assert torch.equal(ours, data["dequant_eval"].t()), "differs from TorchLinear.dequantize_weight (eval path)"
    assert torch.equal(ours, data["dequant_generic"].t()), "differs from PackableQuantLinear.dequantize_weight"


@pytest.mark.peer
@pytest.mark.parametrize("name", list(_PACKER_BY_NAME))
def test_packer_layout_matches_our_pack(name: str) -> None:
    case, data = _PACKER_BY_NAME[name], _packer_case(name)
    bits = case["bits"]
    assert torch.equal(pack_rows(data["codes"], bits), data["qweight_pack_block"])
    assert torch.equal(pack_rows(data["codes"], bits), data["qweight_pack_original"])
    assert torch.equal(pack_cols(data["zeros"], bits), data["qzeros_pack_block_v2"])
    assert torch.equal(pack_cols(data["zeros"], bits), data["qzeros_pack_original_v2"])
    assert torch.equal(data["ckpt_qweight"], data["qweight_pack_block"])


@pytest.mark.peer
@pytest.mark.parametrize("name", list(_PACKER_BY_NAME))
def test_packer_zero_points_recover_true_zeros(name: str) -> None:
    case, data = _PACKER_BY_NAME[name], _packer_case(name)
    zeros = gptq_zero_points(
        data["ckpt_qzeros"],
        bits=case["bits"],
        checkpoint_format=case["format"],
        out_features=_PACKER_SHAPE["out_features"],
    )
    assert torch.equal(zeros, data["zeros"])
    assert torch.equal(pack_cols(zeros, case["bits"]), data["qzeros_loaded_v2"])


@pytest.mark.peer
@pytest.mark.parametrize("name", [n for n, c in _PACKER_BY_NAME.items() if c["format"] == "gptq"])
def test_packer_per_field_convention_matches_model_dequant(name: str) -> None:
    """GPTQModel's utils/model_dequant.py decodes v1 per field, masked."""
    case, data = _PACKER_BY_NAME[name], _packer_case(name)
    zeros = gptq_zero_points(
        data["ckpt_qzeros"],
        bits=case["bits"],
        checkpoint_format="gptq",
        zero_convention="per_field_masked",
        out_features=_PACKER_SHAPE["out_features"],
    )
    assert torch.equal(zeros, data["zeros_model_dequant"])
    if case["sym"] or case["bits"] == 3:
        assert torch.equal(zeros, data["zeros"])


@pytest.mark.peer
@pytest.mark.parametrize("name", [n for n, c in _PACKER_BY_NAME.items() if c["sym"]])
def test_packer_symmetric_label_check(name: str) -> None:
    case, data = _PACKER_BY_NAME[name], _packer_case(name)
    other = "gptq_v2" if case["format"] == "gptq" else "gptq"
    assert gptq_zero_format_shown(data["ckpt_qzeros"], case["bits"]) == case["format"]
    assert gptq_zero_label_check(data["ckpt_qzeros"], case["bits"], case["format"]) is None
    assert gptq_zero_label_check(data["ckpt_qzeros"], case["bits"], other) == case["format"]


# --------------------------------------------------------------------------- peer: GPTQModel.quantize

_QUANT_BY_NAME = {v["name"]: v for v in GPTQ_QUANT_VARIANTS}


@cache
def _quant_dir() -> Path:
    return gptqmodel_gptq_quantized_dir()


def _variant_files(name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    vdir = _quant_dir() / "quantized" / name
    config = json.loads((vdir / "quantize_config.json").read_text())
    return config, load_file(str(vdir / "model.safetensors")), vdir


def _ours_for_module(config: dict[str, Any], ckpt: dict[str, torch.Tensor], prefix: str, **kw: Any) -> torch.Tensor:
    scales = ckpt[f"{prefix}.scales"]
    return dequantize_gptq(
        ckpt[f"{prefix}.qweight"],
        ckpt[f"{prefix}.qzeros"],
        kw.pop("scales", scales),
        ckpt[f"{prefix}.g_idx"],
        bits=config["bits"],
        sym=config["sym"],
        checkpoint_format=config["checkpoint_format"],
        **kw,
    )


@pytest.mark.peer
@pytest.mark.parametrize("name", list(_QUANT_BY_NAME))
def test_quantized_checkpoint_matches_torchlinear(name: str) -> None:
    variant = _QUANT_BY_NAME[name]
    config, ckpt, vdir = _variant_files(name)
    assert (config["bits"], config["group_size"], config["sym"], config["desc_act"]) == (
        variant["bits"],
        variant["group_size"],
        variant["sym"],
        variant["desc_act"],
    )
    assert config["checkpoint_format"] == variant["format"]
    assert config["meta"]["quantizer"][0].startswith("gptqmodel:")
    oracle = load_file(str(vdir.parent.parent / "judges" / vdir.name / "gptqmodel_dequant.safetensors"))
    assert len(oracle) == 14  # 7 linears x 2 layers
    for key, expected in oracle.items():
        ours = _ours_for_module(config, ckpt, key.removesuffix(".weight"))
        assert ours.dtype == expected.dtype == torch.float16
        assert torch.equal(ours, expected.t()), f"{name}: {key} differs from GPTQModel TorchLinear"


@pytest.mark.peer
@pytest.mark.parametrize("name", [n for n, v in _QUANT_BY_NAME.items() if v["sym"]])
def test_quantized_symmetric_label_matches_content(name: str) -> None:
    config, ckpt, _ = _variant_files(name)
    for key in (k for k in ckpt if k.endswith(".qzeros")):
        assert gptq_zero_format_shown(ckpt[key], config["bits"]) == config["checkpoint_format"]
        assert gptq_zero_label_check(ckpt[key], config["bits"], config["checkpoint_format"]) is None


@pytest.mark.peer
def test_quantized_bf16_load_casts_scales_before_dequant() -> None:
    """GPTQModel loaded with dtype=bf16 holds bf16 scales; we match it by passing bf16 scales."""
    config, ckpt, vdir = _variant_files(GPTQ_BF16_VARIANT)
    manifest = json.loads((_quant_dir() / "manifest.json").read_text())
    modules = manifest["variants"][GPTQ_BF16_VARIANT]["bf16_modules"]
    assert {info["scales_dtype"] for info in modules.values()} == {"torch.bfloat16"}
    oracle = load_file(str(vdir.parent.parent / "judges" / vdir.name / "gptqmodel_dequant_bf16.safetensors"))
    mismatched_after_cast = 0
    for key, expected in oracle.items():
        prefix = key.removesuffix(".weight")
        ours = _ours_for_module(config, ckpt, prefix, scales=ckpt[f"{prefix}.scales"].to(torch.bfloat16))
        assert torch.equal(ours, expected.t()), key
        fp16_then_cast = _ours_for_module(config, ckpt, prefix).to(torch.bfloat16)
        mismatched_after_cast += int((fp16_then_cast != expected.t()).sum())
    assert mismatched_after_cast > 0  # the two bf16 paths are genuinely different
