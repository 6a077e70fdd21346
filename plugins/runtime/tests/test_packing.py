"""Tests for anyquant_runtime.packing: known words, an independent big-int model, round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anyquant_runtime.packing import (
    pack_bits,
    pack_cols,
    pack_rows,
    packed_length,
    to_int32_words,
    unpack_bits,
    unpack_cols,
    unpack_rows,
    wrapping_add_int32,
)

BITS = (2, 3, 4, 8)


def _signed(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _reference_pack(codes: list[int], bits: int) -> list[int]:
    """Independent model: one little-endian big integer, cut into 32-bit words."""
    stream = sum(code << (bits * i) for i, code in enumerate(codes))
    count = -(-len(codes) * bits // 32)
    return [_signed((stream >> (32 * w)) & 0xFFFFFFFF) for w in range(count)]


def _words(*unsigned: int) -> list[int]:
    return [_signed(w) for w in unsigned]


@pytest.mark.parametrize(
    ("bits", "codes", "expected"),
    [
        (4, list(range(8)), _words(0x76543210)),
        (4, [15] * 8, _words(0xFFFFFFFF)),
        (4, [7] * 8, _words(0x77777777)),
        (4, [8] * 8, _words(0x88888888)),
        (2, [1] * 16, _words(0x55555555)),
        (2, [2] * 16, _words(0xAAAAAAAA)),
        (8, [1, 2, 3, 4], _words(0x04030201)),
        (8, [0x7F] * 4, _words(0x7F7F7F7F)),
        (3, [0] * 10 + [7] + [0] * 21, _words(0xC0000000, 0x00000001, 0x0)),
        (3, [0] * 21 + [7] + [0] * 10, _words(0x0, 0x80000000, 0x00000003)),
        (3, [1] * 10 + [0] * 22, _words(0x09249249, 0x0, 0x0)),
        (3, [0] * 11 + [1] * 10 + [0] * 11, _words(0x0, 0x12492492, 0x0)),
        (3, [0] * 22 + [1] * 10, _words(0x0, 0x0, 0x24924924)),
    ],
)
def test_known_words(bits: int, codes: list[int], expected: list[int]) -> None:
    packed = pack_cols(torch.tensor([codes]), bits)
    assert packed.dtype == torch.int32
    assert packed[0].tolist() == expected
    assert unpack_cols(torch.tensor([expected], dtype=torch.int32), bits, count=len(codes))[0].tolist() == codes


def test_three_bit_scheme_table() -> None:
    """10-1-10-1-10: every code position lands where GPTQ_AWQ.md section 2.3 says."""
    for index in range(32):
        codes = [0] * 32
        codes[index] = 0b101
        words = [w & 0xFFFFFFFF for w in pack_cols(torch.tensor([codes]), 3)[0].tolist()]
        if index < 10:
            assert words == [0b101 << (3 * index), 0, 0]
        elif index == 10:
            assert words == [0b01 << 30, 0b1, 0]
        elif index < 21:
            assert words == [0, 0b101 << (1 + 3 * (index - 11)), 0]
        elif index == 21:
            assert words == [0, 0b1 << 31, 0b10]
        else:
            assert words == [0, 0, 0b101 << (2 + 3 * (index - 22))]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), bits=st.sampled_from(BITS), rows=st.integers(1, 4), length=st.integers(1, 100))
def test_pack_cols_matches_bigint_model(data: st.DataObject, bits: int, rows: int, length: int) -> None:
    codes = [
        data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=length, max_size=length)) for _ in range(rows)
    ]
    packed = pack_cols(torch.tensor(codes), bits)
    assert packed.shape == (rows, packed_length(length, bits))
    assert packed.tolist() == [_reference_pack(row, bits) for row in codes]
    assert unpack_cols(packed, bits, count=length).tolist() == codes


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(BITS), blocks=st.integers(1, 4), cols=st.integers(1, 9), seed=st.integers(0, 2**31))
def test_unpack_then_pack_is_identity_on_any_words(bits: int, blocks: int, cols: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31, (blocks * bits, cols), generator=gen, dtype=torch.int64).to(torch.int32)
    codes = unpack_rows(words, bits)
    assert codes.shape == (blocks * 32, cols)
    assert int(codes.min()) >= 0 and int(codes.max()) < 1 << bits
    assert torch.equal(pack_rows(codes, bits), words)
    assert torch.equal(pack_cols(unpack_cols(words.t(), bits), bits), words.t())


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from(BITS), k=st.integers(1, 70), n=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_rows_and_cols_agree_by_transpose(bits: int, k: int, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)
    rows = pack_rows(codes, bits)
    assert rows.shape == (packed_length(k, bits), n)
    assert torch.equal(rows, pack_cols(codes.t(), bits).t())
    assert torch.equal(unpack_rows(rows, bits, count=k), codes)


def test_unpack_without_count_pads_with_zero_codes() -> None:
    codes = torch.tensor([[5, 6, 7]])
    packed = pack_cols(codes, 3)
    assert packed.shape == (1, 1)
    full = unpack_cols(packed, 3)
    assert full.shape == (1, 32)
    assert full[0, :3].tolist() == [5, 6, 7] and int(full[0, 3:].abs().sum()) == 0


def test_pack_bits_any_dim_and_batch() -> None:
    codes = torch.randint(0, 16, (2, 16, 3), generator=torch.Generator().manual_seed(0))
    packed = pack_bits(codes, 4, dim=1)
    assert packed.shape == (2, 2, 3)
    assert torch.equal(unpack_bits(packed, 4, dim=1), codes.to(torch.int32))
    assert torch.equal(packed[1], pack_rows(codes[1], 4))


def test_unpack_accepts_int64_words_as_unsigned() -> None:
    words = torch.tensor([[0xFFFFFFFF, 0x80000000]], dtype=torch.int64)
    assert unpack_cols(words, 4)[0].tolist() == [15] * 8 + [0] * 7 + [8]


def test_wrapping_add_carries_and_wraps() -> None:
    words = torch.tensor(_words(0x0000000F, 0xFFFFFFFF, 0x7FFFFFFF), dtype=torch.int32)
    assert wrapping_add_int32(words, 1).tolist() == _words(0x10, 0x0, 0x80000000)
    assert to_int32_words(torch.tensor([2**32 + 5, 2**31])).tolist() == [5, -(2**31)]


@pytest.mark.parametrize("bits", [1, 5, 6, 7, 16])
def test_unsupported_bits_raise(bits: int) -> None:
    with pytest.raises(ValueError, match="unsupported bit width"):
        pack_cols(torch.zeros(1, 32, dtype=torch.int32), bits)
    with pytest.raises(ValueError, match="unsupported bit width"):
        unpack_cols(torch.zeros(1, 4, dtype=torch.int32), bits)


def test_out_of_range_and_float_codes_raise() -> None:
    with pytest.raises(ValueError, match="codes must lie"):
        pack_cols(torch.tensor([[16]]), 4)
    with pytest.raises(ValueError, match="codes must lie"):
        pack_rows(torch.tensor([[-1]]), 2)
    with pytest.raises(TypeError):
        pack_cols(torch.tensor([[1.0]]), 4)
    with pytest.raises(TypeError):
        unpack_cols(torch.tensor([[1.0]]), 4)
    with pytest.raises(ValueError, match="only"):
        unpack_cols(torch.zeros(1, 1, dtype=torch.int32), 4, count=9)


def test_packed_length() -> None:
    assert [packed_length(n, 4) for n in (1, 8, 9, 4096)] == [1, 1, 2, 512]
    assert [packed_length(n, 3) for n in (32, 4096, 33)] == [3, 384, 4]
    assert packed_length(4096, 2) == 256 and packed_length(4096, 8) == 1024
