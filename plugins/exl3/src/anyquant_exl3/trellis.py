"""EXL3 trellis bitstream: packing, state extraction and the tensor-core tile permutation (format doc §3.2-3.3).

A ``.trellis`` tensor is int16 ``[k/16, n/16, 16·K]``: one 16x16 tile per (input block, output block). Each tile
is a tail-biting ring of ``256·K`` bits. Weight ``j`` of a tile (``j`` in tensor-core order, see
:func:`tensor_core_perm`) adds ``D(j)`` new bits; its 16-bit state is the ring window ending at ``S(j)``, the
prefix sum of ``D``. Integer K: ``D(j) = K``. Half-integer ``K = KA + 0.5``:
``D(j) = KA + ((0xAAAA >> (j mod 16)) & 1)``.

Stream convention (``pack_trellis_kernel`` + ``SWAP16``): the tile's int16 pairs form little-endian uint32
words ``w[t] = u16[2t] | u16[2t+1] << 16``, and stream bit ``p`` is bit ``31 - p mod 32`` of ``w[p div 32]``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

import torch

TILE = 16
TILE_NUMEL = 256
FRAC_MASK = 0xAAAA

StateOrder = Literal["stream", "row_major"]


# ----------------------------------------------------------------------------------------------------------------
# bitrate


def bits_from_words(words_per_tile: int) -> float:
    """Bits per weight K for a trellis last dimension (``16·K`` int16 words); int for whole K."""
    if words_per_tile % 8 or not 16 <= words_per_tile <= 128:
        raise ValueError(f"trellis last dim {words_per_tile} is not 16*K for K in 1..8 (or a half-integer K)")
    return words_per_tile // 16 if words_per_tile % 16 == 0 else words_per_tile / 16


def bits_per_weight(trellis: torch.Tensor) -> float:
    """K from a trellis tensor (true division: 24/40/56 give 1.5/2.5/3.5)."""
    return bits_from_words(int(trellis.shape[-1]))


def words_per_tile(k_bits: float) -> int:
    """int16 words per tile (``16·K``) for a bitrate K in 1..8 or a half-integer in 1.5..7.5."""
    words = 16 * float(k_bits)
    if not words.is_integer():
        raise ValueError(f"bitrate {k_bits} is neither whole nor a half-integer")
    bits_from_words(int(words))  # validates the range
    return int(words)


def step_bits(k_bits: float) -> list[int]:
    """``D(j)``: new bits contributed by weight ``j`` (stream/tensor-core order), 256 entries."""
    words = words_per_tile(k_bits)
    if words % 16 == 0:
        return [words // 16] * TILE_NUMEL
    ka = words // 16
    return [ka + ((FRAC_MASK >> (j % 16)) & 1) for j in range(TILE_NUMEL)]


def window_ends(k_bits: float) -> list[int]:
    """``S(j)``: stream bit where weight ``j``'s 16-bit state window ends."""
    ends, acc = [], 0
    for d in step_bits(k_bits):
        acc += d
        ends.append(acc)
    return ends


# ----------------------------------------------------------------------------------------------------------------
# tensor-core permutation


@lru_cache(maxsize=1)
def _perm() -> tuple[int, ...]:
    perm = [0] * TILE_NUMEL
    for t in range(32):
        r0 = 2 * (t % 4)
        c0 = t // 4
        rows = (r0, r0 + 1, r0 + 8, r0 + 9)
        for half, col in enumerate((c0, c0 + 8)):
            for i, row in enumerate(rows):
                perm[8 * t + 4 * half + i] = 16 * row + col
    return tuple(perm)


def tensor_core_perm() -> torch.Tensor:
    """``perm[j]``: row-major position (16·r + c) inside the tile of the j-th encoded weight."""
    return torch.tensor(_perm(), dtype=torch.int64)


def tensor_core_perm_inv() -> torch.Tensor:
    """Inverse of :func:`tensor_core_perm`: stream index of each row-major tile position."""
    return torch.argsort(tensor_core_perm())


# ----------------------------------------------------------------------------------------------------------------
# words


def trellis_to_words(trellis: torch.Tensor) -> torch.Tensor:
    """int16 ``[..., 16K]`` -> int64 ``[..., 8K]`` little-endian uint32 words (values 0 .. 2**32-1)."""
    if trellis.dtype != torch.int16:
        raise TypeError(f"trellis must be int16, got {trellis.dtype}")
    if trellis.shape[-1] % 2:
        raise ValueError("trellis last dim must be even")
    u16 = trellis.to(torch.int64) & 0xFFFF
    pairs = u16.reshape(*trellis.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 16)


def words_to_trellis(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`trellis_to_words`."""
    lo = words & 0xFFFF
    hi = (words >> 16) & 0xFFFF
    u16 = torch.stack((lo, hi), dim=-1).reshape(*words.shape[:-1], -1)
    return ((u16 ^ 0x8000) - 0x8000).to(torch.int16)


# ----------------------------------------------------------------------------------------------------------------
# state extraction


@lru_cache(maxsize=64)
def _window_tables(k_bits: float, order: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(i0, i1, s) per output position: the state is ``((w[i1] >> s) | (w[i0] << (32 - s))) & 0xFFFF``."""
    nw = words_per_tile(k_bits) // 2
    ring = 32 * nw
    ends = torch.tensor(window_ends(k_bits), dtype=torch.int64) + ring
    if order == "row_major":
        ends = ends[tensor_core_perm_inv()]
    elif order != "stream":
        raise ValueError(f"order must be 'stream' or 'row_major', got {order!r}")
    start = ends - 16
    i0 = (start // 32) % nw
    i1 = ((ends - 1) // 32) % nw
    shift = (-ends) % 32
    return i0, i1, shift


def states_from_words(words: torch.Tensor, k_bits: float, order: StateOrder = "stream") -> torch.Tensor:
    """16-bit states ``[..., 256]`` (int32) from uint32 words ``[..., 8K]`` (int64)."""
    i0, i1, shift = (t.to(words.device) for t in _window_tables(float(k_bits), order))
    lo_word = words[..., i1]
    hi_word = words[..., i0]
    state = (lo_word >> shift) | (hi_word << (32 - shift))
    return (state & 0xFFFF).to(torch.int32)


@lru_cache(maxsize=8)
def _row_plan(tiles_n: int, k_bits: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For one row of tiles laid out as ``[16, 16·tn]``: flat indices into its word pairs ``[tn, nw]`` and the
    right shift of every position."""
    nw = words_per_tile(k_bits) // 2
    ends = torch.tensor(window_ends(k_bits), dtype=torch.int64) + 32 * nw
    start = (ends - 16)[tensor_core_perm_inv()].view(TILE, 1, TILE)  # row-major tile position (r, c)
    tj = torch.arange(tiles_n).view(1, tiles_n, 1)
    index = (tj * nw + (start // 32) % nw).reshape(1, -1)
    return index, (48 - start % 32).view(1, TILE, 1, TILE)


def states_matrix(trellis: torch.Tensor) -> torch.Tensor:
    """States of an int16 trellis ``[tk, tn, 16K]`` laid out as the matrix ``[16·tk, 16·tn]`` (int64).

    Tile (i, j) fills rows 16i.., columns 16j..; stream element j of a tile lands at row-major ``perm[j]``.
    Each state is the 16-bit window at ring offset ``o`` of the word pair ``w[t] : w[t+1]``:
    ``(pair >> (48 - o)) & 0xFFFF`` (exllamav3 ``frac_window``; equal to the ``dq`` funnel shift).
    """
    tiles_k, tiles_n = int(trellis.shape[0]), int(trellis.shape[1])
    index, shift = _row_plan(tiles_n, bits_per_weight(trellis))
    index, shift = index.to(trellis.device), shift.to(trellis.device)
    words = trellis_to_words(trellis)
    pairs = (words << 32) | torch.roll(words, -1, dims=-1)
    row_offsets = torch.arange(tiles_k, device=trellis.device).view(-1, 1) * (tiles_n * words.shape[-1])
    states = torch.take(pairs, index + row_offsets).view(tiles_k, TILE, tiles_n, TILE)
    return ((states >> shift) & 0xFFFF).view(tiles_k * TILE, tiles_n * TILE)


def unpack_states(trellis: torch.Tensor, order: StateOrder = "stream") -> torch.Tensor:
    """All 16-bit states of an int16 trellis ``[..., 16K]`` -> int32 ``[..., 256]``.

    ``order="stream"`` returns them in encoding (tensor-core) order, like exllamav3's ``unpack_trellis``;
    ``"row_major"`` returns position ``16·r + c`` of each 16x16 tile.
    """
    return states_from_words(trellis_to_words(trellis), bits_per_weight(trellis), order)


# ----------------------------------------------------------------------------------------------------------------
# packing (encoder side)


@lru_cache(maxsize=64)
def _bit_sources(k_bits: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For each stream bit p: (weight j, bit b) such that stream bit p = bit b of state j."""
    js, bs = [], []
    for j, d in enumerate(step_bits(k_bits)):
        for b in range(d - 1, -1, -1):
            js.append(j)
            bs.append(b)
    return torch.tensor(js, dtype=torch.int64), torch.tensor(bs, dtype=torch.int64)


def pack_states(states: torch.Tensor, k_bits: float, chunk_tiles: int = 4096) -> torch.Tensor:
    """Pack states ``[..., 256]`` (stream order, any int dtype) into an int16 trellis ``[..., 16K]``.

    Only each state's ``D(j)`` low (new) bits are stored, as ``pack_trellis_kernel`` does; the result decodes
    back to the same states exactly when they are tail-biting consistent (see :func:`is_tail_biting`).
    """
    if states.shape[-1] != TILE_NUMEL:
        raise ValueError(f"states last dim must be {TILE_NUMEL}, got {states.shape[-1]}")
    lead = states.shape[:-1]
    flat = states.reshape(-1, TILE_NUMEL).to(torch.int64)
    js, bs = (t.to(flat.device) for t in _bit_sources(float(k_bits)))
    weights = torch.tensor([1 << (31 - i) for i in range(32)], dtype=torch.int64, device=flat.device)
    nw = words_per_tile(k_bits) // 2
    out = torch.empty((flat.shape[0], nw), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.shape[0], chunk_tiles):
        block = flat[start : start + chunk_tiles]
        bits = (block[:, js] >> bs) & 1
        out[start : start + chunk_tiles] = (bits.reshape(-1, nw, 32) * weights).sum(-1)
    return words_to_trellis(out).reshape(*lead, 2 * nw)


def is_tail_biting(states: torch.Tensor, k_bits: float) -> torch.Tensor:
    """Bool ``[...]``: every state equals the window its ring's new bits produce (i.e. packing is lossless)."""
    return (unpack_states(pack_states(states, k_bits)) == (states.to(torch.int32) & 0xFFFF)).all(dim=-1)


def tiles_to_matrix(tiles: torch.Tensor) -> torch.Tensor:
    """``[tk, tn, 256]`` row-major tiles -> ``[16·tk, 16·tn]`` matrix (tile (i, j) at rows 16i.., cols 16j..)."""
    tk, tn = tiles.shape[0], tiles.shape[1]
    return tiles.reshape(tk, tn, TILE, TILE).permute(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)


def matrix_to_tiles(matrix: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`tiles_to_matrix`: ``[16·tk, 16·tn]`` -> ``[tk, tn, 256]`` row-major tiles."""
    rows, cols = matrix.shape
    if rows % TILE or cols % TILE:
        raise ValueError(f"matrix shape {tuple(matrix.shape)} is not a multiple of 16")
    tk, tn = rows // TILE, cols // TILE
    return matrix.reshape(tk, TILE, tn, TILE).permute(0, 2, 1, 3).reshape(tk, tn, TILE_NUMEL)
