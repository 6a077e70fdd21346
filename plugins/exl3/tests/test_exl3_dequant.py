"""Decoder structure: known values, chunking, padding, layouts, legacy sign vectors, step precision."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _exl3_testlib import random_layer, sim_codebook

from anyquant_exl3.codebook import codebook_lut
from anyquant_exl3.dequant import decode_exl3, decode_states, decode_what, unpack_signs
from anyquant_exl3.hadamard import had_left, had_right
from anyquant_exl3.trellis import tensor_core_perm


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_all_zero_trellis_known_weight(codebook: str) -> None:
    # every state is 0, so Ŵ = c·J with c = cb(0); H·J·H = 128·e0·e0ᵀ per 128-block pair
    trellis = torch.zeros(8, 16, 48, dtype=torch.int16)  # 128 x 256, K = 3
    suh = torch.full((128,), 0.5, dtype=torch.float16)
    svh = torch.full((256,), 2.0, dtype=torch.float16)
    w = decode_exl3(trellis, suh, svh, codebook=codebook, dtype=torch.float32, layout="exl3")
    c = sim_codebook(0, codebook)
    expected = torch.zeros(128, 256)
    expected[0, 0] = expected[0, 128] = c * 128 * 0.5 * 2.0
    assert float((w - expected).abs().max()) < 1e-6 * abs(expected[0, 0].item()) + 1e-6


def test_what_scatter_known_position() -> None:
    # a single non-zero state at stream index j of tile (1, 2) lands at row-major perm[j] of that tile
    k_bits = 8
    trellis = torch.zeros(2, 3, 16 * k_bits, dtype=torch.int16)
    trellis[1, 2, 1] = 0x00FF  # w[0] = 0x00FF0000: stream byte 1 = 0xFF -> state 1 = 0x00FF, state 2 = 0xFF00
    states = decode_states(trellis)
    assert states[1, 2, :4].tolist() == [0, 0xFF, 0xFF00, 0]
    what = decode_what(trellis, codebook="mcg")
    lut = codebook_lut("mcg")
    perm = tensor_core_perm()
    for j, state in ((1, 0xFF), (2, 0xFF00)):
        r, c = divmod(int(perm[j]), 16)
        assert what[16 + r, 32 + c] == lut[state]
    assert int((what != lut[0]).sum()) == 2


@pytest.mark.parametrize("k_bits", [1, 4, 8, 2.5])
def test_chunking_is_exact(k_bits: float) -> None:
    layer = random_layer(5, 512, 256, k_bits, "mul1")
    full = decode_exl3(layer["trellis"], layer["suh"], layer["svh"], codebook="mul1", chunk_rows=10**6)
    for rows in (128, 256, 300, None):
        part = decode_exl3(layer["trellis"], layer["suh"], layer["svh"], codebook="mul1", chunk_rows=rows)
        assert torch.equal(part, full)
    assert torch.equal(
        decode_what(layer["trellis"], codebook="mul1", chunk_rows=128), decode_what(layer["trellis"], codebook="mul1")
    )


def test_padding_trim_and_layouts() -> None:
    layer = random_layer(6, 384, 256, 4, "3inst")
    args = (layer["trellis"], layer["suh"], layer["svh"])
    full = decode_exl3(*args, codebook="3inst", layout="exl3")
    assert full.shape == (384, 256) and full.dtype == torch.float16
    trimmed = decode_exl3(*args, codebook="3inst", in_features=300, out_features=130)
    assert trimmed.shape == (130, 300)
    assert torch.equal(trimmed, full[:300, :130].t())
    trimmed_exl3 = decode_exl3(
        *args, codebook="3inst", in_features=300, out_features=130, layout="exl3", chunk_rows=128
    )
    assert torch.equal(trimmed_exl3, trimmed.t())
    with pytest.raises(ValueError):
        decode_exl3(*args, codebook="3inst", in_features=385)


def test_matches_dense_formula() -> None:
    layer = random_layer(7, 256, 384, 3, "mcg")
    what = decode_what(layer["trellis"], codebook="mcg").double()
    hl = had_left(torch.eye(256, dtype=torch.float64))
    hr = had_right(torch.eye(384, dtype=torch.float64))
    dense = torch.diag(layer["suh"].double()) @ hl @ what @ hr @ torch.diag(layer["svh"].double())
    ours = decode_exl3(layer["trellis"], layer["suh"], layer["svh"], codebook="mcg", dtype=torch.float32)
    assert float((ours.double() - dense.t()).abs().max()) < 1e-5 * float(dense.abs().max())


def test_fp16_output_is_rounded_fp32() -> None:
    layer = random_layer(8, 128, 128, 5, "3inst")
    args = (layer["trellis"], layer["suh"], layer["svh"])
    w32 = decode_exl3(*args, codebook="3inst", dtype=torch.float32)
    assert torch.equal(decode_exl3(*args, codebook="3inst"), w32.half())


def test_library_steps_round_each_stage() -> None:
    layer = random_layer(9, 256, 256, 4, "mul1")
    args = (layer["trellis"], layer["suh"], layer["svh"])
    lib = decode_exl3(*args, codebook="mul1", steps="library", dtype=torch.float32)
    fp32 = decode_exl3(*args, codebook="mul1", dtype=torch.float32)
    assert torch.equal(lib.half().float(), lib)  # every output is an fp16 value
    what = decode_what(layer["trellis"], codebook="mul1").float()
    x = had_left(what).half().float()
    x = (x * layer["suh"].float()[:, None]).half().float()
    x = had_right(x).half().float()
    x = (x * layer["svh"].float()[None, :]).half().float()
    assert torch.equal(lib, x.t())
    assert not torch.equal(lib, fp32)
    assert float((lib - fp32).abs().max()) < 4e-3 * float(fp32.abs().max())


def test_legacy_sign_vectors() -> None:
    # bit i of word w -> element 16w + i, set bit -> -1
    assert unpack_signs(torch.tensor([0x0001, -32768], dtype=torch.int16)).tolist() == (
        [-1.0] + [1.0] * 15 + [1.0] * 15 + [-1.0]
    )
    gen = torch.Generator().manual_seed(11)
    layer = random_layer(10, 256, 128, 2, "3inst")
    su_signs = torch.randint(0, 2, (256,), generator=gen)
    sv_signs = torch.randint(0, 2, (128,), generator=gen)

    def pack(bits: torch.Tensor) -> torch.Tensor:
        words = (bits.view(-1, 16) << torch.arange(16)).sum(-1)
        return ((words ^ 0x8000) - 0x8000).to(torch.int16)

    su, sv = pack(su_signs), pack(sv_signs)
    suh = (1 - 2 * su_signs).half()
    svh = (1 - 2 * sv_signs).half()
    legacy = decode_exl3(layer["trellis"], None, None, su=su, sv=sv, codebook="3inst")
    assert torch.equal(legacy, decode_exl3(layer["trellis"], suh, svh, codebook="3inst"))
    # suh/svh win over su/sv when both are present (as in exllamav3's LinearEXL3.__init__)
    both = decode_exl3(layer["trellis"], layer["suh"], layer["svh"], su=su, sv=sv, codebook="3inst")
    assert torch.equal(both, decode_exl3(layer["trellis"], layer["suh"], layer["svh"], codebook="3inst"))
    with pytest.raises(ValueError):
        decode_exl3(layer["trellis"], None, layer["svh"], codebook="3inst")


@pytest.mark.parametrize("k_bits", [1.5, 2.5, 3.5])
def test_half_integer_decode(k_bits: float) -> None:
    layer = random_layer(12, 128, 256, k_bits, "mul1")
    assert layer["trellis"].shape[-1] == int(16 * k_bits)
    w = decode_exl3(layer["trellis"], layer["suh"], layer["svh"], codebook="mul1", dtype=torch.float32)
    states = decode_states(layer["trellis"], order="row_major")
    what = decode_what(layer["trellis"], codebook="mul1")
    assert torch.equal(what[:16, :16].reshape(-1), codebook_lut("mul1")[states[0, 0].long()])
    assert w.shape == (256, 128) and torch.isfinite(w).all()


def test_input_validation() -> None:
    layer = random_layer(13, 128, 128, 2)
    with pytest.raises(TypeError):
        decode_exl3(layer["trellis"].int(), layer["suh"], layer["svh"], codebook="3inst")
    with pytest.raises(ValueError):
        decode_exl3(layer["trellis"][0], layer["suh"], layer["svh"], codebook="3inst")
    with pytest.raises(ValueError):
        decode_exl3(layer["trellis"], layer["suh"][:64], layer["svh"], codebook="3inst")
    with pytest.raises(ValueError):
        decode_exl3(layer["trellis"], layer["suh"], layer["svh"], codebook="2mad")
    with pytest.raises(ValueError):
        decode_exl3(layer["trellis"][:4], layer["suh"][:64], layer["svh"], codebook="3inst")
