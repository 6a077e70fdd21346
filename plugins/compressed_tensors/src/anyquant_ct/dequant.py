"""compressed-tensors' decompression, bit for bit (compressed-tensors 0.20's compressors are the judge), and the
input-activation quantization its forward applies.

Every function does the same torch operations in the same dtypes as compressed-tensors' own
(``compressors/*/base.py``, ``quantization/lifecycle/forward_helpers.py``), so the result is the same to the bit:
the weight comes out in the scale's dtype (``bfloat16`` for FP4, whose scales are FP8 or E8M0).
"""

from __future__ import annotations

import math

import torch

from anyquant_runtime.activations import E2M1, round_fp4

from .scheme import QArgs

__all__ = [
    "E2M1",
    "dequantize_fp4",
    "dequantize_naive",
    "dequantize_packed",
    "quantize_input",
    "unpack_int32",
]


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """int8 ``[rows, cols]`` from compressed-tensors' dense packing: element ``i`` of a row is the ``bits`` bits at bit
    ``i * bits`` of the row's int32 words read as one little-endian bit string (an element may straddle two words),
    stored with an offset of ``2**(bits-1)``."""
    rows, words = packed.shape
    if words * 32 < cols * bits:
        raise ValueError(f"{words} int32 words hold {words * 32 // bits} {bits}-bit values, not {cols}")
    offset = 1 << (bits - 1)
    if bits in (2, 4, 8):  # no straddling: split the bytes
        b = packed.contiguous().view(torch.uint8).view(rows, words * 4)
        per = 8 // bits
        mask = (1 << bits) - 1
        parts = [(b >> (bits * j)) & mask for j in range(per)]
        vals = torch.stack(parts, -1).view(rows, -1)[:, :cols]
        return (vals.to(torch.int16) - offset).to(torch.int8)
    w = packed.to(torch.int64) & 0xFFFFFFFF
    w = torch.nn.functional.pad(w, (0, 1))
    start = torch.arange(cols, dtype=torch.int64) * bits
    idx, shift = start // 32, start % 32
    lo = w[:, idx] >> shift
    hi = w[:, idx + 1] << (32 - shift)
    vals = (lo | hi) & ((1 << bits) - 1)
    return (vals - offset).to(torch.int8)


def _group_columns(scale: torch.Tensor, g_idx: torch.Tensor | None, cols: int, group_size: int) -> torch.Tensor:
    """``scale`` ``[rows, groups]`` expanded to one column per weight column (by ``g_idx`` when given)."""
    if g_idx is None:
        return scale.repeat_interleave(group_size, dim=1)[:, :cols]
    return scale.index_select(1, g_idx.to(torch.long))


def _apply(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    args: QArgs,
    g_idx: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """compressed-tensors' ``dequantize(x_q, scale, zero_point, args, dtype, global_scale)`` for a weight ``[out, in]``:
    ``(q.to(s.dtype) - z.to(s.dtype)) * s`` with ``s = scale / global_scale``, per tensor, channel, group or block."""
    rows, cols = q.shape
    if args.strategy in ("group", "tensor_group"):
        assert args.group_size is not None
        if g_idx is None and cols % args.group_size:
            raise ValueError(f"{cols} columns are not a multiple of the group size {args.group_size}")
        s = _group_columns(scale, g_idx, cols, args.group_size)
        z = None if zero is None else _group_columns(zero, g_idx, cols, args.group_size)
    elif args.strategy == "block":
        assert args.block_structure is not None
        bh, bw = args.block_structure
        s = scale.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:rows, :cols]
        z = None if zero is None else zero.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:rows, :cols]
    else:  # tensor, channel: the scale broadcasts as stored
        s = scale.reshape(-1, 1) if scale.dim() == 2 else scale
        z = None if zero is None else (zero.reshape(-1, 1) if zero.dim() == 2 else zero)
    if global_scale is not None:
        s = s / global_scale
    w = q.to(s.dtype)
    if z is not None:
        w = w - z.to(s.dtype)
    w = w * s
    return w if out_dtype is None else w.to(out_dtype)


def dequantize_packed(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_packed: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    args: QArgs,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``pack-quantized``: the weight ``[out, in]`` in the scale's dtype."""
    out, cols = shape
    q = unpack_int32(packed, args.num_bits, cols)
    zero = None
    if zero_packed is not None:
        if args.strategy in ("group", "channel"):  # packed along the output dimension
            groups = scale.shape[-1] if scale.dim() == 2 else 1
            zero = unpack_int32(zero_packed.t(), args.num_bits, out).t().reshape(out, groups)
        else:
            zero = zero_packed
    return _apply(q, scale, zero, args, g_idx=g_idx, out_dtype=scale.dtype)


def dequantize_naive(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    args: QArgs,
) -> torch.Tensor:
    """``int-quantized``, ``float-quantized``, ``naive-quantized``: int8 or FP8 ``weight`` times its scale, in the
    scale's dtype."""
    return _apply(weight, scale, zero, args, g_idx=g_idx, out_dtype=scale.dtype)


def fp4_values(packed: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``unpack_fp4_from_uint8``: two E2M1 codes a byte, the low nibble first, as ``dtype`` ``[rows, 2 * cols]``."""
    rows, cols = packed.shape
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((packed & 0x0F, packed >> 4), -1).reshape(rows, 2 * cols)
    values = table[(codes & 0x07).to(torch.long)] * torch.where((codes & 0x08).bool(), -1.0, 1.0)
    return values.to(dtype)


def mx_scale(scale: torch.Tensor) -> torch.Tensor:
    """``decompress_mx_scale``: E8M0 exponents (uint8) as ``2 ** (e - 127)`` in bfloat16."""
    return 2.0 ** (scale.view(torch.uint8).to(torch.int32) - 127).to(torch.bfloat16)


def dequantize_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | None,
    args: QArgs,
    *,
    mx: bool,
) -> torch.Tensor:
    """``nvfp4-pack-quantized`` (FP8 E4M3 scales per 16, divided by ``weight_global_scale``) and
    ``mxfp4-pack-quantized`` (E8M0 scales per 32): the weight in bfloat16."""
    values = fp4_values(packed)
    s = mx_scale(scale) if mx else scale.to(values.dtype)
    return _apply(values, s, None, args, global_scale=global_scale, out_dtype=values.dtype)


# ------------------------------------------------------------------------------------------ activations

_FP8_MAX = 448.0


def _range(args: QArgs) -> tuple[float, float]:
    if args.type == "int":
        return float(-(1 << (args.num_bits - 1))), float((1 << (args.num_bits - 1)) - 1)
    if args.num_bits == 8:
        return -_FP8_MAX, _FP8_MAX
    if args.num_bits == 4:
        return -6.0, 6.0
    raise ValueError(f"input activations of {args.describe()} are not supported")


def _round(x: torch.Tensor, args: QArgs, lo: float, hi: float) -> torch.Tensor:
    """``round_to_quantized_type_args``: FP8 by a cast through float8_e4m3fn, FP4 to the nearest E2M1 value, integers
    by round-half-even."""
    x = torch.clamp(x, lo, hi)
    if args.type == "float" and args.num_bits == 8:
        return x.to(torch.float8_e4m3fn).to(x.dtype)
    if args.type == "float":
        return round_fp4(x)
    return torch.round(x)


def _minmax(x: torch.Tensor, args: QArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The observed range of ``x`` per token (last dimension), per group of the last dimension, or over all."""
    if args.strategy == "token":
        return torch.amin(x, dim=-1, keepdim=True), torch.amax(x, dim=-1, keepdim=True)
    if args.strategy == "tensor":
        mn, mx = torch.aminmax(x)
        return mn, mx
    if args.strategy in ("group", "tensor_group"):
        assert args.group_size is not None
        g = x.reshape(*x.shape[:-1], x.shape[-1] // args.group_size, args.group_size)
        return torch.amin(g, dim=-1), torch.amax(g, dim=-1)
    raise ValueError(f"dynamic input quantization per {args.strategy!r} is not supported")


def quantize_input(
    x: torch.Tensor,
    args: QArgs,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """compressed-tensors' ``forward_quantize`` of a linear's input: fake quantization (quantize, then dequantize) with
    scales computed from ``x`` when ``args.dynamic`` (per token, group or tensor; ``calculate_qparams``: symmetric
    ``max|x| / ((q_max - q_min) / 2)``, times ``global_scale``, rounded to ``args.scale_dtype``), else the stored
    ``input_scale`` (and ``input_zero_point``)."""
    lo, hi = _range(args)
    grouped = args.strategy in ("group", "tensor_group")
    if grouped and (args.group_size is None or x.shape[-1] % args.group_size):
        raise ValueError(f"{x.shape[-1]} input columns are not a multiple of the group size {args.group_size}")
    if args.dynamic:
        mn, mx = _minmax(x, args)
        mn = torch.minimum(mn, torch.zeros_like(mn))
        mx = torch.maximum(mx, torch.zeros_like(mx))
        if args.symmetric:
            s = torch.maximum(mn.abs(), mx.abs()) / ((hi - lo) / 2)
            z = None
        else:
            s = (mx - mn) / (hi - lo)
            z = torch.clamp(lo - mn / s, lo, hi)
            if args.type == "int":
                z = torch.round(z)
        if global_scale is not None:
            s = global_scale * s
        eps = torch.finfo(s.dtype).eps
        if args.scale_dtype == "float8_e4m3fn":
            s = torch.clamp(s, -_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).to(s.dtype)
            eps = 0.125
        s = torch.where(s == 0, torch.full_like(s, eps), s)
    else:
        if scale is None:
            raise ValueError("static input quantization without an input_scale")
        s = scale.to(x.dtype)
        z = None if zero is None else zero.to(x.dtype)
    if grouped:
        assert args.group_size is not None
        shape = x.shape
        x = x.reshape(*shape[:-1], shape[-1] // args.group_size, args.group_size)
        s = s.unsqueeze(-1)
        z = None if z is None else z.unsqueeze(-1)
    if global_scale is not None:
        s = s / global_scale
    scaled = x / s
    if z is not None:
        scaled = scaled + z
    q = _round(scaled, args, lo, hi)
    out = q.to(s.dtype)
    if z is not None:
        out = out - z.to(s.dtype)
    out = out * s
    return out.flatten(-2) if grouped else out


def packed_columns(in_features: int, bits: int) -> int:
    """How many int32 words compressed-tensors packs ``in_features`` values of ``bits`` into."""
    return math.ceil(in_features * bits / 32)
