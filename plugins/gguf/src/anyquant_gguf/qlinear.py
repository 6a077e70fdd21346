"""A linear layer that keeps GGUF-quantized weights packed, dequantized by :mod:`.dequant` as it runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from anyquant_runtime.layouts import Decoded, GGUFBlocks, Layout
from anyquant_runtime.packing import ggml_int4_scales_offsets
from anyquant_runtime.tensors import PackedRows

from .dequant import (
    _NIBBLE,
    _QK_K,
    PACKED_TYPES,
    _unpack,
    _unsupported,
    check_supported,
    dequantize_blocks_torch,
    packed_nbytes,
)
from .ggml import GGML_QUANT_SIZES, GGMLQuantizationType
from .reader import GGUFFile, load_raw, load_tensor, unpermute_qk_rows

__all__ = [
    "BLOCK_KERNEL_TYPES",
    "CHUNK_WEIGHTS",
    "GGUFEmbedding",
    "GGUFLinear",
    "GGUFRows",
    "GGUFTiedHead",
    "INT4_TYPES",
    "PACKED_TYPES",
    "blocks_layout",
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

    For a fast backend it describes its weight to the engine (:meth:`packed_layouts`), which builds the fast
    module; ``qk_heads``: ``qweight``'s rows are a "llama" file's Q/K rows as stored (permuted in that many heads,
    zero-copy), for the engine to read so; they are put in the model's order before the module's own paths run
    (:meth:`finalize`, :meth:`set_mode`).
    """

    #: the dtype of a fast module's bias and outputs (the loader's compute dtype)
    compute_dtype: torch.dtype = torch.float32

    def __init__(
        self,
        qweight: torch.Tensor,
        qtype: GGMLQuantizationType | int,
        shape_out_in: tuple[int, int],
        bias: torch.Tensor | None = None,
        mode: Mode = "on-the-fly",
        *,
        qk_heads: int | None = None,
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
        self.qk_heads: int | None = None
        self.bias = None if bias is None else nn.Parameter(bias.reshape(out_features), requires_grad=False)
        self.register_buffer("weight_cache", None, persistent=False)
        self.mode: Mode = "on-the-fly"
        self.set_mode(mode)
        if qk_heads is not None:
            if mode != "on-the-fly":
                raise ValueError("qk_heads (Q/K rows as stored, for the engine) needs mode='on-the-fly'")
            self.qk_heads = qk_heads

    @classmethod
    def from_raw(
        cls,
        raw_uint8: torch.Tensor,
        qtype: GGMLQuantizationType | int,
        shape_out_in: tuple[int, int],
        bias: torch.Tensor | None = None,
        *,
        mode: Mode = "on-the-fly",
        qk_heads: int | None = None,
    ) -> GGUFLinear:
        """Wrap raw GGUF bytes (rows in HF order, or as stored with ``qk_heads``) without copying them."""
        return cls(raw_uint8, qtype, shape_out_in, bias=bias, mode=mode, qk_heads=qk_heads)

    def set_mode(self, mode: Mode) -> None:
        """Switch between ``"on-the-fly"`` and ``"dequant-at-load"`` (builds/drops the cache)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if self.qk_heads is not None:  # stored Q/K rows: in the model's order before the module's own paths
            self.qweight = unpermute_qk_rows(self.qweight, self.qk_heads)
            self.qk_heads = None
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

    def packed_layouts(self) -> list[Layout]:
        """The weight as a fast backend's engine may run it, in the format's order: its blocks as stored
        (:func:`blocks_layout`), then a bfloat16 copy for decode (prompts: this module's own exact forward), where
        the rows are in the model's order."""
        bias = None if self.bias is None else self.bias.detach()
        shape = (self.out_features, self.in_features)
        blocks = blocks_layout(self.qtype, shape, self.qweight, qk_heads=self.qk_heads, bias=bias)
        return [blocks] if self.qk_heads is not None else [blocks, Decoded(self, exact_prompts=True)]

    def behind_inputs(self, fast: nn.Module) -> nn.Module:
        """The engine's module as it is (GGUF has no input quantization)."""
        return fast

    def finalize(self) -> GGUFLinear:
        """The exact path where the engine runs none of the layouts: the weight dequantized once (a fast
        backend's fallback, as the ``dequantized`` backend)."""
        self.set_mode("dequant-at-load")
        return self

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
        #: how looked-up rows' blocks become float32 rows (``(blocks [n, bytes_per_row], n) -> [n, dim]``): a fast
        #: backend may put its own decoder here (bit for bit :func:`dequantize_blocks_torch`'s, which is the default)
        self.decode_rows: Callable[[torch.Tensor, int], torch.Tensor] | None = None

    def packed_layouts(self) -> list[Layout]:
        """The table as a backend may read its rows: its blocks as stored (:func:`blocks_layout`)."""
        return [blocks_layout(self.qtype, (self.num_embeddings, self.embedding_dim), self.qweight)]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.qweight.index_select(0, flat)
        if self.decode_rows is not None:
            values = self.decode_rows(rows, flat.numel()).to(self.dtype)
        else:
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


class GGUFRows(PackedRows):
    """A GGUF-packed ``[rows, dim]`` table read as float32 a slice of rows at a time (decoded from its
    blocks on each read; the bytes stay where they are, file-backed): the exact source of a fast backend's
    LM head (the engine's ``RowTable``), over a tied embedding too."""

    dtype = torch.float32

    def __init__(self, qweight: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, int]) -> None:
        self.qtype = GGMLQuantizationType(qtype)
        self.shape = (int(shape[0]), int(shape[1]))
        self.qweight = qweight.reshape(self.shape[0], -1)
        #: how read rows' blocks become float32 rows, as :attr:`GGUFEmbedding.decode_rows` (a fast backend may put its
        #: own decoder here, bit for bit :func:`dequantize_blocks_torch`'s, which is the default)
        self.decode_rows: Callable[[torch.Tensor, int], torch.Tensor] | None = None

    def decode(self, index: slice | torch.Tensor) -> torch.Tensor:
        blocks = self.qweight[index] if isinstance(index, slice) else self.qweight.index_select(0, index)
        if self.decode_rows is not None:
            return self.decode_rows(blocks, blocks.shape[0])
        return dequantize_blocks_torch(blocks, self.qtype, (blocks.shape[0], self.shape[1]))


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
    if qtype not in INT4_TYPES:
        raise _unsupported(qtype)
    out_features, in_features = shape_out_in
    b = qweight.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    scales, offsets = ggml_int4_scales_offsets(b, qtype.name, out_features)
    if qtype == Q.Q4_K:
        codes = _unpack(b[:, 16:], 32, _NIBBLE, 0x0F).reshape(-1, _QK_K)
    else:
        qs = b[:, 4:] if qtype == Q.Q4_1 else b[:, 2:]
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    return codes.reshape(out_features, in_features), scales.contiguous(), offsets.contiguous()


def gguf_int4_linear(
    qweight: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    shape_out_in: tuple[int, int],
    bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> nn.Module:
    """A Q4_0/Q4_1/Q4_K weight repacked by the CPU engine for torch's int4 CPU kernel (its GGUF blocks
    offered repacked only; ``kwargs``: ``small_rows``, ``prefill_dtype``, ``compute_dtype``); ``ImportError`` without
    the engine, ``ValueError`` when it cannot run here."""
    from anyquant_runtime.cpu import require

    qtype = GGMLQuantizationType(qtype)
    if qtype not in INT4_TYPES:
        raise _unsupported(qtype)
    layout = replace(blocks_layout(qtype, shape_out_in, qweight, bias=bias), as_stored=False)
    fast = require().fast_linear(layout, **kwargs)
    if isinstance(fast, str):
        raise ValueError(fast)
    module: nn.Module = fast
    return module


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


# --------------------------------------------------------------------------- the CPU engine's layout

#: The types whose blocks the format offers a fast backend as stored (:func:`blocks_layout`: a
#: :class:`~anyquant_runtime.layouts.GGUFBlocks` with ``as_stored``), which its GGUF-block kernel reads where it is
#: built: a Q4_K_M file's Q4_K and Q6_K linears at their stored size (4.5 and 6.56 bits a weight); Q5_K, Q5_0 and Q5_1;
#: and the table types IQ4_NL, IQ4_XS and MXFP4 (4-bit codes indexing 16 int8 values: 4.5, 4.25 and 4.25 bits a
#: weight). Other types' blocks are offered repacked only (torch's int4 kernel takes Q4_0/Q4_1/Q4_K), then a
#: bfloat16 copy.
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


def blocks_layout(
    qtype: GGMLQuantizationType | int,
    shape_out_in: tuple[int, ...],
    blocks: torch.Tensor | None = None,
    *,
    qk_heads: int | None = None,
    bias: torch.Tensor | None = None,
) -> GGUFBlocks:
    """A GGUF weight's blocks as a fast backend's engine reads them: ``[out, in]`` ``blocks`` of ``qtype`` (``None``:
    described from the header alone), offered as stored where the type is among :data:`BLOCK_KERNEL_TYPES`."""
    qtype = GGMLQuantizationType(qtype)
    out_features, in_features = (int(d) for d in shape_out_in)
    as_stored = qtype in BLOCK_KERNEL_TYPES
    return GGUFBlocks(in_features, out_features, qtype.name, int(qtype), blocks, qk_heads, as_stored, bias)
