"""CPU encoder: exact Viterbi recovery, tail-biting packing, regularization inverse, round-trip MSE (doc §3.6)."""

from __future__ import annotations

import itertools

import pytest
import torch

from anyquant_exl3.codebook import codebook_lut
from anyquant_exl3.dequant import decode_exl3, decode_what
from anyquant_exl3.encode import (
    encode_exl3,
    matrix_to_stream_tiles,
    regularize,
    search_global_scale,
    stream_tiles_to_matrix,
    viterbi_encode,
)
from anyquant_exl3.hadamard import had_left, had_right
from anyquant_exl3.trellis import is_tail_biting, pack_states, unpack_states

# Relative MSE on a Gaussian matrix without a Hessian, format doc §3.6: 0.0056 (3INST, K=4), 0.019 (MCG, K=3),
# 0.072 (MUL1, K=2). Bounds leave ~15% headroom.
DOC_MSE = {("3inst", 4): 0.0056, ("mcg", 3): 0.019, ("mul1", 2): 0.072}


def _rel_mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).square().mean() / b.double().square().mean())


@pytest.mark.parametrize(
    "codebook,k_bits", [("3inst", 1), ("mcg", 3), ("mul1", 2.5), ("3inst", 8), ("mul1", 5), ("mcg", 1.5)]
)
def test_viterbi_recovers_codebook_paths(codebook: str, k_bits: float) -> None:
    # tiles made of the codebook values of a random tail-biting path have a zero-error encoding: find it
    gen = torch.Generator().manual_seed(int(k_bits * 10))
    trellis = torch.randint(-32768, 32768, (3, int(16 * k_bits)), dtype=torch.int16, generator=gen)
    states = unpack_states(trellis)
    tiles = codebook_lut(codebook)[states.long()].float()
    found = viterbi_encode(tiles, k_bits, codebook)
    assert torch.equal(codebook_lut(codebook)[found.long()].float(), tiles)
    assert bool(is_tail_biting(found, k_bits).all())


def test_viterbi_is_tail_biting_on_noise() -> None:
    gen = torch.Generator().manual_seed(1)
    tiles = torch.randn(4, 256, generator=gen)
    for k_bits in (2, 3.5):
        states = viterbi_encode(tiles, k_bits, "mul1")
        assert bool(is_tail_biting(states, k_bits).all())
        assert torch.equal(unpack_states(pack_states(states, k_bits)), states)


def test_viterbi_beats_greedy_paths() -> None:
    # the optimum is no worse than the path of the tile's own best-matching trellis walk from a random start
    gen = torch.Generator().manual_seed(2)
    tiles = torch.randn(2, 256, generator=gen) * 1.2
    lut = codebook_lut("3inst").float()
    states = viterbi_encode(tiles, 2, "3inst")
    err = (lut[states.long()] - tiles).square().sum(1)
    for _ in range(3):
        trellis = torch.randint(-32768, 32768, (2, 32), dtype=torch.int16, generator=gen)
        other = unpack_states(trellis)
        assert bool((err <= (lut[other.long()] - tiles).square().sum(1)).all())


def test_stream_tile_round_trip() -> None:
    m = torch.randn(32, 48)
    tiles = matrix_to_stream_tiles(m)
    assert torch.equal(stream_tiles_to_matrix(tiles), m)
    # decode_what places stream element j of a tile the same way
    gen = torch.Generator().manual_seed(3)
    trellis = torch.randint(-32768, 32768, (2, 3, 32), dtype=torch.int16, generator=gen)
    values = codebook_lut("mcg")[unpack_states(trellis).long()]
    assert torch.equal(stream_tiles_to_matrix(values), decode_what(trellis, codebook="mcg"))


def test_regularize_is_inverted_by_decode_formula() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(256, 128, generator=gen, dtype=torch.float64).float()
    w[:, 5] = 0.0  # an all-zero output channel
    su0 = 1.0 - 2.0 * torch.randint(0, 2, (256,), generator=gen).float()
    sv0 = 1.0 - 2.0 * torch.randint(0, 2, (128,), generator=gen).float()
    target, su, sv = regularize(w, su0, sv0)
    assert float(sv[5]) == 0.0
    back = had_right(had_left(target) * su[:, None]) * sv[None, :]
    assert float((back - w).abs().max()) < 1e-4 * float(w.abs().max())
    # before the left Hadamard every row has the 3INST codebook RMS; the rotation keeps the total
    assert abs(float(target.square().mean().sqrt()) - 1.24371088) < 1e-3
    assert torch.equal(torch.sign(su), -su0)


@pytest.mark.parametrize("codebook,k_bits", sorted(DOC_MSE))
def test_round_trip_mse_matches_doc(codebook: str, k_bits: int) -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(128, 128, generator=gen)  # nn.Linear [out, in]
    enc = encode_exl3(w, k_bits, codebook=codebook, seed=1)
    assert enc["trellis"].dtype == torch.int16 and enc["trellis"].shape == (8, 8, 16 * k_bits)
    assert enc["suh"].dtype == torch.float16 and enc["svh"].dtype == torch.float16
    assert (codebook in enc) == (codebook != "3inst")
    out = decode_exl3(enc["trellis"], enc["suh"], enc["svh"], codebook=codebook, dtype=torch.float32)
    assert _rel_mse(out, w) < 1.15 * DOC_MSE[(codebook, k_bits)]


def test_padded_layer_round_trip() -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(60, 100, generator=gen) * 0.02
    enc = encode_exl3(w, 6, codebook="mcg", seed=2)
    assert enc["trellis"].shape == (8, 8, 96) and enc["mcg"].dtype == torch.int32
    out = decode_exl3(
        enc["trellis"], enc["suh"], enc["svh"], codebook="mcg", in_features=100, out_features=60, dtype=torch.float32
    )
    assert out.shape == (60, 100)
    assert _rel_mse(out, w) < 0.002


@pytest.mark.slow
def test_mse_falls_with_bits_and_scale_search() -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(128, 128, generator=gen)
    errors = []
    for k_bits in (1, 2, 3, 4, 5):
        enc = encode_exl3(w, k_bits, codebook="mul1")
        out = decode_exl3(enc["trellis"], enc["suh"], enc["svh"], codebook="mul1", dtype=torch.float32)
        errors.append(_rel_mse(out, w))
    assert all(a > 1.8 * b for a, b in itertools.pairwise(errors)), errors
    target, _, _ = regularize(w.t().contiguous(), torch.ones(128), torch.ones(128))
    g = search_global_scale(target, 2, "mul1")
    assert 0.4 < g < 1.3
    enc = encode_exl3(w, 2, codebook="mul1", g_scale="search")
    out = decode_exl3(enc["trellis"], enc["suh"], enc["svh"], codebook="mul1", dtype=torch.float32)
    assert _rel_mse(out, w) < 1.05 * errors[1]
