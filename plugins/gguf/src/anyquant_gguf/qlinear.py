"""A linear layer that keeps GGUF-quantized weights packed, with pure-torch dequant.

:func:`dequantize_blocks_torch` reproduces ``gguf.quants.dequantize`` bit for bit: it
performs the same float32 operations in the same order (no fused multiply-add), so
``torch.equal`` holds against the numpy reference.

Block layouts (bytes, little endian; ``d``/``m``/``dmin`` are float16):

* Q4_0 (32 w, 18 B): d, 16 B nibbles (low nibbles = weights 0-15, high = 16-31); w = d*(q-8)
* Q4_1 (32 w, 20 B): d, m, 16 B nibbles; w = d*q + m
* Q5_0 (32 w, 22 B): d, 4 B high bits (bit i -> weight i), 16 B nibbles; w = d*(q-16)
* Q5_1 (32 w, 24 B): d, m, 4 B high bits, 16 B nibbles; w = d*q + m
* Q8_0 (32 w, 34 B): d, 32 int8; w = q*d
* Q2_K .. Q6_K (256 w super-blocks): see the per-type functions below.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from torch import nn

from .reader import UnsupportedGGUFType, load_raw, load_tensor

__all__ = [
    "CHUNK_WEIGHTS",
    "GGUFEmbedding",
    "GGUFLinear",
    "GGUFRows",
    "GGUFTiedHead",
    "fast_tied_head",
    "INT4_TYPES",
    "PACKED_TYPES",
    "gguf_int4_linear",
    "int4_codes_scales_offsets",
    "dequantize_blocks_torch",
    "gguf_linear_from_reader",
]

Q = GGMLQuantizationType
Mode = Literal["on-the-fly", "dequant-at-load"]
MODES: tuple[str, ...] = ("on-the-fly", "dequant-at-load")
_QK_K = 256
#: An on-the-fly weight larger than ``CHUNK_ABOVE`` values is dequantized and multiplied in slices
#: of about ``CHUNK_WEIGHTS`` values (1 MiB of float32): a tied 49152 x 576 LM head would otherwise
#: add 113 MiB to every forward's peak, and slices that stay in cache are faster. Smaller weights
#: are not sliced: a GEMM split by output rows sums in another order for some shapes (measured on
#: SmolLM2's linears: prompt logits off by up to 7e-5, outside the 1e-5 the tests hold to).
CHUNK_WEIGHTS = 1 << 18
CHUNK_ABOVE = 1 << 22


_NIBBLE = (0, 4)
_CRUMB = (0, 2, 4, 6)
_BITS = (0, 1, 2, 3, 4, 5, 6, 7)


def _f16(b: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes ``start:start+2`` of each block (``[n, type_size]`` uint8) -> ``[n, 1]`` float32.

    Read through a float16 view of the whole block matrix (no gather copy) when its layout
    allows one; the float16 -> float32 conversion is exact.
    """
    try:
        halves = b.view(torch.float16)
    except RuntimeError:  # odd storage offset or strided rows
        return b[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)
    return halves[:, start // 2 : start // 2 + 1].to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` uint8 -> ``[n, 32]`` float32: low nibbles (weights 0-15), then high ones.

    Each half is converted straight into its columns of the output (no stacked uint8 copy).
    """
    out = torch.empty(qs.shape[0], 2 * qs.shape[1], dtype=torch.float32)
    out[:, : qs.shape[1]].copy_(qs & 0x0F)
    out[:, qs.shape[1] :].copy_(qs >> 4)
    return out


def _unpack(x: torch.Tensor, chunk: int, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """Split each ``chunk``-byte group into ``len(shifts)`` bit fields, field-major.

    ``[n, k*chunk]`` uint8 -> ``[n, k, len(shifts), chunk]`` uint8 (numpy's reference
    order). One contiguous op per field: much faster than a broadcast shift.
    """
    groups = x.reshape(x.shape[0], -1, chunk)
    fields = []
    for shift in shifts:
        field = groups >> shift if shift else groups
        fields.append(field if shift + mask.bit_length() >= 8 else field & mask)
    return torch.stack(fields, dim=2)


def _float(q: torch.Tensor, *shape: int) -> torch.Tensor:
    return q.reshape(*shape).to(torch.float32)


# The float ops below run in place on a fresh float32 tensor (fewer large
# allocations); ``q.mul_(d)`` is the same IEEE product as numpy's ``d * q``.


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 2:]).sub_(8).mul_(_f16(b, 0))  # q - 8 is exact in float32


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:]).mul_(_f16(b, 0)).add_(_f16(b, 2))


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """4 bytes of a little-endian uint32 (bit i -> weight i) + 16 nibble bytes."""
    low = _unpack(qs, 16, _NIBBLE, 0x0F).reshape(qs.shape[0], -1)
    high = _unpack(qh, 1, _BITS, 1).reshape(qh.shape[0], -1)
    return low | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _five_bit(b[:, 2:6], b[:, 6:]).view(torch.int8) - 16
    return _float(q, b.shape[0], -1).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _float(_five_bit(b[:, 4:8], b[:, 8:]), b.shape[0], -1)
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).to(torch.float32).mul_(_f16(b, 0))


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """scales[16] (low nibble scale, high nibble min), qs[64] 2-bit, d, dmin."""
    n = b.shape[0]
    scales = b[:, :16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _float(_unpack(b[:, 16:80], 32, _CRUMB, 3), n, 16, 16)
    return q.mul_(dl).sub_(ml).reshape(n, _QK_K)


def _q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """12 bytes -> 16 signed 6-bit scales, as float32."""
    n = scales.shape[0]
    low = _unpack(scales[:, :8], 8, _NIBBLE, 0x0F).reshape(n, 16)
    high = _unpack(scales[:, 8:], 4, _CRUMB, 3).reshape(n, 16)
    return _float((low | (high << 4)).view(torch.int8) - 32, n, 16)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """hmask[32], qs[64] 2-bit, scales[12] 6-bit, d."""
    n = b.shape[0]
    dl = (_f16(b, 108) * _q3_k_scales(b[:, 96:108])).reshape(n, 16, 1)
    low = _unpack(b[:, 32:96], 32, _CRUMB, 3).reshape(n, 16, 16)
    high = _unpack(b[:, :32], 32, _BITS, 1).reshape(n, 16, 16) ^ 1  # clear bit -> minus 4
    q = low.view(torch.int8) - (high << 2).view(torch.int8)
    return _float(q, n, 16, 16).mul_(dl).reshape(n, _QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins."""
    s = scales.reshape(scales.shape[0], 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d, dmin, scales[12] -> per-32-weight scale and min, ``[n, 8, 1]`` each."""
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = (d * sc.to(torch.float32)).reshape(n, -1, 1)
    offset = (dmin * mn.to(torch.float32)).reshape(n, -1, 1)
    return scale, offset


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin, scales[12], qs[128] nibbles (per 32 bytes: 32 low, then 32 high)."""
    n = b.shape[0]
    scale, offset = _k_scales(b)
    q = _float(_unpack(b[:, 16:], 32, _NIBBLE, 0x0F), n, -1, 32)
    return q.mul_(scale).sub_(offset).reshape(n, _QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin, scales[12], qh[32] (bit j of byte i -> weight 32*j + i), qs[128]."""
    n = b.shape[0]
    scale, offset = _k_scales(b)
    low = _unpack(b[:, 48:], 32, _NIBBLE, 0x0F).reshape(n, -1, 32)
    high = _unpack(b[:, 16:48], 32, _BITS, 1).reshape(n, -1, 32)
    q = _float(low | (high << 4), n, -1, 32)
    return q.mul_(scale).sub_(offset).reshape(n, _QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """ql[128] low nibbles, qh[64] 2-bit highs, scales[16] int8, d; w = d*s*(q-32)."""
    n = b.shape[0]
    scales = b[:, 192:208].view(torch.int8).to(torch.float32)
    dl = (_f16(b, 208) * scales).reshape(n, 16, 1)
    low = _unpack(b[:, :128], 64, _NIBBLE, 0x0F).reshape(n, -1, 32)
    high = _unpack(b[:, 128:192], 32, _CRUMB, 3).reshape(n, -1, 32)
    q = (low | (high << 4)).view(torch.int8) - 32
    return _float(q, n, 16, 16).mul_(dl).reshape(n, _QK_K)


_BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}
_DENSE: dict[GGMLQuantizationType, torch.dtype] = {
    Q.F32: torch.float32,
    Q.F16: torch.float16,
    Q.BF16: torch.bfloat16,
}
#: Block-quantized types :class:`GGUFLinear` keeps packed.
PACKED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_BLOCK_DEQUANT)


def _unsupported(qtype: GGMLQuantizationType) -> UnsupportedGGUFType:
    names = ", ".join(sorted(t.name for t in (*_BLOCK_DEQUANT, *_DENSE)))
    return UnsupportedGGUFType(f"GGML type {qtype.name} is not supported by the torch dequantizer (supported: {names})")


def packed_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of logical ``shape`` occupies in GGML type ``qtype``."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = 1
    for dim in shape:
        numel *= dim
    if shape and shape[-1] % block_size:
        raise ValueError(f"row size {shape[-1]} is not a multiple of the {qtype.name} block size {block_size}")
    return numel // block_size * type_size


def dequantize_blocks_torch(
    raw: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, ...] | torch.Size
) -> torch.Tensor:
    """Dequantize raw GGUF bytes (``uint8``, any shape) to a float32 tensor of ``shape``."""
    qtype = GGMLQuantizationType(qtype)
    shape = tuple(shape)
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw GGUF data must be uint8, got {raw.dtype}")
    if qtype not in _BLOCK_DEQUANT and qtype not in _DENSE:
        raise _unsupported(qtype)
    expected = packed_nbytes(qtype, shape)
    if raw.numel() != expected:
        raise ValueError(f"{qtype.name} {list(shape)} needs {expected} bytes, got {raw.numel()}")
    flat = raw.reshape(-1)
    if qtype in _DENSE:
        return flat.view(_DENSE[qtype]).to(torch.float32).reshape(shape)
    type_size = GGML_QUANT_SIZES[qtype][1]
    return _BLOCK_DEQUANT[qtype](flat.reshape(-1, type_size)).reshape(shape)


def chunked_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qtype: GGMLQuantizationType,
    shape_out_in: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + b`` for packed ``W``, dequantized about ``CHUNK_WEIGHTS`` values at a time.

    Each slice of output rows is dequantized and multiplied straight into its columns of a
    preallocated output (a strided GEMM destination: no concatenation copy), so the transient
    float32 weight is one slice, not the whole matrix.
    """
    out_features, in_features = shape_out_in
    x2d = x.reshape(-1, in_features)
    out = x2d.new_empty(x2d.shape[0], out_features)
    step = max(1, CHUNK_WEIGHTS // in_features)
    for start in range(0, out_features, step):
        stop = min(start + step, out_features)
        weight = dequantize_blocks_torch(qweight[start:stop], qtype, (stop - start, in_features))
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        torch.mm(x2d, weight.t(), out=out[:, start:stop])
    if bias is not None:
        out.add_(bias.to(out.dtype))
    return out.reshape(*x.shape[:-1], out_features)


class GGUFLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` kept as packed GGUF blocks (``qweight``, uint8).

    Modes: ``"on-the-fly"`` dequantizes the whole weight in every forward (memory: the
    packed bytes only, which stay file-backed when they come from the mmap);
    ``"dequant-at-load"`` dequantizes once and caches the float32 weight
    (non-persistent buffer; faster, 4 bytes per weight of anonymous memory).
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        qtype: GGMLQuantizationType | int,
        shape_out_in: tuple[int, int],
        bias: torch.Tensor | None = None,
        mode: Mode = "on-the-fly",
    ) -> None:
        super().__init__()
        qtype = GGMLQuantizationType(qtype)
        if qtype not in PACKED_TYPES:
            raise _unsupported(qtype)
        out_features, in_features = (int(d) for d in shape_out_in)
        if qweight.dtype != torch.uint8 or qweight.numel() != packed_nbytes(qtype, (out_features, in_features)):
            shape = f"[{out_features}, {in_features}]"
            raise ValueError(f"qweight must hold the uint8 {qtype.name} bytes of a {shape} weight")
        self.qtype = qtype
        self.out_features = out_features
        self.in_features = in_features
        self.qweight: torch.Tensor
        self.weight_cache: torch.Tensor | None
        self.register_buffer("qweight", qweight.reshape(out_features, -1))
        self.bias = None if bias is None else nn.Parameter(bias.reshape(out_features), requires_grad=False)
        self.register_buffer("weight_cache", None, persistent=False)
        self.mode: Mode = "on-the-fly"
        self.set_mode(mode)

    @classmethod
    def from_raw(
        cls,
        raw_uint8: torch.Tensor,
        qtype: GGMLQuantizationType | int,
        shape_out_in: tuple[int, int],
        bias: torch.Tensor | None = None,
        *,
        mode: Mode = "on-the-fly",
    ) -> GGUFLinear:
        """Wrap raw GGUF bytes (rows in HF order) without copying them."""
        return cls(raw_uint8, qtype, shape_out_in, bias=bias, mode=mode)

    def set_mode(self, mode: Mode) -> None:
        """Switch between ``"on-the-fly"`` and ``"dequant-at-load"`` (builds/drops the cache)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.weight_cache = self.dequantize() if mode == "dequant-at-load" else None

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 ``[out_features, in_features]``."""
        return dequantize_blocks_torch(self.qweight, self.qtype, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_cache is None and self.out_features * self.in_features > CHUNK_ABOVE:
            return self._forward_chunked(x)
        weight = self.weight_cache if self.weight_cache is not None else self.dequantize()
        bias: torch.Tensor | None = self.bias
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
            bias = None if bias is None else bias.to(x.dtype)
        return F.linear(x, weight, bias)

    def _forward_chunked(self, x: torch.Tensor) -> torch.Tensor:
        return chunked_linear(x, self.qweight, self.qtype, (self.out_features, self.in_features), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"qtype={self.qtype.name}, bias={self.bias is not None}, mode={self.mode}"
        )


class GGUFEmbedding(nn.Module):
    """``nn.Embedding`` over packed GGUF rows: only the looked-up rows are dequantized.

    ``qweight`` is ``uint8`` ``[num_embeddings, bytes_per_row]`` (file-backed when it comes
    from the mmap); the output is float32 rows, bit-identical to indexing the fully
    dequantized table, cast to ``dtype``, then multiplied by ``scale`` (in ``dtype``) when one is
    given: what Gemma's ``ScaledWordEmbedding`` (``embed_scale``, sqrt(hidden)) does.
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        qtype: GGMLQuantizationType | int,
        shape: tuple[int, int],
        *,
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        qtype = GGMLQuantizationType(qtype)
        if qtype not in PACKED_TYPES and qtype not in _DENSE:
            raise _unsupported(qtype)
        num, dim = (int(d) for d in shape)
        if qweight.dtype != torch.uint8 or qweight.numel() != packed_nbytes(qtype, (num, dim)):
            raise ValueError(f"qweight must hold the uint8 {qtype.name} bytes of a [{num}, {dim}] table")
        self.qtype = qtype
        self.num_embeddings = num
        self.embedding_dim = dim
        self.dtype = dtype
        self.scale = None if scale is None else float(scale)
        self.qweight: torch.Tensor
        self.register_buffer("qweight", qweight.reshape(num, -1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.qweight.index_select(0, flat)
        values = dequantize_blocks_torch(rows, self.qtype, (flat.numel(), self.embedding_dim)).to(self.dtype)
        if self.scale is not None:
            values = values * torch.tensor(self.scale, dtype=self.dtype)
        return values.reshape(*ids.shape, self.embedding_dim)

    def dequantize(self) -> torch.Tensor:
        """The whole table as float32 ``[num_embeddings, embedding_dim]``."""
        return dequantize_blocks_torch(self.qweight, self.qtype, (self.num_embeddings, self.embedding_dim))

    def extra_repr(self) -> str:
        scale = "" if self.scale is None else f", scale={self.scale}"
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}, dtype={self.dtype}{scale}"


class GGUFTiedHead(nn.Module):
    """An LM head tied to a packed token embedding: ``logits = x @ E.T`` over ``E``'s GGUF bytes.

    ``qweight`` is the same ``uint8`` table as the :class:`GGUFEmbedding`'s (one copy, file
    backed); every forward dequantizes it slice by slice (:func:`chunked_linear`, ~1 MiB of
    float32 at a time) instead of keeping a dense ``[vocab, hidden]`` copy.
    """

    def __init__(self, qweight: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, int]) -> None:
        super().__init__()
        qtype = GGMLQuantizationType(qtype)
        if qtype not in PACKED_TYPES:
            raise _unsupported(qtype)
        out_features, in_features = (int(d) for d in shape)
        if qweight.dtype != torch.uint8 or qweight.numel() != packed_nbytes(qtype, (out_features, in_features)):
            raise ValueError(
                f"qweight must hold the uint8 {qtype.name} bytes of a [{out_features}, {in_features}] table"
            )
        self.qtype = qtype
        self.out_features = out_features
        self.in_features = in_features
        self.qweight: torch.Tensor
        self.register_buffer("qweight", qweight.reshape(out_features, -1))

    #: the table is the input embedding's (``export_dense`` ties the dense copies again)
    tied_to_input_embedding = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return chunked_linear(x, self.qweight, self.qtype, (self.out_features, self.in_features))

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 ``[out_features, in_features]`` (for export, not the forward)."""
        return dequantize_blocks_torch(self.qweight, self.qtype, (self.out_features, self.in_features))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype.name}, tied"


class GGUFRows:
    """A GGUF-packed ``[rows, dim]`` table read as float32 a slice of rows at a time (decoded from its
    blocks on each read; the bytes stay where they are, file-backed): the exact source of a ``cpu-fast``
    :class:`~anyquant.runtime.fastcpu.FastHead` over a tied embedding (a ``RowTable``)."""

    dtype = torch.float32

    def __init__(self, qweight: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, int]) -> None:
        self.qtype = GGMLQuantizationType(qtype)
        self.shape: tuple[int, int] = (int(shape[0]), int(shape[1]))
        self.qweight = qweight.reshape(self.shape[0], -1)

    def slice(self, start: int, count: int) -> torch.Tensor:
        start = max(0, int(start))
        stop = max(start, min(start + int(count), self.shape[0]))
        return dequantize_blocks_torch(self.qweight[start:stop], self.qtype, (stop - start, self.shape[1]))

    def read_all(self) -> torch.Tensor:
        return self.slice(0, self.shape[0])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        values = dequantize_blocks_torch(self.qweight[flat], self.qtype, (flat.numel(), self.shape[1]))
        return values.reshape(*ids.shape, self.shape[1])


def fast_tied_head(
    qweight: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, int], *, small_rows: int
) -> nn.Module | None:
    """``cpu-fast``'s LM head tied to a packed token embedding: a bfloat16 copy prepacked for oneDNN for
    decode (the format's tolerance class, as every ``cpu-fast`` head), the GGUF bytes decoded a slice at a
    time for prompts; ``None`` where the prepacked kernel cannot run (no AMX or AVX512-BF16: the caller
    keeps a :class:`GGUFTiedHead`). A :class:`GGUFTiedHead` decodes the whole table on every decode step
    (SmolLM2's 49152 x 576 Q8_0 head: about half of a step)."""
    from anyquant.runtime.fastcpu import FastHead, bf16_head_status

    if not bf16_head_status()[0]:
        return None
    head = FastHead(GGUFRows(qweight, qtype, shape), small_rows=small_rows)
    head.tied_to_input_embedding = True  # type: ignore[assignment]  # export_dense ties the copies again
    return head


# --------------------------------------------------------------------------- int4 CPU kernel

#: Types whose weights are ``scale * q + offset`` with 4-bit codes ``q`` and one scale/offset per
#: 32 consecutive weights of a row: what torch's int4 CPU kernel computes (group size 32).
INT4_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})


def int4_codes_scales_offsets(
    qweight: torch.Tensor, qtype: GGMLQuantizationType, shape_out_in: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [out, in] uint8, scales [out, in/32] f32, offsets [out, in/32] f32)`` with
    ``W = scales * codes + offsets`` evaluated in float32 (multiply, then add) equal, bit for
    bit, to :func:`dequantize_blocks_torch`:

    * Q4_0: ``d * (q - 8)`` = ``d * q + (-8 d)`` exactly (``d`` is a float16 value, so ``8 d``
      and the sum are exact in float32);
    * Q4_1: ``d * q + m``;
    * Q4_K: ``(d * sc) * q - dmin * mn`` per 32-weight sub-block (subtracting is adding the
      negation).
    """
    out_features, in_features = shape_out_in
    b = qweight.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    scales, offsets = _int4_scales_offsets(b, qtype, out_features)
    if qtype == Q.Q4_K:
        codes = _unpack(b[:, 16:], 32, _NIBBLE, 0x0F).reshape(-1, _QK_K)
    else:
        qs = b[:, 4:] if qtype == Q.Q4_1 else b[:, 2:]
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    return codes.reshape(out_features, in_features), scales.contiguous(), offsets.contiguous()


def _int4_scales_offsets(
    b: torch.Tensor, qtype: GGMLQuantizationType, out_features: int, *, offsets: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' ``(scales, offsets)``, float32 ``[out, in/32]`` (see :func:`int4_codes_scales_offsets`);
    Q4_0 with ``offsets=False``: the scales twice (its offsets are ``-8 d``: the caller writes them)."""
    if qtype == Q.Q4_K:
        scale, offset = _k_scales(b)  # [n, 8, 1]: per 32-weight sub-block
        return scale.reshape(out_features, -1), offset.neg().reshape(out_features, -1)
    scales = _f16(b, 0).reshape(out_features, -1)
    if qtype == Q.Q4_1:
        return scales, _f16(b, 2).reshape(out_features, -1)
    if qtype == Q.Q4_0:
        return scales, scales * -8.0 if offsets else scales
    raise _unsupported(qtype)


def _int4_pairs(b: torch.Tensor, qtype: GGMLQuantizationType, out_features: int) -> torch.Tensor:
    """The blocks' nibble bytes as :func:`~anyquant.runtime.fastcpu.pack_int4_pairs` reads them (a view):
    Q4_0/Q4_1 hold weights ``i`` and ``16 + i`` of a 32-weight block in byte ``i``; Q4_K weights ``64c + i``
    and ``64c + 32 + i`` of a 256-weight super-block in byte ``32c + i``."""
    header = {Q.Q4_0: 2, Q.Q4_1: 4, Q.Q4_K: 16}[qtype]
    half = 32 if qtype == Q.Q4_K else 16
    blocks = b.view(out_features, -1, b.shape[-1])[:, :, header:]
    return blocks.view(out_features, blocks.shape[1], -1, half)


@functools.cache
def _int4_class() -> type[nn.Module]:
    """:class:`anyquant.runtime.fastcpu.FastInt4Linear` with a float offset per group.

    The base class takes integer zero points (``W = (q - z) * s``); GGUF's Q4_1/Q4_K offsets are
    arbitrary floats. The int4 kernel computes ``(q - 8) * s + m`` with any ``m``, so only its
    ``scales_and_zeros`` (``m = offset + 8 s``, bfloat16 like the base's) and the exact dense
    weight of the many-rows path (``s * q + offset`` in float32) differ.
    """
    from anyquant.runtime.fastcpu import FastInt4Linear, int4pack_status, pack_int4_pairs

    class GGUFInt4Linear(FastInt4Linear):
        """A Q4_0/Q4_1/Q4_K linear repacked for torch's int4 CPU kernel (decode: bfloat16
        activations; prompts: exact float32 weight, dequantized per forward, and GEMM).

        The kernel's layout is written straight from the blocks' nibble bytes
        (:func:`~anyquant.runtime.fastcpu.pack_int4_pairs`: no unpacked codes, a few whole-tensor
        ops per layer) when the rows fill the kernel's blocks, else from unpacked, padded codes.
        """

        offsets: torch.Tensor

        def __init__(
            self,
            qweight: torch.Tensor,
            qtype: GGMLQuantizationType,
            shape_out_in: tuple[int, int],
            bias: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> None:
            out_features = shape_out_in[0]
            b = qweight.reshape(-1, GGML_QUANT_SIZES[qtype][1])
            block = int4pack_status().block_n
            direct = block > 0 and out_features % block == 0
            if direct:
                scales_og, offsets_og = _int4_scales_offsets(b, qtype, out_features, offsets=qtype != Q.Q4_0)
                codes = None
                packed = pack_int4_pairs(_int4_pairs(b, qtype, out_features), block)
            else:
                codes_oi, scales_og, offsets_og = int4_codes_scales_offsets(qweight, qtype, shape_out_in)
                codes, packed = codes_oi.t(), None
            scales = scales_og.t()  # [G, out]
            groups = scales.shape[0]
            offsets = torch.empty(groups, out_features)
            if qtype == Q.Q4_0:  # -8 d, as _int4_scales_offsets gives it, written straight in [G, out] order
                torch.mul(scales, -8.0, out=offsets)
            else:
                offsets.copy_(offsets_og.t())
            # the kernel's (s, m = offset + 8 s); s stays what the base keeps as the exact scale (bf16(s) in
            # the kernel's column: the many-rows path recovers s bit for bit from the base's buffers)
            pairs = torch.empty(groups, out_features, 2)
            pairs[..., 0].copy_(scales)
            torch.mul(scales, 8.0, out=pairs[..., 1])
            pairs[..., 1].add_(offsets)
            zeros = torch.zeros((1, 1), dtype=torch.uint8).expand(groups, out_features)
            super().__init__(codes, zeros, scales, bias=bias, packed=packed, kernel_pairs=pairs, **kwargs)
            del codes, packed, pairs
            self.qtype = qtype
            self.register_buffer("offsets", offsets)

        def weight_kn(self, dtype: torch.dtype | None = None) -> torch.Tensor:
            k, n = self.in_features, self.out_features
            w = self._codes_kn().reshape(k // 32, 32, n).to(torch.float32)
            w.mul_(self.exact_scales().unsqueeze(1)).add_(self.offsets.unsqueeze(1))
            return w.view(k, n).to(dtype or torch.float32)

        def extra_repr(self) -> str:
            return f"{super().extra_repr()}, qtype={self.qtype.name}"

    return GGUFInt4Linear


def gguf_int4_linear(
    qweight: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    shape_out_in: tuple[int, int],
    bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> nn.Module:
    """A Q4_0/Q4_1/Q4_K weight as a ``FastInt4Linear`` (``kwargs``: ``small_rows``,
    ``prefill_dtype``, ``compute_dtype``); ``ImportError``/``ValueError`` when it cannot run."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in INT4_TYPES:
        raise _unsupported(qtype)
    return _int4_class()(qweight, qtype, shape_out_in, bias, **kwargs)


def gguf_linear_from_reader(
    reader: GGUFReader,
    gguf_name: str,
    *,
    bias_name: str | None = None,
    mode: Mode = "on-the-fly",
) -> GGUFLinear:
    """A :class:`GGUFLinear` for a packed 2-D tensor of a GGUF reader (HF row order)."""
    raw = load_raw(reader, gguf_name)
    if raw.qtype not in PACKED_TYPES:
        raise _unsupported(raw.qtype)
    if len(raw.shape) != 2:
        raise ValueError(f"{gguf_name} is not a 2-D weight: {list(raw.shape)}")
    bias = None if bias_name is None else load_tensor(reader, bias_name)
    return GGUFLinear.from_raw(raw.data, raw.qtype, raw.shape, bias, mode=mode)
