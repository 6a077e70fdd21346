"""EXL3 procedural codebooks: 16-bit trellis state -> weight value.

Three codebooks exist (format doc §3.4, exllamav3 ``quant/codebook.cuh``):

* ``3inst`` (QTIP "3INST", no marker tensor):
  ``x = s * 89226354 + 64248484 (mod 2**32)``; ``x = (x & 0x8FFF8FFF) ^ 0x3B603B60``;
  value = fp16(lo16(x)) + fp16(hi16(x)).
* ``mcg`` (``<key>.mcg`` marker): as 3INST with ``x = s * 0xCBAC1FED`` and no additive constant.
* ``mul1`` (``<key>.mul1`` marker): ``x = s * 0x83DCD12D``; ``bs`` = sum of the four bytes of x;
  ``h`` = fp16 with bit pattern ``0x6400 + bs`` (= 1024 + bs); value = fma(h, k_inv, k_bias) in fp16 with
  ``k_inv`` = fp16 bits 0x1EEE and ``k_bias`` = fp16 bits 0xC931.

Exactness: every value is computed exactly in fp32 (for 3INST/MCG the two fp16 halves have exponents at most
3 apart, for MUL1 the numerator fits 24 bits at scale 2**-18), so one round-to-nearest-even to fp16 equals the
CUDA ``__hadd`` / ``__hfma``. ``fp16=False`` keeps the exact fp32 value (what GPTQModel's torch module uses).
"""

from __future__ import annotations

import struct
import warnings
from functools import lru_cache
from typing import Literal

import torch

CodebookName = Literal["3inst", "mcg", "mul1"]
CODEBOOKS: tuple[str, ...] = ("3inst", "mcg", "mul1")

INST3_MULT = 89226354
INST3_ADD = 64248484
MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
LOP3_MASK = 0x8FFF8FFF
LOP3_XOR = 0x3B603B60
MUL1_ACC = 0x6400
MUL1_INV_BITS = 0x1EEE
MUL1_BIAS_BITS = 0xC931

#: RMS of the 3INST codebook over all 65536 states (``codebook_scale`` in exllamav3 ``quantize.py``).
CODEBOOK_SCALE_3INST = 1.24371088

#: Locked multipliers, as uint32; the marker tensors store them viewed as int32.
LOCKED_MULTIPLIERS: dict[str, int] = {"mcg": MCG_MULT, "mul1": MUL1_MULT}

_U32 = 0xFFFFFFFF


def fp16_from_bits(bits: int) -> float:
    """The value of the IEEE binary16 number with the given 16-bit pattern."""
    return float(struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0])


MUL1_INV: float = fp16_from_bits(MUL1_INV_BITS)  # 1774 * 2**-18
MUL1_BIAS: float = fp16_from_bits(MUL1_BIAS_BITS)  # -10.3828125


def normalize_codebook(name: str) -> str:
    """Canonical codebook name (``"3inst"``, ``"mcg"`` or ``"mul1"``); raises ``ValueError`` otherwise."""
    key = str(name).strip().lower()
    if key not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {name!r}; expected one of {CODEBOOKS}")
    return key


def default_multiplier(codebook: str) -> int:
    """The multiplier the current kernels use for ``codebook``."""
    cb = normalize_codebook(codebook)
    return INST3_MULT if cb == "3inst" else LOCKED_MULTIPLIERS[cb]


def _marker_value(marker: torch.Tensor | int) -> int:
    if isinstance(marker, torch.Tensor):
        return int(marker.reshape(-1)[0].item()) & _U32
    return int(marker) & _U32


def codebook_from_markers(
    mcg: torch.Tensor | int | None = None,
    mul1: torch.Tensor | int | None = None,
) -> tuple[str, int | None]:
    """Codebook name and stored multiplier from a layer's optional ``.mcg`` / ``.mul1`` marker tensors.

    The stored multiplier is returned as uint32 (``None`` for 3INST). A value other than the locked constant
    (experimental v0.0.4-v0.0.8 checkpoints) triggers a warning; pass it as ``multiplier=`` to the decoder to
    reproduce those versions, which multiplied by the stored value.
    """
    if mcg is not None and mul1 is not None:
        raise ValueError("both .mcg and .mul1 markers are present")
    if mcg is None and mul1 is None:
        return "3inst", None
    name = "mcg" if mcg is not None else "mul1"
    value = _marker_value(mcg if mcg is not None else mul1)  # type: ignore[arg-type]
    if value != LOCKED_MULTIPLIERS[name]:
        warnings.warn(
            f"EXL3 .{name} marker holds 0x{value:08X}, not the locked 0x{LOCKED_MULTIPLIERS[name]:08X}; "
            "current exllamav3 ignores the stored value, v0.0.4-v0.0.8 multiplied by it",
            stacklevel=2,
        )
    return name, value


def _bits_to_fp16(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret integer tensor values 0..65535 as fp16 bit patterns."""
    signed = ((bits & 0xFFFF) ^ 0x8000) - 0x8000
    return signed.to(torch.int16).view(torch.float16)


def _decode_lop3(x: torch.Tensor) -> torch.Tensor:
    x = (x & LOP3_MASK) ^ LOP3_XOR
    lo = _bits_to_fp16(x).to(torch.float32)
    hi = _bits_to_fp16(x >> 16).to(torch.float32)
    return lo + hi


def _decode_mul1(x: torch.Tensor) -> torch.Tensor:
    byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    h = _bits_to_fp16(byte_sum + MUL1_ACC).to(torch.float32)
    return h * MUL1_INV + MUL1_BIAS


def codebook_values(
    states: torch.Tensor,
    codebook: str,
    *,
    multiplier: int | None = None,
    fp16: bool = True,
) -> torch.Tensor:
    """Decode 16-bit trellis states (any integer dtype, values 0..65535) to codebook values.

    ``multiplier`` overrides the codebook multiplier (legacy experimental checkpoints). Returns fp16 rounded
    like the CUDA kernels when ``fp16`` is true, else the exact fp32 value before that rounding.
    """
    cb = normalize_codebook(codebook)
    mult = default_multiplier(cb) if multiplier is None else int(multiplier) & _U32
    s = states.to(torch.int64) & 0xFFFF
    if cb == "3inst":
        values = _decode_lop3((s * mult + INST3_ADD) & _U32)
    elif cb == "mcg":
        values = _decode_lop3((s * mult) & _U32)
    else:
        values = _decode_mul1((s * mult) & _U32)
    return values.half() if fp16 else values


@lru_cache(maxsize=32)
def _lut(codebook: str, multiplier: int | None, fp16: bool) -> torch.Tensor:
    return codebook_values(torch.arange(1 << 16), codebook, multiplier=multiplier, fp16=fp16)


def codebook_lut(codebook: str, *, multiplier: int | None = None, fp16: bool = True) -> torch.Tensor:
    """All 65536 codebook values, indexed by state (cached; treat as read-only)."""
    return _lut(normalize_codebook(codebook), multiplier, bool(fp16))


def codebook_rms(codebook: str, *, fp16: bool = True) -> float:
    """Root mean square of a codebook over all 65536 states."""
    return float(codebook_lut(codebook, fp16=fp16).double().pow(2).mean().sqrt())
