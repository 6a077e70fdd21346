"""EXL3 ring-coded tables: the quantized token embeddings of exllamav3 1.6.x (``--embed_bits``).

Format doc §2.5 and exllamav3's ``modules/quant/exl3_lib/ngram_codec.py`` / ``conversion/ngram.py`` (the facts;
this code is anyquant's own). A quantized embedding is stored as two tensors instead of ``<key>.weight``:

- ``<key>.trellis`` int16 ``[rows, groups * (1 + 16 K)]`` (or row shards ``<key>.shard_N.trellis``, all but the
  last of equal length): each row zero-padded to ``groups * 256`` columns and cut into 256-wide groups, one
  *ring* per group, stored back to back. A ring is ``1 + 16 K`` little-endian uint16 words: word 0 the ring's
  fp16 scale, then the ``256 K``-bit stream in which bits ``[i K, (i + 1) K)`` (least significant bit first)
  are the low ``K`` bits of position ``i``'s 16-bit trellis state; the state's higher bits are the symbols
  of the preceding positions, ``K`` bits each, around the ring (tail-biting);
- ``<key>.signs`` fp16 ``[groups, 256]``: a ±1 per column.

A group decodes as ``signs[g] * H(mul1(state) * scale)`` with ``H`` the orthonormal 256-point Walsh-Hadamard
transform (natural order, butterflies of span 1, 2, 4, ... 128, then the ``1/16`` factor), in float32, and the
row is rounded to fp16 and trimmed to the hidden size: what exllamav3's CPU path computes (tests compare).
``K`` is a whole number of bits, 1..8; the codebook is always mul1. (1.5's hashed n-gram tables use the same
ring over 160-wide rows without signs, plus per-head biases, for architectures anyquant does not build.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .codebook import codebook_lut
from .plugin import RING_GROUP as GROUP
from .plugin import ring_bits

__all__ = [
    "GROUP",
    "RingTable",
    "decode_rows",
    "encode_table",
    "fwht",
    "pack_rings",
    "ring_bits",
    "unpack_rings",
]

#: exllamav3's per-row codebook-scale heuristic for the ring encoder: K -> (gamma, cs_hi); the input of the
#: trellis search is the ring divided by ``rms / clamp(gamma / (absmax / rms), CS_MIN, cs_hi)``
CS_HEURISTIC = {
    1: (4.0, 1.16),
    2: (3.6, 0.98),
    3: (3.2, 0.98),
    4: (3.0, 0.98),
    5: (3.0, 0.95),
    6: (3.0, 0.92),
    7: (3.0, 0.90),
    8: (3.0, 0.86),
}
CS_MIN = 0.55


def _symbols(stream: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """The ``k``-bit symbol of each ring position: int64 ``[N, width]`` from uint16 words (as int64) ``[N, W]``."""
    n_words = stream.shape[1]
    start = torch.arange(width, device=stream.device) * k
    word = start >> 4
    # two consecutive words (the second wraps around the ring) hold every symbol whole
    pair = stream[:, word] | (stream[:, (word + 1) % n_words] << 16)
    return (pair >> (start & 15)) & ((1 << k) - 1)


def unpack_rings(packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rings int16 ``[N, 1 + width*k/16]`` -> (16-bit states int64 ``[N, width]``, scales fp16 ``[N]``)."""
    if packed.dim() != 2 or packed.dtype != torch.int16:
        raise ValueError(f"rings must be int16 [N, words], got {packed.dtype} {tuple(packed.shape)}")
    n_words = packed.shape[1] - 1
    width = n_words * 16 // k
    if width * k != n_words * 16:
        raise ValueError(f"{n_words} stream words do not hold a whole number of {k}-bit symbols")
    scales = packed[:, 0].contiguous().view(torch.float16)
    stream = packed[:, 1:].to(torch.int64) & 0xFFFF
    symbols = _symbols(stream, k, width)
    # position i's state: its own symbol in the low bits, then those of positions i-1, i-2, ... (mod width)
    states = symbols.clone()
    for back in range(1, -(-16 // k)):
        states |= torch.roll(symbols, back, dims=1) << (back * k)
    return states & 0xFFFF, scales


def pack_rings(states: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`unpack_rings` for states that form a ring (each state's high bits are the preceding
    positions' symbols): int16 ``[N, 1 + width*k/16]``."""
    n, width = states.shape
    if width * k % 16:
        raise ValueError(f"a ring of {width} {k}-bit symbols is not a whole number of 16-bit words")
    symbols = states.to(torch.int64) & ((1 << k) - 1)
    bits = (symbols.unsqueeze(-1) >> torch.arange(k, device=states.device)) & 1  # [N, width, k], LSB first
    bits = bits.reshape(n, width * k // 16, 16)
    words = (bits << torch.arange(16, device=states.device)).sum(-1)
    words = ((words ^ 0x8000) - 0x8000).to(torch.int16)  # uint16 bit patterns as int16
    head = scales.to(torch.float16).reshape(n, 1).view(torch.int16)
    return torch.cat((head, words), dim=1)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dimension (a power of two), natural order:
    butterflies ``(a + b, a - b)`` of span 1, 2, 4, ... in that order, then ``* n ** -0.5``."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the transform size must be a power of two, got {n}")
    y = x.reshape(-1, n)
    span = 1
    while span < n:
        pairs = y.view(y.shape[0], n // (2 * span), 2, span)
        lo, hi = pairs.unbind(2)
        y = torch.stack((lo + hi, lo - hi), dim=2).view(-1, n)
        span *= 2
    return y.view(x.shape) * (1.0 / math.sqrt(n))


def decode_rows(rows: torch.Tensor, signs: torch.Tensor, k: int, hidden: int) -> torch.Tensor:
    """Table rows int16 ``[U, groups * (1 + 16 k)]`` -> fp16 ``[U, hidden]``."""
    groups = signs.shape[0]
    states, scales = unpack_rings(rows.reshape(rows.shape[0] * groups, -1), k)
    lut = codebook_lut("mul1").to(rows.device)
    values = lut[states].float() * scales.float().unsqueeze(1)
    out = fwht(values).view(rows.shape[0], groups, GROUP) * signs.to(rows.device).float()
    return out.view(rows.shape[0], groups * GROUP)[:, :hidden].half()


@dataclass
class RingTable:
    """A ring-coded table read from a checkpoint: the packed rows, the signs, ``K`` and the hidden size."""

    trellis: torch.Tensor  # int16 [rows, groups * (1 + 16 K)]
    signs: torch.Tensor  # fp16 [groups, 256]
    k: int
    hidden: int

    def rows(self, ids: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """fp16 ``[*ids.shape, hidden]`` for token ids (decoded ``chunk`` rows at a time)."""
        flat = ids.reshape(-1)
        out = torch.empty(flat.numel(), self.hidden, dtype=torch.float16, device=self.trellis.device)
        for start in range(0, flat.numel(), chunk):
            part = self.trellis.index_select(0, flat[start : start + chunk])
            out[start : start + part.shape[0]] = decode_rows(part, self.signs, self.k, self.hidden)
        return out.view(*ids.shape, self.hidden)

    def decode(self, chunk: int = 4096) -> torch.Tensor:
        """The whole table, fp16 ``[rows, hidden]``, decoded ``chunk`` rows at a time."""
        return self.rows(torch.arange(self.trellis.shape[0], device=self.trellis.device), chunk)


def encode_table(
    weight: torch.Tensor, k: int, *, seed: int = 0, batch_tiles: int | None = None, num_threads: int | None = 1
) -> tuple[dict[str, torch.Tensor], float]:
    """Encode a token embedding ``[rows, hidden]`` as a ring table with ``k`` bits per weight (1..8), the way
    exllamav3's converter does: random column signs, the 256-point Hadamard per group, per ring a scale from
    :data:`CS_HEURISTIC`, the tail-biting Viterbi search over the mul1 codebook (anyquant's CPU encoder), then
    the least-squares fp16 scale. Returns ``({"trellis", "signs"}, relative Frobenius error)``."""
    from .encode import TileEncoder

    if not 1 <= k <= 8 or int(k) != k:
        raise ValueError(f"ring tables take a whole K in 1..8, got {k}")
    k = int(k)
    rows, hidden = weight.shape
    groups = -(-hidden // GROUP)
    gen = torch.Generator().manual_seed(seed)
    signs = (torch.randint(0, 2, (groups, GROUP), generator=gen) * 2 - 1).to(torch.float16)
    encoder = TileEncoder(k, "mul1", batch_tiles=batch_tiles)
    gamma, cs_hi = CS_HEURISTIC[k]
    w = torch.nan_to_num(weight.float(), nan=0.0, posinf=0.0, neginf=0.0)
    padded = torch.nn.functional.pad(w, (0, groups * GROUP - hidden)).view(rows, groups, GROUP)
    rings = fwht(padded * signs.float()).reshape(rows * groups, GROUP)
    rms = rings.square().mean(1, keepdim=True).sqrt()
    peak = rings.abs().amax(1) / rms.squeeze(1).clamp(min=1e-12)
    cs = (gamma / peak.clamp(min=1e-6)).clamp(min=CS_MIN, max=cs_hi)
    scale0 = (rms / cs.unsqueeze(1)).clamp(min=1e-8).to(torch.float16).float()
    scale0 = torch.where(scale0 > 0, scale0, torch.ones_like(scale0))  # below fp16 range: encode against 1
    states = encoder.encode(rings / scale0, num_threads).to(torch.int64)
    q = encoder.values(states)
    scale = ((rings * q).sum(1) / q.square().sum(1).clamp(min=1e-12)).to(torch.float16)
    trellis = pack_rings(states, scale, k).view(rows, -1)
    decoded = decode_rows(trellis, signs, k, hidden).float()
    err = float((decoded - w).norm() / w.norm().clamp(min=1e-30))
    return {"trellis": trellis.contiguous(), "signs": signs}, err
