"""Known values of the EXL3 codebooks (format doc §3.4) and the Hadamard transform (§3.5)."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _exl3_testlib import sim_codebook

from anyquant_exl3.codebook import (
    CODEBOOK_SCALE_3INST,
    MUL1_BIAS,
    MUL1_INV,
    codebook_from_markers,
    codebook_lut,
    codebook_rms,
    codebook_values,
    normalize_codebook,
)
from anyquant_exl3.hadamard import had_left, had_right, hadamard, sylvester

CODEBOOKS = ("3inst", "mcg", "mul1")


def test_mul1_constants() -> None:
    assert MUL1_INV == 1774 * 2.0**-18
    assert MUL1_BIAS == -10.3828125


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_codebook_matches_scalar_kernel_simulation(codebook: str) -> None:
    lut = codebook_lut(codebook)
    states = [*range(0, 65536, 7), 65535]
    expected = torch.tensor([sim_codebook(s, codebook) for s in states], dtype=torch.float64)
    assert torch.equal(lut[states].double(), expected)


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_fp32_values_are_exact_and_round_once(codebook: str) -> None:
    exact = codebook_lut(codebook, fp16=False)
    assert exact.dtype == torch.float32
    assert torch.equal(exact.half(), codebook_lut(codebook))
    # the fp32 value is exact: recomputing in float64 gives the same numbers
    assert torch.equal(codebook_values(torch.arange(65536), codebook, fp16=False).double(), exact.double())


def test_hand_computed_states() -> None:
    # 3INST, state 0: x = 64248484 = 0x03D45AA4 -> & 0x8FFF8FFF = 0x03D40AA4 -> ^ 0x3B603B60 = 0x38B431C4
    lo, hi = 0x31C4, 0x38B4
    expected = (1 + 0x1C4 / 1024) * 2.0**-3 + (1 + 0xB4 / 1024) * 2.0**-1
    assert 64248484 == 0x03D45AA4 and ((0x03D45AA4 & 0x8FFF8FFF) ^ 0x3B603B60) == (hi << 16 | lo)
    assert float(codebook_values(torch.tensor([0]), "3inst", fp16=False)) == expected
    # MCG, state 0: x = 0 -> 0x3B603B60: two halves of 0.9219 -> 1.84375
    assert float(codebook_values(torch.tensor([0]), "mcg")) == 2 * (1 + 0x360 / 1024) * 2.0**-1
    # MUL1, state 0: byte sum 0 -> h = 1024 -> 1024 * k_inv + k_bias
    assert float(codebook_values(torch.tensor([0]), "mul1", fp16=False)) == 1024 * 1774 * 2.0**-18 - 10.3828125


def test_codebook_rms() -> None:
    assert abs(codebook_rms("3inst") - CODEBOOK_SCALE_3INST) < 1e-6
    assert abs(codebook_rms("3inst") - 1.2437108755) < 1e-7
    assert abs(codebook_rms("mcg") - 1.24411) < 1e-5
    assert abs(codebook_rms("mul1") - 1.00031) < 1e-5


def test_3inst_value_range() -> None:
    for codebook in ("3inst", "mcg"):
        lut = codebook_lut(codebook).float()
        assert float(lut.abs().max()) < 4.0
        assert float(lut.abs().min()) >= 0.0


def test_multiplier_override_and_markers() -> None:
    assert torch.equal(codebook_lut("mcg", multiplier=0xCBAC1FED), codebook_lut("mcg"))
    assert not torch.equal(codebook_lut("mcg", multiplier=0xFF7A83E5), codebook_lut("mcg"))
    assert codebook_from_markers() == ("3inst", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert codebook_from_markers(mcg=torch.tensor(-877912083, dtype=torch.int32)) == ("mcg", 0xCBAC1FED)
        assert codebook_from_markers(mul1=torch.tensor(-2082680531, dtype=torch.int32)) == ("mul1", 0x83DCD12D)
    with pytest.warns(UserWarning, match="locked"):
        assert codebook_from_markers(mcg=0xFF7A83E5) == ("mcg", 0xFF7A83E5)
    with pytest.raises(ValueError):
        codebook_from_markers(mcg=1, mul1=1)
    assert normalize_codebook("MUL1") == "mul1"
    with pytest.raises(ValueError):
        normalize_codebook("2mad")


# ------------------------------------------------------------------------------------------------------------
# Hadamard


def test_sylvester_entries() -> None:
    h = sylvester(128)
    for i in (0, 1, 5, 77, 127):
        for j in (0, 3, 64, 100, 127):
            assert h[i, j] == (-1) ** bin(i & j).count("1")
    h2 = sylvester(2)
    assert h2.tolist() == [[1, 1], [1, -1]]
    with pytest.raises(ValueError):
        sylvester(96)


def test_normalized_hadamard_is_symmetric_orthogonal() -> None:
    h = hadamard(128).double()
    assert torch.equal(h, h.t())
    assert float((h.abs() - 1 / math.sqrt(128)).abs().max()) < 1e-8
    assert float((h @ h - torch.eye(128, dtype=torch.float64)).abs().max()) < 1e-6
    r_scale = torch.tensor(0.08838834764831845, dtype=torch.float32)  # reconstruct_had_kernel's r_scale
    assert torch.equal(hadamard(128).abs(), r_scale.expand(128, 128))


def test_blockwise_transforms() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 384, generator=gen, dtype=torch.float64)
    h = hadamard(128, torch.float64)
    left = torch.block_diag(h, h)
    right = torch.block_diag(h, h, h)
    assert torch.allclose(had_left(x), left @ x, atol=1e-12)
    assert torch.allclose(had_right(x), x @ right, atol=1e-12)
    assert torch.allclose(had_left(had_left(x)), x, atol=1e-12)
    with pytest.raises(ValueError):
        had_left(torch.zeros(100, 128))
