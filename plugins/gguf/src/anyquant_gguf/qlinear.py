"""A linear layer that keeps GGUF-quantized weights packed, dequantized by :mod:`.dequant` as it runs."""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .dequant import (
    _NIBBLE,
    _QK_K,
    PACKED_TYPES,
    _f16,
    _k_scales,
    _unpack,
    _unsupported,
    check_supported,
    dequantize_blocks_torch,
    packed_nbytes,
)
from .ggml import GGML_QUANT_SIZES, GGMLQuantizationType
from .reader import GGUFFile, load_raw, load_tensor

__all__ = [
    "CHUNK_WEIGHTS",
    "GGUFEmbedding",
    "GGUFLinear",
    "GGUFRows",
    "GGUFTiedHead",
    "fast_rows_head",
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
#: An on-the-fly weight larger than ``CHUNK_ABOVE`` values is dequantized and multiplied in slices
#: of about ``CHUNK_WEIGHTS`` values (1 MiB of float32): a tied 49152 x 576 LM head would otherwise
#: add 113 MiB to every forward's peak, and slices that stay in cache are faster. Smaller weights
#: are not sliced: a GEMM split by output rows sums in another order for some shapes (on SmolLM2's
#: linears that moves the prompt logits outside the 1e-5 the tests hold to).
CHUNK_WEIGHTS = 1 << 18
CHUNK_ABOVE = 1 << 22


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
        check_supported(qtype, dense=False)
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
        check_supported(qtype)
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
        check_supported(qtype, dense=False)
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
    :class:`~anyquant_cpu.engine.FastHead` over a tied embedding (a ``RowTable``)."""

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


def fast_rows_head(
    qweight: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    shape: tuple[int, int],
    *,
    small_rows: int,
    kind: str = "auto",
    interleave: bool = True,
) -> nn.Module | None:
    """``cpu-fast``'s LM head over a packed table of a type the GGUF-block kernel does not read (Q5_K, Q2_K, ...;
    an untied head, or one tied to a packed token embedding): a decode copy as
    :class:`~anyquant_cpu.engine.FastHead` makes it (``kind``: ``cpu_fast_head``, ``auto``: Q8_0 blocks on
    the compiled kernel, else bfloat16 prepacked for oneDNN; the format's tolerance class, as every ``cpu-fast``
    head, the top logits exact), the GGUF bytes decoded a slice at a time for prompts; ``None`` where no decode
    form runs here (the caller keeps a :class:`GGUFTiedHead` or a :class:`GGUFLinear`, which decode the whole
    table on every decode step: SmolLM2's 49152 x 576 Q8_0 head, about half of a step)."""
    from anyquant_cpu.engine import FastHead, head_kind

    decode = head_kind(kind, int(shape[1]))[0]
    if decode is None:
        return None
    return FastHead(GGUFRows(qweight, qtype, shape), small_rows=small_rows, decode=decode, interleave=interleave)


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
    """The blocks' nibble bytes as :func:`~anyquant_cpu.engine.pack_int4_pairs` reads them (a view):
    Q4_0/Q4_1 hold weights ``i`` and ``16 + i`` of a 32-weight block in byte ``i``; Q4_K weights ``64c + i``
    and ``64c + 32 + i`` of a 256-weight super-block in byte ``32c + i``."""
    header = {Q.Q4_0: 2, Q.Q4_1: 4, Q.Q4_K: 16}[qtype]
    half = 32 if qtype == Q.Q4_K else 16
    blocks = b.view(out_features, -1, b.shape[-1])[:, :, header:]
    return blocks.view(out_features, blocks.shape[1], -1, half)


@functools.cache
def _int4_class() -> type[nn.Module]:
    """:class:`anyquant_cpu.engine.FastInt4Linear` with a float offset per group.

    The base class takes integer zero points (``W = (q - z) * s``); GGUF's Q4_1/Q4_K offsets are
    arbitrary floats. The int4 kernel computes ``(q - 8) * s + m`` with any ``m``, so only its
    ``scales_and_zeros`` (``m = offset + 8 s``, bfloat16 like the base's) and the exact dense
    weight of the many-rows path (``s * q + offset`` in float32) differ.
    """
    from anyquant_cpu.engine import FastInt4Linear, int4pack_status, pack_int4_pairs

    class GGUFInt4Linear(FastInt4Linear):
        """A Q4_0/Q4_1/Q4_K linear repacked for torch's int4 CPU kernel (decode: bfloat16
        activations; prompts: exact float32 weight, dequantized per forward, and GEMM).

        The kernel's layout is written straight from the blocks' nibble bytes
        (:func:`~anyquant_cpu.engine.pack_int4_pairs`: no unpacked codes, a few whole-tensor
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
    reader: GGUFFile,
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


# --------------------------------------------------------------------------- GGUF-block kernel

#: Types cpu-fast runs on :func:`torch.ops.anyquant.ggml_gemv`, read as stored or interleaved
#: (:mod:`anyquant_cpu.kernels`): a Q4_K_M file's Q4_K and Q6_K linears at their stored size (4.5 and 6.56 bits a
#: weight, where torch's int4 kernel needs a repacked copy of Q4_K and Q6_K had a bfloat16 copy); Q5_K, Q5_0 and Q5_1;
#: and the table types IQ4_NL, IQ4_XS and MXFP4 (4-bit codes indexing 16 int8 values: 4.5, 4.25 and 4.25 bits a
#: weight). These had a bfloat16 copy before. The kernel's list (:data:`anyquant_cpu.kernels.GGML_TYPES`) names
#: each of them.
BLOCK_KERNEL_TYPES: dict[GGMLQuantizationType, str] = {
    Q.Q4_0: "Q4_0",
    Q.Q4_1: "Q4_1",
    Q.Q5_0: "Q5_0",
    Q.Q5_1: "Q5_1",
    Q.Q8_0: "Q8_0",
    Q.Q4_K: "Q4_K",
    Q.Q5_K: "Q5_K",
    Q.Q6_K: "Q6_K",
    Q.IQ4_NL: "IQ4_NL",
    Q.IQ4_XS: "IQ4_XS",
    Q.MXFP4: "MXFP4",
}


def block_kernel_available(qtype: GGMLQuantizationType | int) -> bool:
    """Whether the compiled GGUF-block kernel is loaded and takes ``qtype`` (``False`` without anyquant-cpu)."""
    if GGMLQuantizationType(qtype) not in BLOCK_KERNEL_TYPES:
        return False
    try:
        from anyquant_cpu import kernels
    except ImportError:
        return False
    return kernels.available()


@functools.cache
def _block_linear_class() -> type[nn.Module]:
    from anyquant_cpu.kernels.linear import BlockLinear

    class GGUFBlockLinear(BlockLinear):
        """A linear of a :data:`BLOCK_KERNEL_TYPES` type on the GGUF-block kernel (decode), its blocks read in place
        or held in the kernel's interleaved form (``interleave``); prompts dequantize the blocks per forward
        (the kernel's ``ggml_dequantize``: bitwise :func:`~anyquant_gguf.dequant.dequantize_blocks_torch`)."""

        def __init__(
            self,
            qweight: torch.Tensor,
            qtype: GGMLQuantizationType,
            shape_out_in: tuple[int, int],
            bias: torch.Tensor | None,
            **kwargs: Any,
        ) -> None:
            out_features, in_features = (int(s) for s in shape_out_in)
            super().__init__(qweight, BLOCK_KERNEL_TYPES[qtype], out_features, in_features, bias, **kwargs)
            self.qtype = qtype

        def dequantize(self) -> torch.Tensor:
            return dequantize_blocks_torch(self.raw_blocks(), self.qtype, (self.out_features, self.in_features))

    return GGUFBlockLinear


def gguf_block_linear(
    qweight: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    shape_out_in: tuple[int, int],
    bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> nn.Module | None:
    """A :data:`BLOCK_KERNEL_TYPES` weight (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS/MXFP4) on the
    GGUF-block kernel
    (``kwargs``: ``small_rows``, ``prefill_dtype``, ``compute_dtype``, ``passes``, ``interleave``: a copy in the kernel's interleaved form instead of the blocks read
    in place); ``None`` where the kernel is not built or takes not the type."""
    if not block_kernel_available(qtype):
        return None
    return _block_linear_class()(qweight, GGMLQuantizationType(qtype), shape_out_in, bias, **kwargs)


@functools.cache
def _block_head_class() -> type[nn.Module]:
    from anyquant_cpu.engine import FastHead

    class GGUFBlockHead(FastHead):
        """:class:`~anyquant_cpu.engine.FastHead` whose decode product is the GGUF-block kernel on the
        table's own blocks (read in place, or copied once into the kernel's interleaved form when ``interleave``;
        nothing quantized again); the ``EXACT_TOP`` largest logits of each row are computed again from the exact
        weight, as FastHead does, and prompts use its exact path."""

        def __init__(self, table: GGUFRows, *, small_rows: int, interleave: bool = False) -> None:
            nn.Module.__init__(self)  # FastHead's own __init__ makes a copy of its own: not wanted here
            self.out_features, self.in_features = table.shape
            self.compute_dtype, self.small_rows = torch.float32, small_rows
            self.file = table
            self.table = table
            self.register_buffer("exact", None)
            self.register_buffer("bias", None)
            self.packed = []
            self._set_blocks(table.qweight, table.qtype.name, interleave)
            self.interleaved = interleave

        def packed_bytes(self) -> int:
            copy = self.blocks if self.interleaved else None  # else the table's bytes are the file's
            return 0 if copy is None else int(copy.nbytes)

    return GGUFBlockHead


def block_kernel_head(
    qweight: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    shape: tuple[int, int],
    *,
    small_rows: int,
    interleave: bool = False,
) -> nn.Module | None:
    """``cpu-fast``'s LM head over a :data:`BLOCK_KERNEL_TYPES` table through the GGUF-block kernel (``None`` where it
    cannot run): the exact top logits as :class:`~anyquant_cpu.engine.FastHead`'s; ``interleave``: the
    blocks copied into the kernel's interleaved form (SmolLM2's Q8_0 head, 1 row, 2 threads: ~1.2 ms against
    ~1.8 ms read in place)."""
    if not block_kernel_available(qtype):
        return None
    return _block_head_class()(GGUFRows(qweight, qtype, shape), small_rows=small_rows, interleave=interleave)
