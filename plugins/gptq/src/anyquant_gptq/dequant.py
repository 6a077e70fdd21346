"""Bit-exact GPTQ dequantization (pure torch, CPU reference).

Rule (checked bit for bit against GPTQModel 7.6.0 ``TorchLinear.dequantize_weight``,
both its 2/4/8-bit ``_dequantize_weight_cached_248`` path and the generic
``PackableQuantLinear.dequantize_weight`` path used for 3-bit)::

    q[k, n] = field k of column n of qweight      (LSB first, packed along K)
    z[g, n] = field n of row g of qzeros          (v2 semantics, see below)
    W[k, n] = round_to(scales.dtype, float32(q - z[g_idx[k], n]) * float32(scales[g_idx[k], n]))

and the result is returned transposed, ``[out_features, in_features]``.

GPTQModel computes ``scales[g_idx] * (weight - zeros[g_idx])`` with ``weight``
and ``zeros`` as int8 (int16 for 8-bit) and ``scales`` as stored (fp16).  Torch
promotes that product to the scale dtype with one rounding of the exact
product; the exact product always fits in float32 (``|q - z| <= 255`` needs 8
bits, fp16/bf16 scales carry at most 11), so "exact integer difference, fp32
multiply, one rounding to the scale dtype" gives identical bits for fp16 and
bf16 scales (and for fp32 scales both are a single fp32 rounding).  Nothing is
folded (no ``q*s - z*s``).  The scale dtype is whatever the caller passes:
GPTQModel stores fp16 scales; pass them unchanged to reproduce GPTQModel loaded
with ``dtype=float16``.  GPTQModel loaded with ``dtype=bfloat16`` casts the
scales to bf16 *before* dequantizing (checked), so pass ``scales.to(bfloat16)``
to reproduce that; casting the fp16 result to bf16 afterwards gives different bits.

Zero points (``checkpoint_format``):

* ``"gptq_v2"``: the stored field is the zero point.
* ``"gptq"`` (v1): the stored field is ``z - 1``.  ``zero_convention`` picks the
  decoder (they agree on every symmetric checkpoint):

  - ``"gptqmodel"`` (default): GPTQModel's load-time conversion.  2/4/8-bit add
    ``0x55555555`` / ``0x11111111`` / ``0x01010101`` to each int32 word modulo
    2**32 (carries propagate into the next field), which exactly inverts
    GPTQModel's own v2 -> v1 save, asymmetric files included.  3-bit decodes
    each field, adds 1 and masks (``(f + 1) & 7``), as GPTQModel does.
  - ``"per_field_masked"``: ``(f + 1) & (2**b - 1)`` for every width
    (GPTQModel ``utils/model_dequant.py``).
  - ``"per_field"``: ``f + 1`` without a mask (exllama / AutoGPTQ ``cuda_old``);
    a stored all-ones field gives ``2**b``.
  - ``"implicit_symmetric"``: ignore ``qzeros``, use ``2**(b-1)`` (how Marlin
    kernels treat symmetric checkpoints); requires ``sym=True``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from anyquant.plugin import CheckpointError
from anyquant_runtime.packing import (
    check_bits,
    pack_cols,
    packed_length,
    unpack_cols,
    unpack_rows,
    wrapping_add_int32,
)

__all__ = [
    "CheckpointFormat",
    "ZeroConvention",
    "dequantize_gptq",
    "gptq_kernel_tensors",
    "gptq_zero_format_shown",
    "gptq_zero_label_check",
    "gptq_zero_points",
]

CheckpointFormat = Literal["gptq", "gptq_v2"]
ZeroConvention = Literal["gptqmodel", "per_field_masked", "per_field", "implicit_symmetric"]

_FORMATS = ("gptq", "gptq_v2")
_CONVENTIONS = ("gptqmodel", "per_field_masked", "per_field", "implicit_symmetric")
# One added to every field of a 32-bit word, as a single packed-word constant.
_V1_WORD_OFFSET = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def _check_format(checkpoint_format: str) -> None:
    if checkpoint_format not in _FORMATS:
        raise ValueError(f"unsupported GPTQ checkpoint_format {checkpoint_format!r}; expected {_FORMATS}")


def _v1_zero_points(qzeros: torch.Tensor, bits: int, convention: str) -> torch.Tensor:
    if convention == "gptqmodel" and bits in _V1_WORD_OFFSET:
        return unpack_cols(wrapping_add_int32(qzeros, _V1_WORD_OFFSET[bits]), bits)
    fields = unpack_cols(qzeros, bits) + 1
    if convention == "per_field":
        return fields
    return fields & ((1 << bits) - 1)


def gptq_zero_points(
    qzeros: torch.Tensor,
    *,
    bits: int,
    checkpoint_format: CheckpointFormat,
    zero_convention: ZeroConvention = "gptqmodel",
    out_features: int | None = None,
    sym: bool | None = None,
) -> torch.Tensor:
    """Decode ``qzeros`` ``[G, ceil(N*b/32)]`` to true (v2) zero points ``[G, N]`` (int32)."""
    check_bits(bits)
    _check_format(checkpoint_format)
    if zero_convention not in _CONVENTIONS:
        raise ValueError(f"unknown zero_convention {zero_convention!r}; expected {_CONVENTIONS}")
    if zero_convention == "implicit_symmetric":
        if sym is not True:
            raise ValueError("zero_convention='implicit_symmetric' requires sym=True")
        width = out_features if out_features is not None else qzeros.shape[1] * 32 // bits
        return torch.full((qzeros.shape[0], width), 1 << (bits - 1), dtype=torch.int32)
    if checkpoint_format == "gptq_v2":
        zeros = unpack_cols(qzeros, bits)
    else:
        zeros = _v1_zero_points(qzeros, bits, zero_convention)
    return zeros if out_features is None else zeros[:, :out_features].contiguous()


def _group_index(g_idx: torch.Tensor | None, in_features: int, num_groups: int) -> torch.Tensor:
    if g_idx is not None:
        if g_idx.numel() != in_features:
            raise ValueError(f"g_idx has {g_idx.numel()} entries, expected in_features={in_features}")
        index = g_idx.to(torch.int64)
    else:
        group_size = -(-in_features // num_groups)
        index = torch.arange(in_features, dtype=torch.int64) // group_size
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= num_groups):
        raise ValueError(f"g_idx values must lie in [0, {num_groups})")
    return index


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    *,
    bits: int,
    sym: bool | None,
    checkpoint_format: CheckpointFormat,
    zero_convention: ZeroConvention = "gptqmodel",
    in_features: int | None = None,
) -> torch.Tensor:
    """Dequantize one GPTQ linear to ``[out_features, in_features]`` in ``scales.dtype``.

    ``qweight`` int32 ``[ceil(K*b/32), N]``, ``qzeros`` int32 ``[G, ceil(N*b/32)]``,
    ``scales`` ``[G, N]``, ``g_idx`` ``[K]`` (``None`` means ``k // ceil(K/G)``).
    ``in_features`` defaults to ``g_idx.numel()`` or the packed row count.
    ``sym`` is only consulted by ``zero_convention="implicit_symmetric"``; the
    stored ``qzeros`` are always decoded otherwise, as GPTQModel does.
    See the module docstring for the exact arithmetic.
    """
    check_bits(bits)
    num_groups, out_features = scales.shape
    if in_features is None:
        in_features = g_idx.numel() if g_idx is not None else qweight.shape[0] * 32 // bits
    if packed_length(in_features, bits) != qweight.shape[0]:
        raise ValueError(f"qweight has {qweight.shape[0]} packed rows, not ceil({in_features}*{bits}/32)")
    codes = unpack_rows(qweight, bits, count=in_features)
    if codes.shape[1] != out_features:
        raise ValueError(f"qweight has {codes.shape[1]} columns but scales has {out_features}")
    zeros = gptq_zero_points(
        qzeros,
        bits=bits,
        checkpoint_format=checkpoint_format,
        zero_convention=zero_convention,
        out_features=out_features,
        sym=sym,
    )
    if zeros.shape[0] != num_groups:
        raise ValueError(f"qzeros has {zeros.shape[0]} groups but scales has {num_groups}")
    index = _group_index(g_idx, in_features, num_groups)
    diff = (codes - zeros[index]).to(torch.float32)
    weight = (diff * scales[index].to(torch.float32)).to(scales.dtype)
    return weight.t().contiguous()


def gptq_zero_format_shown(
    qzeros: torch.Tensor, bits: int, *, out_features: int | None = None
) -> CheckpointFormat | None:
    """Which label symmetric ``qzeros`` content shows: ``"gptq"``, ``"gptq_v2"`` or ``None``.

    Every field ``2**(b-1) - 1`` (4-bit word ``0x77777777``) shows v1; every field
    ``2**(b-1)`` (``0x88888888``) shows v2; anything else (asymmetric, empty) is ``None``.
    """
    check_bits(bits)
    fields = unpack_cols(qzeros, bits, count=out_features)
    if fields.numel() == 0:
        return None
    half = 1 << (bits - 1)
    if bool((fields == half - 1).all()):
        return "gptq"
    if bool((fields == half).all()):
        return "gptq_v2"
    return None


def gptq_zero_label_check(
    qzeros: torch.Tensor,
    bits: int,
    checkpoint_format: CheckpointFormat,
    *,
    out_features: int | None = None,
) -> CheckpointFormat | None:
    """Cross-check a declared label against symmetric ``qzeros`` content.

    Returns ``None`` when the content agrees with ``checkpoint_format`` or shows
    nothing (asymmetric zeros), else the format the tensors show, e.g.
    ``"gptq_v2"`` for a file labelled ``"gptq"`` whose 4-bit words are ``0x88888888``.
    """
    _check_format(checkpoint_format)
    shown = gptq_zero_format_shown(qzeros, bits, out_features=out_features)
    if shown is None or shown == checkpoint_format:
        return None
    return shown


def gptq_kernel_tensors(
    qzeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    *,
    bits: int,
    in_features: int,
    out_features: int,
    groups: int,
    checkpoint_format: str,
    sym: bool | None,
    group_size: int | None,
) -> dict[str, Any]:
    """What a GPTQModel GPTQ kernel needs beyond qweight/scales, decided by the tensors.

    Returns ``qzeros_v2`` (true zeros, packed), ``qzeros_v1`` (``z - 1``, packed), ``g_idx``
    (``k // group_size`` when the checkpoint has none), ``group_size`` (-1: one group),
    ``sym`` (every zero is ``2**(b-1)``) and ``desc_act`` (``g_idx`` is not sequential).
    """
    zeros = gptq_zero_points(
        qzeros,
        bits=bits,
        checkpoint_format=checkpoint_format,  # type: ignore[arg-type]
        out_features=out_features,
        sym=sym,
    )
    mask = (1 << bits) - 1
    half = 1 << (bits - 1)
    if groups == 1:
        gs = -1
    elif group_size is not None and group_size > 0 and -(-in_features // group_size) == groups:
        gs = group_size
    elif in_features % groups == 0:
        gs = in_features // groups
    else:
        raise CheckpointError(f"{groups} scale groups do not divide in_features={in_features}; set group_size")
    step = in_features if gs == -1 else gs
    sequential = torch.arange(in_features, dtype=torch.int32) // step
    if g_idx is None:
        g_idx = sequential
    desc_act = not torch.equal(g_idx.to(torch.int32), sequential)
    return {
        "qzeros_v2": pack_cols(zeros & mask, bits),
        "qzeros_v1": pack_cols((zeros - 1) & mask, bits),
        "g_idx": g_idx.to(torch.int32),
        "group_size": gs,
        "sym": bool((zeros == half).all()),
        "desc_act": desc_act,
    }
