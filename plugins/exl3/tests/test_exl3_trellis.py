"""Trellis bitstream and tile layout vs literal simulations of the exllamav3 kernels (format doc §3.2-3.3)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _exl3_testlib import (
    sim_dq_tile,
    sim_pack_frac_tile,
    sim_pack_trellis_tile,
    sim_unpack_frac_tile,
)

from anyquant_exl3.trellis import (
    bits_per_weight,
    is_tail_biting,
    matrix_to_tiles,
    pack_states,
    step_bits,
    tensor_core_perm,
    tensor_core_perm_inv,
    tiles_to_matrix,
    trellis_to_words,
    unpack_states,
    words_to_trellis,
)

HALF_BITS = (1.5, 2.5, 3.5)


def _u16_to_int16(values: list[int]) -> torch.Tensor:
    return torch.tensor([v - 65536 if v >= 32768 else v for v in values], dtype=torch.int16)


def _tail_biting_states(rng: random.Random, k_bits: float) -> list[int]:
    """Random tail-biting state sequence: the windows of a random ring of 256·K bits."""
    total = int(256 * k_bits)
    ring = [rng.getrandbits(1) for _ in range(total)]
    ends, acc = [], 0
    for d in step_bits(k_bits):
        acc += d
        ends.append(acc)
    states = []
    for end in ends:
        value = 0
        for p in range(end - 16, end):
            value = (value << 1) | ring[p % total]
        states.append(value)
    return states


def test_tensor_core_perm_known_entries() -> None:
    perm = tensor_core_perm()
    assert sorted(perm.tolist()) == list(range(256))
    # t = 0: r0 = 0, c0 = 0 -> rows 0, 1, 8, 9 of columns 0 and 8
    assert perm[:8].tolist() == [0, 16, 128, 144, 8, 24, 136, 152]
    # t = 1: r0 = 2; t = 4: c0 = 1; t = 31: r0 = 6, c0 = 7
    assert perm[8] == 32 and perm[32] == 1 and perm[248] == 6 * 16 + 7
    assert torch.equal(perm[tensor_core_perm_inv()], torch.arange(256))


def test_bits_per_weight() -> None:
    assert bits_per_weight(torch.zeros(1, 1, 64, dtype=torch.int16)) == 4
    assert bits_per_weight(torch.zeros(1, 1, 40, dtype=torch.int16)) == 2.5
    for bad in (12, 20, 136):
        with pytest.raises(ValueError):
            bits_per_weight(torch.zeros(1, 1, bad, dtype=torch.int16))


def test_known_bitstream_example() -> None:
    # K = 8, only u16[1] = 0x1234 set: w[0] = 0x12340000, stream begins 0x12, 0x34, 0x00, ...
    u16 = [0] * 128
    u16[1] = 0x1234
    states = unpack_states(_u16_to_int16(u16).view(1, 1, 128))[0, 0]
    assert states[:4].tolist() == [0x0012, 0x1234, 0x3400, 0x0000]
    # tail-biting: the last state's low byte is the ring's last byte (0), state 0 takes its high byte from it
    assert states[255] == 0
    # K = 1: a single set bit at stream position 0 (MSB of w[0]) walks up through the 16-bit window
    u16 = [0] * 16
    u16[1] = 0x8000
    states = unpack_states(_u16_to_int16(u16).view(1, 1, 16))[0, 0]
    assert states[:17].tolist() == [1 << i for i in range(16)] + [0]


@pytest.mark.parametrize("k", range(1, 9))
def test_pack_matches_kernel_simulation(k: int) -> None:
    rng = random.Random(100 + k)
    tiles = [_tail_biting_states(rng, k) for _ in range(3)]
    ours = pack_states(torch.tensor(tiles, dtype=torch.int32), k)
    expected = torch.stack([_u16_to_int16(sim_pack_trellis_tile(t, k)) for t in tiles])
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("k", range(1, 9))
def test_unpack_matches_dq_simulation(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    trellis = torch.randint(-32768, 32768, (2, 2, 16 * k), dtype=torch.int16, generator=gen)
    ours = unpack_states(trellis)
    for i in range(2):
        for j in range(2):
            u16 = [v & 0xFFFF for v in trellis[i, j].tolist()]
            assert ours[i, j].tolist() == sim_dq_tile(u16, k)


@pytest.mark.parametrize("k", range(1, 9))
def test_states_are_tail_biting(k: int) -> None:
    gen = torch.Generator().manual_seed(50 + k)
    trellis = torch.randint(-32768, 32768, (3, 4, 16 * k), dtype=torch.int16, generator=gen)
    idx = unpack_states(trellis)
    # upstream tests/test_quant_fn.py::test_encode identity
    assert torch.equal(idx[..., 0] >> k, idx[..., 255] & ((1 << (16 - k)) - 1))
    # consecutive states overlap by 16 - K bits
    assert torch.equal((idx[..., :-1] << k) & 0xFFFF, idx[..., 1:] & (0xFFFF ^ ((1 << k) - 1)))
    assert bool(is_tail_biting(idx, k).all())


@pytest.mark.parametrize("k", [*range(1, 9), *HALF_BITS])
def test_pack_unpack_round_trip(k: float) -> None:
    gen = torch.Generator().manual_seed(int(10 * k))
    trellis = torch.randint(-32768, 32768, (2, 3, int(16 * k)), dtype=torch.int16, generator=gen)
    states = unpack_states(trellis)
    assert torch.equal(pack_states(states, k), trellis)
    broken = states.clone()
    broken[..., 7] ^= 0x8000  # a high bit that the previous state fixes: no longer tail-biting
    assert not bool(is_tail_biting(broken, k).any())


@pytest.mark.parametrize("k", HALF_BITS)
def test_half_integer_matches_frac_simulation(k: float) -> None:
    ka = int(k)
    rng = random.Random(int(k * 10))
    tiles = [_tail_biting_states(rng, k) for _ in range(2)]
    packed = pack_states(torch.tensor(tiles, dtype=torch.int32), k)
    assert packed.shape[-1] == 16 * k
    for t, tile in enumerate(tiles):
        assert packed[t].tolist() == _u16_to_int16(sim_pack_frac_tile(tile, ka)).tolist()
    gen = torch.Generator().manual_seed(ka)
    trellis = torch.randint(-32768, 32768, (2, int(16 * k)), dtype=torch.int16, generator=gen)
    ours = unpack_states(trellis)
    for t in range(2):
        assert ours[t].tolist() == sim_unpack_frac_tile([v & 0xFFFF for v in trellis[t].tolist()], ka)


def test_step_bits_half_integer() -> None:
    assert step_bits(2.5)[:4] == [2, 3, 2, 3]
    assert sum(step_bits(2.5)) == 640
    assert sum(step_bits(3)) == 768


def test_words_and_tiles_round_trip() -> None:
    gen = torch.Generator().manual_seed(9)
    trellis = torch.randint(-32768, 32768, (2, 2, 48), dtype=torch.int16, generator=gen)
    words = trellis_to_words(trellis)
    assert words.shape == (2, 2, 24) and int(words.min()) >= 0 and int(words.max()) < 2**32
    assert int(words[0, 0, 0]) == (int(trellis[0, 0, 0]) & 0xFFFF) | ((int(trellis[0, 0, 1]) & 0xFFFF) << 16)
    assert torch.equal(words_to_trellis(words), trellis)
    m = torch.arange(32 * 48).reshape(32, 48)
    tiles = matrix_to_tiles(m)
    assert tiles.shape == (2, 3, 256) and tiles[1, 2, 17].item() == m[16 + 1, 32 + 1].item()
    assert torch.equal(tiles_to_matrix(tiles), m)
