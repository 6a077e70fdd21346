"""EXL2 dequantizer: packing vs literal kernel simulations, group map, scale formula, act-order (doc §6)."""

from __future__ import annotations

import struct

import pytest
import torch

from anyquant_exl3.exl2.dequant import (
    EXL2_BITS,
    decode_exl2,
    group_map,
    pack_columns,
    pack_exl2,
    pack_scale_codes,
    quantizer_scale_code,
    unpack_scale_codes,
)


def _fp16(x: float) -> float:
    return struct.unpack("<e", struct.pack("<e", x))[0]


def _wshift(x: int, j: int) -> int:
    if j < 0:
        return 0 if j <= -32 else x >> (-j)
    return 0 if j >= 32 else (x << j) & 0xFFFFFFFF


def sim_pack_columns(values: list[list[int]], bits: int) -> list[list[int]]:
    """``pack_columns_kernel<bits>`` (exllamav2 ``cuda/pack_tensor.cu``), one column at a time; input rows are
    zero-extended to whole packing units as the kernel reads them."""
    rows, columns = len(values), len(values[0])
    per = {2: (16, 1), 3: (32, 3), 4: (8, 1), 5: (32, 5), 6: (16, 3), 8: (4, 1)}[bits]
    unit_rows, unit_words = per
    out_rows = -(-rows * bits // 32)
    units = -(-out_rows // unit_words)
    out = [[0] * columns for _ in range(units * unit_words)]
    for c in range(columns):
        for u in range(units):
            packed = [0] * unit_words
            for i in range(unit_rows):
                r = u * unit_rows + i
                x = values[r][c] if r < rows else 0
                for w in range(unit_words):
                    packed[w] |= _wshift(x, i * bits - 32 * w)
            for w in range(unit_words):
                out[u * unit_words + w][c] = packed[w]
    return [row for row in out[:out_rows]]


def sim_pack_rows_4(qscale: list[list[int]]) -> list[list[int]]:
    """``pack_rows_4_kernel``: 8 columns per word, ``x - 1`` at bits ``4·i``."""
    out = []
    for row in qscale:
        words = []
        for oc in range(len(row) // 8):
            packed = 0
            for i in range(8):
                packed |= ((row[oc * 8 + i] - 1) & 0xFFFF) << (i * 4)
            words.append(packed & 0xFFFFFFFF)
        out.append(words)
    return out


def _signed(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[v - (1 << 32) if v >= 1 << 31 else v for v in r] for r in rows], dtype=torch.int32)


@pytest.mark.parametrize("bits", EXL2_BITS)
@pytest.mark.parametrize("rows", [32, 48, 19])
def test_pack_columns_matches_kernel(bits: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(bits * 100 + rows)
    values = torch.randint(0, 1 << bits, (rows, 8), generator=gen)
    ours = pack_columns(values, bits)
    assert torch.equal(ours, _signed(sim_pack_columns(values.tolist(), bits)))


def test_scale_codes_match_pack_rows_4() -> None:
    gen = torch.Generator().manual_seed(1)
    qscale = torch.randint(1, 17, (3, 16), generator=gen)
    packed = pack_scale_codes(qscale - 1)
    assert torch.equal(packed, _signed(sim_pack_rows_4(qscale.tolist())))
    assert torch.equal(unpack_scale_codes(packed), qscale - 1)


def test_group_map_rows() -> None:
    # 8-bit group of 32 rows (8 words), 4-bit group of 64 rows (8 words), last 3-bit group takes the rest
    q_groups = torch.tensor([8, 0, 4, 8, 3, 16], dtype=torch.int16)
    gmap = group_map(q_groups, 32 + 64 + 20)
    assert gmap.rows == (32, 64, 20)
    assert gmap.first_row == (0, 32, 96)
    with pytest.raises(ValueError):
        group_map(torch.tensor([7, 0], dtype=torch.int16), 10)


def test_known_values() -> None:
    # one 4-bit group, 8 rows x 32 columns: q = row index, scale code 15 -> scale = max; code 0 -> max / 256
    q = torch.arange(8).repeat(32, 1).t().contiguous()
    codes = torch.full((1, 32), 15)
    codes[0, 1] = 0
    t = pack_exl2(q, [4], [8], codes, torch.tensor([2.0]), torch.arange(8))
    w = decode_exl2(**t, dtype=torch.float32, layout="exl2")
    assert w[:, 0].tolist() == [(r - 8) * 2.0 for r in range(8)]
    assert w[:, 1].tolist() == [(r - 8) * 2.0 / 256 for r in range(8)]


def _random_layer(seed: int, k: int, n_pad: int, plan: list[tuple[int, int]]):
    gen = torch.Generator().manual_seed(seed)
    bits = [b for b, _ in plan]
    rows = [r for _, r in plan]
    q = torch.cat([torch.randint(0, 1 << b, (r, n_pad), generator=gen) for b, r in plan])
    codes = torch.randint(0, 16, (len(plan), n_pad), generator=gen)
    qmax = (torch.rand(len(plan), generator=gen) * 0.05 + 0.001).half()
    perm = torch.randperm(k, generator=gen)
    invperm = torch.argsort(perm)
    return q, bits, rows, codes, qmax, perm, invperm


PLAN = [(8, 32), (6, 32), (5, 64), (4, 64), (3, 64), (2, 37)]


def test_round_trip_all_widths_with_act_order() -> None:
    k = sum(r for _, r in PLAN)
    q, bits, rows, codes, qmax, perm, invperm = _random_layer(3, k, 64, PLAN)
    t = pack_exl2(q, bits, rows, codes, qmax, invperm)
    assert t["q_weight"].dtype == torch.int32 and t["q_groups"].dtype == torch.int16
    assert t["q_weight"].shape[0] == sum(-(-r * b // 32) for b, r in PLAN)
    # float64 reference of the documented formula, rows moved back from act-order
    zero = torch.cat([torch.full((r,), 1 << (b - 1)) for b, r in PLAN])
    group = torch.cat([torch.full((r,), g) for g, (_, r) in enumerate(PLAN)])
    scale = (codes + 1).double() ** 2 * qmax.double()[:, None] / 256
    w_act = (q - zero[:, None]).double() * scale[group]
    ref = torch.empty_like(w_act)
    ref[perm] = w_act  # W[q_perm[i]] = W_act[i]
    w32 = decode_exl2(**t, fp16_steps=False, dtype=torch.float64, layout="exl2", out_features=60)
    assert torch.allclose(w32, ref[:, :60], rtol=1e-6, atol=1e-9)
    # kernel mode: fp16 roundings of dq_scale / dq
    w16 = decode_exl2(**t, out_features=60)
    assert w16.shape == (60, k) and w16.dtype == torch.float16
    # kernel mode equals a scalar emulation of dq_scale / dq (fp16 roundings, q_scale_max / 256 premultiplied in
    # fp16 as make_q_matrix does; small maxima land in the fp16 subnormal range there)
    gen = torch.Generator().manual_seed(5)
    rows_i = torch.randint(0, k, (200,), generator=gen).tolist()
    cols_c = torch.randint(0, 60, (200,), generator=gen).tolist()
    for i, c in zip(rows_i, cols_c, strict=True):
        a = int(invperm[i])
        max16 = _fp16(float(qmax[group[a]]) / 256)
        s16 = _fp16(float((codes[group[a], c] + 1) ** 2) * max16)
        assert float(w16[c, i]) == _fp16(float(q[a, c] - zero[a]) * s16)
    assert float((w16.double() - ref[:, :60].t()).abs().max()) < 3e-3 * float(ref.abs().max())
    # q_perm instead of q_invperm, and chunking
    t2 = dict(t)
    t2["q_perm"] = perm.to(torch.int32)
    del t2["q_invperm"]
    assert torch.equal(decode_exl2(**t2, out_features=60, chunk_rows=7), w16)


def test_padded_columns_are_zero() -> None:
    plan = [(4, 32)]
    q, bits, rows, codes, qmax, _perm, invperm = _random_layer(4, 32, 64, plan)
    q[:, 50:] = 8  # the converter fills padded columns with the zero point
    t = pack_exl2(q, bits, rows, codes, qmax, invperm)
    assert decode_exl2(**t, layout="exl2")[:, 50:].abs().max() == 0


def test_quantizer_scale_code() -> None:
    qmax = torch.tensor(1.0)
    assert quantizer_scale_code(torch.tensor([1.0, 0.25, 1e-6]), qmax).tolist() == [15, 7, 0]
