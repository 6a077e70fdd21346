"""anyquant_gguf.qlinear: pure-torch dequant bit-exact vs gguf numpy; GGUFLinear."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from anyquant_gguf.qlinear import PACKED_TYPES, GGUFLinear, dequantize_blocks_torch, gguf_linear_from_reader
from anyquant_gguf.reader import UnsupportedGGUFType, load_raw, load_tensor

# byte offsets of the float16 scales in each K-quant super-block
_K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_QUANTIZABLE = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
#: the legacy and K-quant types (the others: test_gguf_more_types.py)
_CLASSIC = sorted(_QUANTIZABLE | set(_K_SCALE_OFFSETS))
#: MXFP4, NVFP4, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 and the lattice IQ types (test_gguf_more_types.py)
_MORE = {Q.MXFP4, Q.NVFP4, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S}
_MORE |= {Q.IQ1_S, Q.IQ1_M}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _blocks(qtype: Q, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Realistic blocks: gguf's own quantizer where it has one, else random bytes
    with finite random float16 scales."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in _QUANTIZABLE:
        values = rng.standard_normal((rows, blocks_per_row * block_size)).astype(np.float32)
        values[0, :block_size] = 0.0  # an all-zero block (d == 0)
        return quantize(values * 0.05, qtype)
    data = rng.integers(0, 256, (rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(rows * blocks_per_row) * 0.01).astype(np.float16)
        data[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, blocks_per_row * type_size)


def _dequant_pair(data: np.ndarray, qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    with np.errstate(all="ignore"):
        reference = torch.from_numpy(np.ascontiguousarray(dequantize(data, qtype)))
    ours = dequantize_blocks_torch(torch.from_numpy(data), qtype, tuple(reference.shape))
    return ours, reference


def test_packed_types() -> None:
    assert {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K} <= PACKED_TYPES
    assert set(_CLASSIC) == {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    assert PACKED_TYPES == set(_CLASSIC) | _MORE


@pytest.mark.parametrize("qtype", _CLASSIC, ids=lambda q: q.name)
def test_bit_exact_random_blocks(qtype: Q) -> None:
    data = _blocks(qtype, rows=12, blocks_per_row=3, seed=int(qtype))
    ours, reference = _dequant_pair(data, qtype)
    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    assert torch.isfinite(reference).all()
    assert torch.equal(_bits(ours), _bits(reference))


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES), ids=lambda q: q.name)
def test_bit_exact_arbitrary_bytes(qtype: Q) -> None:
    """Any bytes at all (inf/NaN/subnormal scales): identical finite values, NaN at the
    same places (NaN payloads may differ: numpy and torch order operands differently)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(100 + int(qtype)).integers(0, 256, (16, 4 * type_size), dtype=np.uint8)
    ours, reference = _dequant_pair(data, qtype)
    nan = torch.isnan(reference)
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(_bits(ours[~nan]), _bits(reference[~nan]))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_dense_types(qtype: Q) -> None:
    values = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    data = quantize(values, qtype).view(np.uint8)
    ours, reference = _dequant_pair(np.ascontiguousarray(data), qtype)
    assert torch.equal(_bits(ours), _bits(reference.reshape(4, 8)))


def test_dequant_errors() -> None:
    with pytest.raises(UnsupportedGGUFType, match="Q1_0"):
        dequantize_blocks_torch(torch.zeros(18, dtype=torch.uint8), Q.Q1_0, (128,))
    with pytest.raises(ValueError, match="needs 40 bytes"):
        dequantize_blocks_torch(torch.zeros(39, dtype=torch.uint8), Q.Q4_1, (2, 32))
    with pytest.raises(ValueError, match="multiple"):
        dequantize_blocks_torch(torch.zeros(20, dtype=torch.uint8), Q.Q4_1, (1, 33))
    with pytest.raises(TypeError, match="uint8"):
        dequantize_blocks_torch(torch.zeros(5, dtype=torch.int8), Q.Q4_1, (32,))


@pytest.mark.model
def test_bit_exact_real_file(reader: Any) -> None:
    """The embedding (Q8_0) and every tensor of layers 0, 14 and 29 (Q4_1, F32)."""
    seen = set()
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and tensor.name.split(".")[1] not in ("0", "14", "29"):
            continue
        reference = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type)))
        raw = torch.from_numpy(tensor.data.view(np.uint8))
        ours = dequantize_blocks_torch(raw, tensor.tensor_type, tuple(reference.shape))
        assert torch.equal(_bits(ours), _bits(reference)), tensor.name
        seen.add(tensor.tensor_type)
    assert seen == {Q.Q4_1, Q.Q8_0, Q.F32}


# --------------------------------------------------------------------------- GGUFLinear


def _linear(qtype: Q = Q.Q4_0, out: int = 24, inp: int = 64, bias: bool = True, **kw: Any) -> GGUFLinear:
    data = _blocks(qtype, rows=out, blocks_per_row=inp // GGML_QUANT_SIZES[qtype][0], seed=7)
    b = torch.randn(out) if bias else None
    return GGUFLinear.from_raw(torch.from_numpy(data), qtype, (out, inp), b, **kw)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("mode", ["on-the-fly", "dequant-at-load"])
def test_gguf_linear_forward(qtype: Q, mode: str) -> None:
    inp = 512 if qtype in (Q.Q4_K, Q.Q6_K) else 64
    lin = _linear(qtype, inp=inp, mode=mode)
    assert (lin.in_features, lin.out_features) == (inp, 24)
    weight = lin.dequantize()
    assert weight.shape == (24, inp) and weight.dtype == torch.float32
    x = torch.randn(2, 5, inp)
    assert torch.equal(lin(x), F.linear(x, weight, lin.bias))
    assert (lin.weight_cache is not None) == (mode == "dequant-at-load")
    assert set(lin.state_dict()) == {"qweight", "bias"}
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    assert qtype.name in repr(lin) and mode in repr(lin)


def test_gguf_linear_modes_and_errors() -> None:
    lin = _linear(bias=False)
    x = torch.randn(3, 64)
    otf = lin(x)
    lin.set_mode("dequant-at-load")
    assert torch.equal(lin(x), otf)
    lin.set_mode("on-the-fly")
    assert lin.weight_cache is None
    with pytest.raises(ValueError, match="mode"):
        lin.set_mode("lazy")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedGGUFType, match="F32"):
        GGUFLinear.from_raw(torch.zeros(8 * 4 * 32, dtype=torch.uint8), Q.F32, (8, 32))
    with pytest.raises(UnsupportedGGUFType, match="Q8_K"):
        GGUFLinear.from_raw(torch.zeros(292, dtype=torch.uint8), Q.Q8_K, (1, 256))
    with pytest.raises(ValueError, match="qweight"):
        GGUFLinear.from_raw(torch.zeros(17, dtype=torch.uint8), Q.Q4_0, (1, 32))


@pytest.mark.model
def test_gguf_linear_from_real_file(reader: Any) -> None:
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.5.ffn_down.weight"):
        lin = gguf_linear_from_reader(reader, name)
        raw = load_raw(reader, name)
        assert (lin.out_features, lin.in_features) == raw.shape
        assert torch.equal(lin.dequantize(), load_tensor(reader, name))
    down = gguf_linear_from_reader(reader, "blk.5.ffn_down.weight")
    start = reader.data.ctypes.data
    assert start <= down.qweight.data_ptr() < start + reader.data.nbytes  # zero-copy
    x = torch.randn(1, 3, 1536)
    assert torch.equal(down(x), F.linear(x, load_tensor(reader, "blk.5.ffn_down.weight")))
    with pytest.raises(UnsupportedGGUFType, match="F32"):
        gguf_linear_from_reader(reader, "blk.0.attn_norm.weight")
