"""Integer bit-field packing shared by the GPTQ and AWQ plugins.

Every supported layout is a dense, little-endian bit stream over 32-bit words:
code ``i`` of a packed run occupies bits ``[b*i, b*i + b)`` of the concatenated
words, least-significant bit first.  For 2/4/8-bit codes no field crosses a
word boundary (``32/b`` codes per word).  For 3-bit codes this is exactly the
GPTQ "10-1-10-1-10" scheme: 32 codes fill 3 words, code 10 is split between
words 0 and 1 (2 + 1 bits) and code 21 between words 1 and 2 (1 + 2 bits).

Packed tensors are ``torch.int32`` (two's complement view of the unsigned
32-bit word).  Unpacked codes are non-negative integers ``< 2**bits``.

"Rows" helpers pack along dim 0 (GPTQ ``qweight``: ``[K*b/32, N]``);
"cols" helpers pack along the last dim (GPTQ ``qzeros``, AWQ tensors).
"""

from __future__ import annotations

import sys

import torch

__all__ = [
    "ggml_f16",
    "ggml_int4_scales_offsets",
    "q8_0_blocks",
    "SUPPORTED_BITS",
    "WORD_BITS",
    "check_bits",
    "int4_codes_from_cols",
    "int4_codes_from_rows",
    "pack_bits",
    "pack_cols",
    "pack_rows",
    "packed_length",
    "to_int32_words",
    "unpack_bits",
    "unpack_cols",
    "unpack_rows",
    "wrapping_add_int32",
]

WORD_BITS = 32
SUPPORTED_BITS = (2, 3, 4, 8)
_CODES_PER_BLOCK = 32  # a block of 32 codes always fills exactly `bits` words
_WORD_MASK = (1 << WORD_BITS) - 1


def check_bits(bits: int) -> None:
    """Raise ``ValueError`` unless ``bits`` is a supported field width."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}; expected one of {SUPPORTED_BITS}")


def packed_length(num_codes: int, bits: int) -> int:
    """Number of 32-bit words holding ``num_codes`` codes: ``ceil(num_codes*bits/32)``."""
    check_bits(bits)
    return -(-num_codes * bits // WORD_BITS)


def to_int32_words(values: torch.Tensor) -> torch.Tensor:
    """Reinterpret integers in ``[0, 2**32)`` (any int dtype) as int32 words, wrapping."""
    wide = values.to(torch.int64) & _WORD_MASK
    return torch.where(wide >= 1 << 31, wide - (1 << WORD_BITS), wide).to(torch.int32)


def wrapping_add_int32(words: torch.Tensor, constant: int) -> torch.Tensor:
    """Add ``constant`` to every 32-bit word modulo ``2**32`` (carries cross fields)."""
    return to_int32_words(words.to(torch.int64) + constant)


def _field_layout(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Word index and bit shift of each of the 32 codes of a block."""
    starts = torch.arange(_CODES_PER_BLOCK, dtype=torch.int64) * bits
    return starts // WORD_BITS, starts % WORD_BITS


def _check_codes(codes: torch.Tensor, bits: int) -> None:
    if codes.is_floating_point() or codes.is_complex():
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for {bits}-bit packing")


def _unpack_last_aligned(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Fast path for 2/4/8 bits: no field straddles a word."""
    per_word = WORD_BITS // bits
    shifts = torch.arange(0, WORD_BITS, bits, dtype=torch.int32, device=words.device)
    fields = torch.bitwise_right_shift(words.to(torch.int32).unsqueeze(-1), shifts)
    fields = torch.bitwise_and(fields, (1 << bits) - 1)
    return fields.reshape(*words.shape[:-1], words.shape[-1] * per_word)


def _unpack_last_stream(words: torch.Tensor, bits: int) -> torch.Tensor:
    """General path: read each field from (word, next word) as a 64-bit window."""
    num_words = words.shape[-1]
    blocks = -(-num_words // bits)
    pad = blocks * bits - num_words
    wide = words.to(torch.int64) & _WORD_MASK
    if pad:
        wide = torch.nn.functional.pad(wide, (0, pad))
    wide = wide.reshape(*words.shape[:-1], blocks, bits)
    lo_index, shift = _field_layout(bits)
    hi_index = torch.clamp(lo_index + 1, max=bits - 1)
    lo = wide[..., lo_index.to(words.device)]
    hi = wide[..., hi_index.to(words.device)] & 0xFF
    window = lo | torch.bitwise_left_shift(hi, WORD_BITS)
    fields = torch.bitwise_right_shift(window, shift.to(words.device)) & ((1 << bits) - 1)
    return fields.reshape(*words.shape[:-1], blocks * _CODES_PER_BLOCK).to(torch.int32)


def unpack_bits(words: torch.Tensor, bits: int, *, dim: int = -1, count: int | None = None) -> torch.Tensor:
    """Unpack ``bits``-wide codes stored LSB first along ``dim`` of a word tensor.

    Returns int32 codes; along ``dim`` there are ``words.shape[dim]*32/bits`` codes
    (3-bit: rounded up to a whole 32-code block), truncated to ``count`` if given.
    """
    check_bits(bits)
    if words.is_floating_point():
        raise TypeError(f"packed words must be an integer tensor, got {words.dtype}")
    moved = words.movedim(dim, -1)
    if moved.dtype != torch.int32:
        moved = to_int32_words(moved)
    if bits == 3:
        codes = _unpack_last_stream(moved, bits)
    else:
        codes = _unpack_last_aligned(moved, bits)
    if count is not None:
        if count > codes.shape[-1]:
            raise ValueError(f"asked for {count} codes but only {codes.shape[-1]} are packed")
        codes = codes[..., :count]
    return codes.movedim(-1, dim).contiguous()


def _pack_last(codes: torch.Tensor, bits: int) -> torch.Tensor:
    num_codes = codes.shape[-1]
    blocks = -(-num_codes // _CODES_PER_BLOCK)
    pad = blocks * _CODES_PER_BLOCK - num_codes
    wide = codes.to(torch.int64)
    if pad:
        wide = torch.nn.functional.pad(wide, (0, pad))
    wide = wide.reshape(*codes.shape[:-1], blocks, _CODES_PER_BLOCK)
    out = torch.zeros(*codes.shape[:-1], blocks, bits, dtype=torch.int64, device=codes.device)
    lo_index, shift = _field_layout(bits)
    for j in range(_CODES_PER_BLOCK):
        word, s = int(lo_index[j]), int(shift[j])
        value = wide[..., j]
        out[..., word] |= torch.bitwise_left_shift(value, s) & _WORD_MASK
        if s + bits > WORD_BITS:
            out[..., word + 1] |= torch.bitwise_right_shift(value, WORD_BITS - s)
    out = out.reshape(*codes.shape[:-1], blocks * bits)
    return to_int32_words(out[..., : packed_length(num_codes, bits)])


def pack_bits(codes: torch.Tensor, bits: int, *, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`unpack_bits`: pack codes along ``dim`` into int32 words.

    Output length along ``dim`` is ``ceil(n*bits/32)``; missing tail codes are zero.
    """
    check_bits(bits)
    _check_codes(codes, bits)
    packed = _pack_last(codes.movedim(dim, -1), bits)
    return packed.movedim(-1, dim).contiguous()


def unpack_rows(packed: torch.Tensor, bits: int, *, count: int | None = None) -> torch.Tensor:
    """Unpack along dim 0: ``[ceil(R*b/32), C]`` words -> ``[R, C]`` codes (GPTQ qweight)."""
    return unpack_bits(packed, bits, dim=0, count=count)


def unpack_cols(packed: torch.Tensor, bits: int, *, count: int | None = None) -> torch.Tensor:
    """Unpack along the last dim: ``[R, ceil(C*b/32)]`` words -> ``[R, C]`` codes."""
    return unpack_bits(packed, bits, dim=-1, count=count)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[R, C]`` codes along dim 0 into ``[ceil(R*b/32), C]`` int32 words."""
    return pack_bits(codes, bits, dim=0)


def pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[R, C]`` codes along the last dim into ``[R, ceil(C*b/32)]`` int32 words."""
    return pack_bits(codes, bits, dim=-1)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., C]`` -> uint8 ``[..., C, 8]``: the 8 nibbles of each word, least significant first."""
    if sys.byteorder != "little":  # pragma: no cover - every CPU torch supports is little endian
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        return ((words.unsqueeze(-1) >> shifts) & 15).to(torch.uint8)
    data = words.contiguous().view(torch.uint8).reshape(*words.shape, 4)
    return torch.stack((data & 15, data >> 4), dim=-1).reshape(*words.shape, 8)


def int4_codes_from_rows(words: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qweight`` ``[K/8, N]`` (packed along dim 0, LSB first) -> uint8 codes ``[K, N]`` (the 4-bit case of
    :func:`unpack_rows`, through a byte view: no int32 shifts)."""
    rows, cols = words.shape
    return _nibbles(words).permute(0, 2, 1).reshape(rows * 8, cols)


def int4_codes_from_cols(words: torch.Tensor) -> torch.Tensor:
    """Words ``[R, C]`` packed along the last dim (LSB first) -> uint8 codes ``[R, 8C]`` (the 4-bit case of
    :func:`unpack_cols`, through a byte view)."""
    rows, cols = words.shape
    return _nibbles(words).reshape(rows, cols * 8)


def q8_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 blocks (uint8 ``[out, in/32 * 34]``) of a float ``weight`` ``[out, in]``, bit for bit what the
    ``gguf`` package's (and llama.cpp's reference) quantizer writes: per block of 32, ``d = max|w| / 127`` (float16
    in the block), codes ``round(w / d)`` with halves away from zero (``w * (1 / d)``, in float32)."""
    out, k = weight.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs in_features divisible by 32, not {k}")
    w = weight.to(torch.float32).reshape(out, k // 32, 32)
    d = w.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = w * inv
    codes = (scaled.abs() + 0.5).floor_().copysign_(scaled).to(torch.int8)
    blocks = torch.empty(out, k // 32, 34, dtype=torch.uint8)
    blocks[..., 0:2] = d.to(torch.float16).view(torch.uint8)
    blocks[..., 2:] = codes.view(torch.uint8)
    return blocks.reshape(out, -1)


def ggml_f16(b: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes ``start:start+2`` of each block (``[n, size]`` uint8) as float32 ``[n, 1]`` (exact), read through a
    float16 view of the whole block matrix (no gather copy) where its layout allows one."""
    try:
        halves = b.view(torch.float16)
    except RuntimeError:  # odd storage offset or strided rows
        return b[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)
    return halves[:, start // 2 : start // 2 + 1].to(torch.float32)


def ggml_int4_scales_offsets(
    b: torch.Tensor, type_name: str, out_features: int, *, offsets: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q4_0/Q4_1/Q4_K blocks' (``b``: ``[n, block bytes]`` uint8, the type by name) ``(scales, offsets)``, float32 ``[out, in / 32]``: ``scales * q + offsets`` (float32,
    multiply then add) is the type's dequantization bit for bit: Q4_0 ``d * q + (-8 d)`` (``d`` a float16 value:
    ``8 d`` and the sum exact), Q4_1 ``d * q + m``, Q4_K ``(d * sc) * q - dmin * mn`` per sub-block of 32
    (subtracting is adding the negation). Q4_0 with ``offsets=False``: the scales twice (the caller writes ``-8 d``)."""
    if type_name == "Q4_K":
        n = b.shape[0]
        d, dmin = ggml_f16(b, 0), ggml_f16(b, 2)
        six = b[:, 4:16].reshape(n, 3, 4)  # 8 six-bit scales and 8 six-bit mins in 12 bytes
        lo, mid, hi = six[:, 0], six[:, 1], six[:, 2]
        sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
        mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
        scale = (d * sc.to(torch.float32)).reshape(n, -1, 1)
        offset = (dmin * mn.to(torch.float32)).reshape(n, -1, 1)
        return scale.reshape(out_features, -1), offset.neg().reshape(out_features, -1)
    scales = ggml_f16(b, 0).reshape(out_features, -1)
    if type_name == "Q4_1":
        return scales, ggml_f16(b, 2).reshape(out_features, -1)
    return scales, scales * -8.0 if offsets else scales
