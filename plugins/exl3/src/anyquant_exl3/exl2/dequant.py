"""Pure-torch EXL2 (exllamav2) dequantizer and packer (format doc §6).

Per quantized linear: ``q_weight`` int32 ``[Σ_g ceil(rows_g·b_g/32), n_pad]``, ``q_scale`` int32
``[groups, n_pad/8]``, ``q_scale_max`` fp16 ``[groups]``, ``q_groups`` int16 ``[2·groups]`` (pairs
``(bits_g, first q_weight row of g)``) and ``q_invperm`` int32 ``[k]``.

* Rows are in act-order. Group g holds ``(qrow_{g+1} - qrow_g)·32/b_g`` rows; the last group takes the rest.
* Within a group each column is a little-endian bitstream over its 32-bit words: row r at bits ``[r·b, r·b+b)``
  (``pack_columns_kernel``).
* Scale codes: 4 bits per column, column c at bits ``4·(c mod 8)`` of word ``c div 8``; code = qscale - 1.
* ``scale = (code+1)² · q_scale_max / 256``; ``w = (q - 2**(b-1)) · scale``; original row
  ``q_perm[i] = argsort(q_invperm)[i]`` receives act-order row i, i.e. ``W[r] = W_act[q_invperm[r]]``.

The CUDA dequant (``dq_scale``/``dq`` in ``qdq_util.cuh``) rounds to fp16 at each product: ``q_scale_max/256``,
``qs²·max``, ``(q - zero)·scale``. Every product of two fp16 numbers here is exact in fp32, so ``fp16_steps=True``
(default) reproduces those roundings; ``False`` computes in fp32 and rounds once at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

EXL2_BITS = (2, 3, 4, 5, 6, 8)
_U32 = 0xFFFFFFFF


@dataclass(frozen=True)
class GroupMap:
    """Per-group layout: bits, first act-order row, row count, first ``q_weight`` row."""

    bits: tuple[int, ...]
    rows: tuple[int, ...]
    first_row: tuple[int, ...]
    first_qrow: tuple[int, ...]


def group_map(q_groups: torch.Tensor, in_features: int) -> GroupMap:
    """Group layout from ``q_groups`` (``make_group_map`` in exllamav2 ``ext.py``)."""
    pairs = q_groups.reshape(-1, 2).to(torch.int64).tolist()
    bits = tuple(int(b) for b, _ in pairs)
    qrows = [int(q) for _, q in pairs]
    for b in bits:
        if b not in EXL2_BITS:
            raise ValueError(f"EXL2 group bit width {b} is not one of {EXL2_BITS}")
    rows, first, row = [], [], 0
    for g, b in enumerate(bits):
        first.append(row)
        if g + 1 < len(bits):
            count = (qrows[g + 1] - qrows[g]) * 32 // b
        else:
            count = in_features - row
        if count <= 0:
            raise ValueError(f"EXL2 group {g} has {count} rows")
        rows.append(count)
        row += count
    return GroupMap(bits, tuple(rows), tuple(first), tuple(qrows))


def unpack_scale_codes(q_scale: torch.Tensor) -> torch.Tensor:
    """``[groups, n/8]`` int32 -> ``[groups, n]`` int64 codes 0..15 (qscale - 1)."""
    words = q_scale.to(torch.int64) & _U32
    nibbles = (words.unsqueeze(-1) >> (4 * torch.arange(8, device=q_scale.device))) & 0xF
    return nibbles.reshape(q_scale.shape[0], -1)


def _row_tables(gmap: GroupMap, device: torch.device) -> dict[str, torch.Tensor]:
    """Per act-order row: q_weight word indices, bit shift, mask, zero point and group index."""
    bits = torch.cat([torch.full((r,), b, dtype=torch.int64) for b, r in zip(gmap.bits, gmap.rows, strict=True)])
    group = torch.cat([torch.full((r,), g, dtype=torch.int64) for g, r in enumerate(gmap.rows)])
    local = torch.cat([torch.arange(r, dtype=torch.int64) for r in gmap.rows])
    qrow0 = torch.tensor(gmap.first_qrow, dtype=torch.int64)[group]
    bit = local * bits
    return {
        "lo": (qrow0 + bit // 32).to(device),
        "hi": (qrow0 + (bit + bits - 1) // 32).to(device),
        "shift": (bit % 32).to(device),
        "mask": ((1 << bits) - 1).to(device),
        "zero": (1 << (bits - 1)).to(device),
        "group": group.to(device),
    }


def _values(words: torch.Tensor, tab: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """Signed quantized values ``q - zero`` for act-order ``rows``: ``[len(rows), n]`` int64."""
    lo = words[tab["lo"][rows]]
    hi = words[tab["hi"][rows]]
    shift = tab["shift"][rows].unsqueeze(1)
    joined = (lo >> shift) | (hi << (32 - shift))
    return (joined & tab["mask"][rows].unsqueeze(1)) - tab["zero"][rows].unsqueeze(1)


def _group_scales(codes: torch.Tensor, q_scale_max: torch.Tensor, fp16_steps: bool) -> torch.Tensor:
    qs2 = ((codes + 1) ** 2).to(torch.float32)
    if fp16_steps:
        max16 = (q_scale_max.to(torch.float16).float() / 256.0).half().float()
        return (qs2 * max16[:, None]).half().float()
    return qs2 * (q_scale_max.float()[:, None] / 256.0)


def decode_exl2(
    q_weight: torch.Tensor,
    q_scale: torch.Tensor,
    q_scale_max: torch.Tensor,
    q_groups: torch.Tensor,
    q_invperm: torch.Tensor | None = None,
    *,
    q_perm: torch.Tensor | None = None,
    out_features: int | None = None,
    fp16_steps: bool = True,
    dtype: torch.dtype = torch.float16,
    layout: Literal["linear", "exl2"] = "linear",
    chunk_rows: int = 1024,
) -> torch.Tensor:
    """Dequantize one EXL2 linear layer to ``[out, in]`` (``layout="linear"``) or ``[in, out]``.

    ``q_invperm`` (stored) or ``q_perm`` (``argsort(q_invperm)``, accepted by the loader too) gives the act-order;
    with neither, rows are taken as already in order. ``out_features`` trims the columns padded to 32.
    """
    if q_invperm is None and q_perm is not None:
        q_invperm = torch.argsort(q_perm.to(torch.int64))
    n_pad = q_weight.shape[1]
    in_features = int(q_invperm.numel()) if q_invperm is not None else None
    gmap = group_map(q_groups, in_features if in_features is not None else _rows_from_words(q_weight, q_groups))
    k = sum(gmap.rows)
    n_out = n_pad if out_features is None else int(out_features)
    if not 0 < n_out <= n_pad:
        raise ValueError(f"out_features {n_out} does not fit the padded width {n_pad}")
    _check_layout(gmap, q_weight, q_scale, q_scale_max)
    invperm = torch.arange(k) if q_invperm is None else q_invperm.to(torch.int64).reshape(-1)
    if q_invperm is not None and not torch.equal(torch.sort(invperm).values, torch.arange(k, device=invperm.device)):
        raise ValueError(f"q_invperm is not a permutation of 0..{k - 1} (an index repeats or is out of range)")
    device = q_weight.device
    words = torch.cat((q_weight.to(torch.int64) & _U32, torch.zeros((1, n_pad), dtype=torch.int64, device=device)))
    tab = _row_tables(gmap, device)
    scales = _group_scales(unpack_scale_codes(q_scale)[:, :n_out].to(device), q_scale_max.to(device), fp16_steps)
    out = torch.empty((n_out, k) if layout == "linear" else (k, n_out), dtype=dtype, device=device)
    for r0 in range(0, k, chunk_rows):
        rows = invperm[r0 : r0 + chunk_rows].to(device)
        q = _values(words, tab, rows)[:, :n_out].to(torch.float32)
        w = q * scales[tab["group"][rows]]
        if fp16_steps:
            w = w.half()
        if layout == "linear":
            out[:, r0 : r0 + rows.numel()] = w.t()
        else:
            out[r0 : r0 + rows.numel()] = w
    return out


def _check_layout(gmap: GroupMap, q_weight: torch.Tensor, q_scale: torch.Tensor, q_scale_max: torch.Tensor) -> None:
    """``q_groups`` must lay out exactly ``q_weight``'s rows, and give one ``q_scale`` row and one
    ``q_scale_max`` per group: a cut or edited ``q_groups`` otherwise decodes other rows' bits."""
    groups = len(gmap.bits)
    words = gmap.first_qrow[-1] + -(-gmap.rows[-1] * gmap.bits[-1] // 32)
    if gmap.first_qrow[0] != 0 or words != q_weight.shape[0]:
        raise ValueError(
            f"q_groups lay out {words} q_weight rows from row {gmap.first_qrow[0]}; q_weight has {q_weight.shape[0]}"
        )
    if q_scale.shape[0] != groups or q_scale_max.numel() != groups:
        raise ValueError(
            f"q_groups has {groups} groups; q_scale has {q_scale.shape[0]} rows and q_scale_max {q_scale_max.numel()} values"
        )


def _rows_from_words(q_weight: torch.Tensor, q_groups: torch.Tensor) -> int:
    """Row count when no permutation is given: every group, the last one full (its word count x 32 / bits)."""
    pairs = q_groups.reshape(-1, 2).to(torch.int64).tolist()
    last_bits, last_q = pairs[-1]
    full = sum((pairs[g + 1][1] - pairs[g][1]) * 32 // pairs[g][0] for g in range(len(pairs) - 1))
    return int(full + (q_weight.shape[0] - last_q) * 32 // last_bits)


# ----------------------------------------------------------------------------------------------------------------
# packing (tests and tooling)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return (((words & _U32) ^ 0x80000000) - 0x80000000).to(torch.int32)


def pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """One group's unsigned values ``[rows, n]`` -> int32 words ``[ceil(rows·bits/32), n]`` (little-endian)."""
    rows, n = values.shape
    nwords = -(-rows * bits // 32)
    v = values.to(torch.int64) & ((1 << bits) - 1)
    words = torch.zeros((nwords + 1, n), dtype=torch.int64)
    for r in range(rows):
        bit = r * bits
        words[bit // 32] |= (v[r] << (bit % 32)) & _U32
        words[bit // 32 + 1] |= v[r] >> (32 - bit % 32)
    return _to_int32(words[:nwords])


def pack_scale_codes(codes: torch.Tensor) -> torch.Tensor:
    """Scale codes ``[groups, n]`` (0..15, n a multiple of 8) -> int32 ``[groups, n/8]``."""
    g, n = codes.shape
    nib = (codes.to(torch.int64) & 0xF).reshape(g, n // 8, 8)
    return _to_int32((nib << (4 * torch.arange(8))).sum(-1))


def pack_exl2(
    q: torch.Tensor,
    group_bits: Sequence[int],
    group_rows: Sequence[int],
    codes: torch.Tensor,
    q_scale_max: torch.Tensor,
    q_invperm: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Pack act-order unsigned values ``q`` ``[k, n_pad]`` (n_pad multiple of 32) into EXL2 tensors."""
    if sum(group_rows) != q.shape[0] or len(group_bits) != len(group_rows):
        raise ValueError("group rows must cover q and match group bits")
    parts, groups, qrow, row = [], [], 0, 0
    for b, rows in zip(group_bits, group_rows, strict=True):
        packed = pack_columns(q[row : row + rows], b)
        groups += [b, qrow]
        parts.append(packed)
        qrow += packed.shape[0]
        row += rows
    return {
        "q_weight": torch.cat(parts),
        "q_scale": pack_scale_codes(codes),
        "q_scale_max": q_scale_max.to(torch.float16),
        "q_groups": torch.tensor(groups, dtype=torch.int16),
        "q_invperm": q_invperm.to(torch.int32),
    }


def quantizer_scale_code(base_scale: torch.Tensor, q_scale_max: torch.Tensor) -> torch.Tensor:
    """exllamav2 ``AdaptiveQuantizer``: ``qscale = clamp(round(sqrt(base / max)·16), 1, 16)``; returns code 0..15."""
    qscale = torch.clamp(torch.round(torch.sqrt(base_scale / q_scale_max) * 16), 1, 16)
    return qscale.to(torch.int64) - 1
