"""AWQ dequantization: known values, and bit-for-bit judges from AutoAWQ 0.2.9 run out of process.

Peer fixtures come from ``tests/peers/autoawq_worker.py``: AutoAWQ's own
``WQLinear_GEMM.from_linear`` / ``WQLinear_GEMV.from_linear`` pack random exact
weights, and AutoAWQ's ``dequantize_gemm`` (on the GEMM packing of the same
linear) is the oracle for both layouts.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from anyquant_awq.dequant import (
    AWQ_PACK_ORDER,
    AWQ_UNPACK_ORDER,
    awq_gemv_zeros_width,
    dequantize_awq_gemm,
    dequantize_awq_gemv,
    pack_awq_gemm_cols,
    unpack_awq_gemm_cols,
)
from anyquant_runtime.packing import pack_cols
from tests.peers.catalog import GPTQMODEL_AWQ_VARIANTS, gptqmodel_awq_quantized_dir
from tests.peers.fixtures import peer_fixture_or_skip


def _signed(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _exact(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] reference: exact products in Python floats, one rounding to the scale dtype."""
    k, n = codes.shape
    rows = [
        [(int(codes[i, j]) - int(zeros[i // group, j])) * float(scales[i // group, j]) for i in range(k)]
        for j in range(n)
    ]
    return torch.tensor(rows, dtype=torch.float64).to(scales.dtype)


def _random(k: int, n: int, group: int, seed: int, dtype: torch.dtype = torch.float16):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.int32)
    scales = (torch.randn(k // group, n, generator=gen) * 0.05).to(dtype)
    return codes, zeros, scales


# --------------------------------------------------------------------------- known values


def test_orders_are_inverse() -> None:
    assert [AWQ_PACK_ORDER[i] for i in AWQ_UNPACK_ORDER] == list(range(8))


def test_interleaved_word_known_value() -> None:
    word = pack_awq_gemm_cols(torch.arange(8).reshape(1, 8))
    assert word.tolist() == [[_signed(0x75316420)]]  # nibble i holds column [0,2,4,6,1,3,5,7][i]
    assert unpack_awq_gemm_cols(word).tolist() == [list(range(8))]
    natural = pack_cols(torch.arange(8).reshape(1, 8), 4)
    assert unpack_awq_gemm_cols(natural).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]  # logical c reads nibble UNPACK[c]


@pytest.mark.parametrize("group", [8, 16, -1])
def test_gemm_matches_exact_reference(group: int) -> None:
    k, n = 32, 16
    g = k if group == -1 else group
    codes, zeros, scales = _random(k, n, g, seed=g)
    weight = dequantize_awq_gemm(pack_awq_gemm_cols(codes), pack_awq_gemm_cols(zeros), scales, group_size=group)
    assert weight.shape == (n, k) and weight.dtype == torch.float16
    assert torch.equal(weight, _exact(codes, zeros, scales, g))


def test_gemm_tiny_known_values() -> None:
    codes = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [15] * 8])
    zeros = torch.tensor([[1] * 8])
    scales = torch.tensor([[0.5] * 8], dtype=torch.float16)
    weight = dequantize_awq_gemm(pack_awq_gemm_cols(codes), pack_awq_gemm_cols(zeros), scales, group_size=2)
    assert weight[:, 0].tolist() == [-0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    assert weight[:, 1].tolist() == [7.0] * 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_dtype_follows_scales(dtype: torch.dtype) -> None:
    codes, zeros, scales = _random(32, 16, 16, seed=5, dtype=dtype)
    weight = dequantize_awq_gemm(pack_awq_gemm_cols(codes), pack_awq_gemm_cols(zeros), scales, group_size=16)
    assert weight.dtype == dtype
    assert torch.equal(weight, _exact(codes, zeros, scales, 16))


def test_missing_qzeros_means_eight() -> None:
    codes, _, scales = _random(64, 16, 32, seed=2)
    eights = torch.full((2, 16), 8)
    implicit = dequantize_awq_gemm(pack_awq_gemm_cols(codes), None, scales, group_size=32)
    explicit = dequantize_awq_gemm(pack_awq_gemm_cols(codes), pack_awq_gemm_cols(eights), scales, group_size=32)
    assert torch.equal(implicit, explicit)
    assert torch.equal(implicit, _exact(codes, eights, scales, 32))


@pytest.mark.parametrize(
    ("k", "group", "width"),
    [(256, 128, 1), (256, 64, 2), (256, 32, 4), (4096, 128, 4), (4096, 32, 16), (1024, 64, 2), (2048, 256, 1)],
)
def test_gemv_zeros_width_table(k: int, group: int, width: int) -> None:
    assert awq_gemv_zeros_width(k, group) == width


def _gemv_tensors(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int):
    """GEMV layout built from [K, N] codes: natural order along K and along groups, padded."""
    k, n = codes.shape
    width = awq_gemv_zeros_width(k, group)
    qweight = pack_cols(codes.t().contiguous(), 4)  # [N, K/8]
    padded_zeros = torch.full((n, 8 * width), 9, dtype=torch.int32)  # junk in padding
    padded_zeros[:, : k // group] = zeros.t()
    padded_scales = torch.full((n, 8 * width), 123.0, dtype=scales.dtype)  # junk in padding
    padded_scales[:, : k // group] = scales.t()
    return qweight, pack_cols(padded_zeros, 4), padded_scales


@pytest.mark.parametrize("group", [32, 64, 128])
def test_gemv_matches_exact_reference_and_ignores_padding(group: int) -> None:
    k, n = 256, 16
    codes, zeros, scales = _random(k, n, group, seed=group)
    qweight, qzeros, padded_scales = _gemv_tensors(codes, zeros, scales, group)
    assert qzeros.shape == (n, awq_gemv_zeros_width(k, group))
    weight = dequantize_awq_gemv(qweight, qzeros, padded_scales, group_size=group)
    assert weight.shape == (n, k)
    assert torch.equal(weight, _exact(codes, zeros, scales, group))


def test_argument_errors() -> None:
    codes, zeros, scales = _random(32, 16, 16, seed=0)
    with pytest.raises(ValueError, match="4-bit only"):
        dequantize_awq_gemm(pack_awq_gemm_cols(codes), pack_awq_gemm_cols(zeros), scales, bits=8, group_size=16)
    with pytest.raises(ValueError, match="multiple of group_size"):
        dequantize_awq_gemm(pack_awq_gemm_cols(codes), pack_awq_gemm_cols(zeros), scales, group_size=12)
    with pytest.raises(ValueError, match="groups"):
        dequantize_awq_gemm(pack_awq_gemm_cols(codes), pack_awq_gemm_cols(zeros), scales, group_size=8)
    with pytest.raises(ValueError, match="group_size=16"):
        awq_gemv_zeros_width(256, 16)


# --------------------------------------------------------------------------- peer: AutoAWQ

AWQ_CASES = [
    {"name": f"{layout}_g{g}_{'zp' if zp else 'nozp'}", "layout": layout, "group_size": g, "zero_point": zp}
    for layout in ("gemm", "gemv")
    for g in (-1, 32, 64, 128)
    for zp in (True, False)
]
_AWQ_BY_NAME = {case["name"]: case for case in AWQ_CASES}
_AWQ_PARAMS = {"in_features": 256, "out_features": 128, "seed": 77, "cases": AWQ_CASES}


@cache
def _awq_dir() -> Path:
    return peer_fixture_or_skip("autoawq_worker", _AWQ_PARAMS, packages=("autoawq", "torch"))


@cache
def _awq_case(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(_awq_dir() / f"{name}.safetensors"))


def _dequant(case: dict, data: dict[str, torch.Tensor], qzeros: torch.Tensor | None) -> torch.Tensor:
    fn = dequantize_awq_gemm if case["layout"] == "gemm" else dequantize_awq_gemv
    return fn(data["qweight"], qzeros, data["scales"], bits=4, group_size=case["group_size"])


@pytest.mark.peer
@pytest.mark.parametrize("name", list(_AWQ_BY_NAME))
def test_matches_autoawq_dequantize_gemm(name: str) -> None:
    case, data = _AWQ_BY_NAME[name], _awq_case(name)
    oracle = data["autoawq_dequantize_gemm"]
    ours = _dequant(case, data, data["qzeros"])
    assert ours.dtype == oracle.dtype == torch.float16
    assert torch.equal(ours, oracle.t()), "differs from AutoAWQ dequantize_gemm"


@pytest.mark.peer
@pytest.mark.parametrize("name", list(_AWQ_BY_NAME))
def test_autoawq_layout_decodes_to_the_intended_codes(name: str) -> None:
    case, data = _AWQ_BY_NAME[name], _awq_case(name)
    k, n = data["codes"].shape
    group = k if case["group_size"] == -1 else case["group_size"]
    if case["layout"] == "gemm":
        assert data["qweight"].shape == (k, n // 8) and data["scales"].shape == (k // group, n)
        assert torch.equal(data["qweight"], pack_awq_gemm_cols(data["codes"]))
        assert torch.equal(data["qzeros"], pack_awq_gemm_cols(data["zeros"]))
    else:
        width = awq_gemv_zeros_width(k, group)
        assert data["qweight"].shape == (n, k // 8) and data["qzeros"].shape == (n, width)
        assert data["scales"].shape == (n, 8 * width)
        assert torch.equal(data["qweight"], pack_cols(data["codes"].t().contiguous(), 4))
        padded = torch.zeros(n, 8 * width, dtype=torch.int32)
        padded[:, : k // group] = data["zeros"].t()
        assert torch.equal(data["qzeros"], pack_cols(padded, 4))


@pytest.mark.peer
@pytest.mark.parametrize("name", [n for n, c in _AWQ_BY_NAME.items() if not c["zero_point"]])
def test_zero_point_false_files_equal_implicit_eight(name: str) -> None:
    case, data = _AWQ_BY_NAME[name], _awq_case(name)
    assert torch.equal(_dequant(case, data, None), data["autoawq_dequantize_gemm"].t())


@pytest.mark.peer
def test_autoawq_fixture_versions() -> None:
    manifest = json.loads((_awq_dir() / "manifest.json").read_text())
    assert manifest["versions"]["autoawq"].startswith("0.2.")
    assert set(manifest["cases"]) == set(_AWQ_BY_NAME)


# --------------------------------------------------------------------------- peer: GPTQModel AWQ quantize

_GPTQMODEL_AWQ_BY_NAME = {v["name"]: v for v in GPTQMODEL_AWQ_VARIANTS}


@cache
def _gptqmodel_awq_dir() -> Path:
    return gptqmodel_awq_quantized_dir()


@pytest.mark.peer
@pytest.mark.parametrize("name", list(_GPTQMODEL_AWQ_BY_NAME))
def test_gptqmodel_awq_checkpoint_matches_its_torch_kernel(name: str) -> None:
    variant = _GPTQMODEL_AWQ_BY_NAME[name]
    vdir = _gptqmodel_awq_dir() / "quantized" / name
    config = json.loads((vdir / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["version"], config["zero_point"]) == ("awq", "gemm", not variant["sym"])
    ckpt = load_file(str(vdir / "model.safetensors"))
    oracle = load_file(str(vdir.parent.parent / "judges" / vdir.name / "gptqmodel_dequant.safetensors"))
    assert len(oracle) == 14
    for key, expected in oracle.items():
        prefix = key.removesuffix(".weight")
        qweight, qzeros, scales = (ckpt[f"{prefix}.{t}"] for t in ("qweight", "qzeros", "scales"))
        ours = dequantize_awq_gemm(qweight, qzeros, scales, bits=4, group_size=config["group_size"])
        assert ours.dtype == expected.dtype == torch.float16
        assert torch.equal(ours, expected.t()), f"{name}: {key} differs from GPTQModel AwqTorchLinear"
        if variant["sym"]:  # zero_point=False: GPTQModel still stores qzeros, every field 8
            assert unpack_awq_gemm_cols(qzeros).unique().tolist() == [8]
            assert torch.equal(dequantize_awq_gemm(qweight, None, scales, group_size=config["group_size"]), ours)
