"""``cpu-fast``'s linear over a weight kept as GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4; the K-quants
Q4_K, Q5_K, Q6_K and IQ4_XS as their super-blocks of 256), or as GQ4 blocks repacked at load from a GPTQ / AWQ 4-bit layer (:class:`GroupInt4BlockLinear`).

- few rows (``<= small_rows``: decode): :func:`torch.ops.anyquant.ggml_gemv` on the blocks as held
  (activations quantized per block of 32 in ``passes`` int8 passes, integer dot products: llama.cpp's
  arithmetic with ``passes=1``; tolerance below);
- many rows (prompts): the exact weight, dequantized from the blocks per forward by the kernel's ``ggml_dequantize``
  (one pass, either form; bitwise the format's :meth:`BlockLinear.dequantize`, tested), and a float GEMM in
  ``prefill_dtype`` (default: the input's dtype); a weight over :data:`PROMPT_SLICE_BYTES` is formed and multiplied a
  slice of output rows at a time (:func:`prompt_slices`: bitwise the whole weight's GEMM, as
  :mod:`anyquant_cpu.kernels.lut` explains and ``tests/test_block_prompt_slices.py`` checks).

By default (``interleave=True`` from the loaders, option ``cpu_fast_interleave``) the blocks are copied once at load
into the kernel's interleaved form (:mod:`anyquant_cpu.kernels`: ~1.1x faster decode on a 1.1B model, ~0.25 s
more load there; the file's pages are released); with ``interleave=False`` no copy is made and the blocks may be a
view of the mmapped file. Tolerance against
the exact weight (few rows): the activations' rounding, half a step of ``max|x| / 127`` per block of 32
with one pass (about 2e-3 of the largest output on random data; ``core/tests/test_kernels.py`` allows
1e-2), 256 times less with two (tests allow 1e-4).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from anyquant_runtime.packing import q8_0_blocks

from . import GGML_TYPES, INTERLEAVED

#: about how many bytes of weight (in the GEMM's dtype) a prompt's GEMM forms at a time (:func:`prompt_slices`)
PROMPT_SLICE_BYTES = 8 << 20
#: slices are whole multiples of this many output rows (and never narrower)
SLICE_ROWS = 64

__all__ = [
    "PROMPT_SLICE_BYTES",
    "SLICE_ROWS",
    "BlockLinear",
    "cpu_only_apply",
    "fp16_exact",
    "kernel_forward",
    "q4_1_from_codes",
    "q8_0_blocks",
    "q8_0_from_codes",
    "prompt_slices",
]


def prompt_slices(
    out_features: int, in_features: int, budget: int = PROMPT_SLICE_BYTES, itemsize: int = 4
) -> list[tuple[int, int]]:
    """The output rows ``(r0, r1)`` a prompt's GEMM takes at a time: a multiple of :data:`SLICE_ROWS` rows holding
    about ``budget`` bytes of weight of ``itemsize`` bytes (at least :data:`SLICE_ROWS` rows); a last slice narrower
    than :data:`SLICE_ROWS` joins the one before (so no slice is narrower: see the module docstring); one slice where
    the weight fits the budget."""
    rows = max(SLICE_ROWS, budget // (itemsize * in_features) // SLICE_ROWS * SLICE_ROWS)
    if rows >= out_features:
        return [(0, out_features)]
    bounds = [*range(0, out_features, rows), out_features]
    if bounds[-1] - bounds[-2] < SLICE_ROWS:
        del bounds[-2]
    return list(itertools.pairwise(bounds))


class BlockLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` ``[out, in]`` as raw GGUF blocks (see the module docstring).

    A format subclasses it with :meth:`dequantize` (the exact weight from ``blocks``)."""

    blocks: torch.Tensor
    bias: torch.Tensor | None
    #: the dtype the format rounds each dequantized weight to (GQ4: its scales'), ``None``: exact in float32
    round_to: torch.dtype | None = None
    #: the prompt path's slice budget (:func:`prompt_slices`); an instance may set its own
    prompt_slice_bytes: int = PROMPT_SLICE_BYTES

    def __init__(
        self,
        blocks: torch.Tensor,
        type_name: str,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        *,
        small_rows: int,
        prefill_dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype = torch.float32,
        passes: int = 2,
        interleave: bool = False,
        qk_heads: int = 0,
    ) -> None:
        """``qk_heads`` (with ``interleave``): ``blocks``' rows are permuted as llama.cpp's converter permutes a
        "llama" file's Q/K rows in that many heads; the interleaved copy is made of the rows un-permuted."""
        super().__init__()
        if type_name not in GGML_TYPES:
            raise ValueError(f"BlockLinear takes {sorted(GGML_TYPES)}, not {type_name}")
        code, size, weights = GGML_TYPES[type_name]
        if (
            in_features % weights
            or blocks.dtype != torch.uint8
            or blocks.numel() != out_features * (in_features // weights) * size
        ):
            raise ValueError(
                f"{type_name} blocks of {blocks.numel()} bytes ({blocks.dtype}) do not hold [{out_features}, {in_features}]"
            )
        if passes not in (1, 2):
            raise ValueError(f"passes={passes!r} is not 1 or 2")
        if qk_heads and not interleave:
            raise ValueError("qk_heads (permuted Q/K rows) is read by the interleaving copy: pass interleave=True")
        blocks = blocks.reshape(-1).contiguous()
        if interleave:  # the kernel's interleaved form, a copy (the caller may release the file's pages)
            blocks = torch.ops.anyquant.ggml_interleave(blocks, code, out_features, in_features, True, qk_heads)
            code += INTERLEAVED
        self.type_name, self.ggml_type, self.passes, self.interleaved = type_name, code, passes, interleave
        self.out_features, self.in_features = out_features, in_features
        self.small_rows, self.prefill_dtype = small_rows, prefill_dtype
        self.register_buffer("blocks", blocks)
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]`` (float32), from the blocks (:meth:`raw_blocks`)."""
        raise NotImplementedError

    def exact_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:meth:`dequantize` rounded to ``dtype``, bit for bit, in one pass of the compiled kernel over the blocks as
        held (the prompt path's weight; the format's torch code makes several, after copying an interleaved form back)."""
        return self._dequantize(self.blocks, self.ggml_type, self.out_features, dtype)

    def _dequantize(self, blocks: torch.Tensor, code: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """``rows`` rows of ``blocks`` (GGML type ``code``) by the kernel's ``ggml_dequantize``, rounded to
        :attr:`round_to` where the format rounds, then to ``dtype`` (straight to it where the op writes it)."""
        direct = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
        w: torch.Tensor = torch.ops.anyquant.ggml_dequantize(
            blocks, code, rows, self.in_features, self.round_to or direct
        )
        return w if w.dtype == dtype else w.to(dtype)

    def raw_blocks(self) -> torch.Tensor:
        """The blocks in their stored layout (GGUF's, GQ4's): ``blocks`` itself, or made back from the
        interleaved form (a copy, for the prompt path's dequantization)."""
        if not self.interleaved:
            return self.blocks
        code = self.ggml_type - INTERLEAVED
        raw: torch.Tensor = torch.ops.anyquant.ggml_interleave(
            self.blocks, code, self.out_features, self.in_features, False
        )
        return raw

    def exact_rows(self, raw: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """The exact weight of ``rows`` rows whose blocks in the stored layout are ``raw`` (flat uint8: a slice of
        :meth:`raw_blocks`), rounded to ``dtype`` as :meth:`exact_weight` rounds it (bit for bit its rows)."""
        return self._dequantize(raw, self.ggml_type - INTERLEAVED if self.interleaved else self.ggml_type, rows, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_forward(self, x, self._few_rows, self._many_rows)

    def _many_rows(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 @ exact_weight(x2.dtype).T``, bit for bit, with the weight formed a slice of output rows at a time
        (:func:`prompt_slices`, as :class:`~anyquant_cpu.kernels.lut.Lut4Linear` forms its own): a prompt never
        holds the whole float weight (a 49152x2048 quantized head's is 400 MB in float32). One slice, or autograd
        recording: the whole weight."""
        n, k = self.out_features, self.in_features
        slices = prompt_slices(n, k, self.prompt_slice_bytes, x2.element_size())
        if len(slices) == 1 or (x2.requires_grad and torch.is_grad_enabled()):
            return torch.mm(x2, self.exact_weight(x2.dtype).t())
        raw = self.raw_blocks().reshape(-1)
        row_bytes = raw.numel() // n
        y = torch.empty(x2.shape[0], n, dtype=x2.dtype)
        for r0, r1 in slices:
            w = self.exact_rows(raw[r0 * row_bytes : r1 * row_bytes], r1 - r0, x2.dtype)
            torch.mm(x2, w.t(), out=y[:, r0:r1])
        return y

    def _few_rows(self, x2: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.anyquant.ggml_gemv(
            x2, self.blocks, self.ggml_type, self.out_features, self.in_features, -1, self.passes
        )
        return y

    def _apply(self, fn: Any, recurse: bool = True) -> BlockLinear:
        """The blocks stay on the CPU as they are: device moves are refused, dtype casts reach the bias only."""
        out: BlockLinear = cpu_only_apply(self, fn)
        return out

    def packed_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values() if b is not None)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, type={self.type_name} "
            f"({'interleaved at load' if self.interleaved else 'blocks read in place'}), passes={self.passes}, "
            f"small_rows={self.small_rows}, bias={self.bias is not None}"
        )


def kernel_forward(layer: Any, x: torch.Tensor, few_rows: Any, many_rows: Any = None) -> torch.Tensor:
    """The forward of a linear on a compiled kernel: ``few_rows(x2)`` (the kernel) up to ``layer.small_rows`` rows
    (decode), else a GEMM in ``layer.prefill_dtype`` (default: the input's) with ``layer.exact_weight(dtype)``
    (prompts; ``many_rows(x2 in dtype)``, where given, computes that product its own way); then the bias."""
    shape = x.shape
    x2 = x.reshape(-1, layer.in_features)
    y: torch.Tensor
    if x2.shape[0] <= layer.small_rows:
        y = few_rows(x2).to(x.dtype)
    else:
        dtype = layer.prefill_dtype or x.dtype
        if many_rows is not None:
            y = many_rows(x2.to(dtype)).to(x.dtype)
        else:
            y = torch.mm(x2.to(dtype), layer.exact_weight(dtype).t()).to(x.dtype)
    if layer.bias is not None:
        y = y + layer.bias.to(x.dtype)
    return y.reshape(*shape[:-1], layer.out_features)


def cpu_only_apply(layer: Any, fn: Any) -> Any:
    """``nn.Module._apply`` of a kernel linear: its packed buffers stay on the CPU as they are (a device move is a
    ``RuntimeError``), a dtype cast reaches the bias only."""
    for name, buf in layer._buffers.items():
        if buf is None:
            continue
        moved = fn(buf)
        if moved.device != buf.device:
            raise RuntimeError(
                f"{type(layer).__name__} (cpu-fast backend) runs on the CPU only; load with another backend"
            )
        if name == "bias":
            layer._buffers[name] = moved
    return layer


def gq4_blocks(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """GQ4 blocks (uint8 ``[out, in/32, 20]``, see :mod:`anyquant_cpu.kernels`) of ``W = s (q - z)``.

    ``codes``: ``[out, in]`` (0..15), ``scales`` and ``zeros``: ``[out, in/32]``, one per block of 32 (float16
    scales, integer zero points); the caller checks both are exact in float16."""
    out, k = codes.shape
    nb = k // 32
    blocks = torch.empty(out, nb, 20, dtype=torch.uint8)
    blocks[..., 0:2] = scales.to(torch.float16).contiguous().view(torch.uint8).view(out, nb, 2)
    blocks[..., 2:4] = zeros.to(torch.float16).contiguous().view(torch.uint8).view(out, nb, 2)
    halves = codes.to(torch.uint8).view(out, nb, 2, 16)
    torch.bitwise_or(halves[:, :, 0], halves[:, :, 1] << 4, out=blocks[..., 4:])
    return blocks


def fp16_exact(values: torch.Tensor) -> bool:
    """Whether float16 holds every value exactly (a block's scale must, for the blocks to be the format's weight)."""
    return values.dtype == torch.float16 or torch.equal(values.to(torch.float16).to(values.dtype), values)


def q8_0_from_codes(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (uint8 ``[out, in/32 * 34]``) of ``W = codes * d``: int8 ``codes`` ``[out, in]`` and one scale per
    block of 32, ``d`` ``[out, in/32]`` (the caller checks :func:`fp16_exact`): a format's own int8 weights, as they
    are, on the block kernel."""
    out, k = codes.shape
    blocks = torch.empty(out, k // 32, 34, dtype=torch.uint8)
    blocks[..., 0:2] = d.to(torch.float16).contiguous().view(torch.uint8).view(out, k // 32, 2)
    blocks[..., 2:] = codes.to(torch.int8).view(torch.uint8).view(out, k // 32, 32)
    return blocks.reshape(out, -1)


def q4_1_from_codes(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (uint8 ``[out, in/32 * 20]``) of ``W = codes * d + m``: ``codes`` ``[out, in]`` in 0..15, ``d`` and
    ``m`` ``[out, in/32]`` (float16-exact); GGUF's layout: byte ``j`` holds element ``j`` (low nibble) and ``j + 16``."""
    out, k = codes.shape
    nb = k // 32
    blocks = torch.empty(out, nb, 20, dtype=torch.uint8)
    blocks[..., 0:2] = d.to(torch.float16).contiguous().view(torch.uint8).view(out, nb, 2)
    blocks[..., 2:4] = m.to(torch.float16).contiguous().view(torch.uint8).view(out, nb, 2)
    halves = codes.to(torch.uint8).view(out, nb, 2, 16)
    torch.bitwise_or(halves[:, :, 0], halves[:, :, 1] << 4, out=blocks[..., 4:])
    return blocks.reshape(out, -1)


class GroupInt4BlockLinear(BlockLinear):
    """A GPTQ / AWQ 4-bit linear (``W = round_to(scale dtype, s (q - z))`` per group of 32, 64, 128, ... along
    ``in``) repacked once into GQ4 blocks for the kernel; built by :meth:`from_fast` from the
    :class:`~anyquant_cpu.engine.FastInt4Linear` the format made.

    Few rows: the kernel on ``s (q - z)`` as the blocks hold it (the reference's float16 rounding of each
    weight, a relative 2**-11 at most, is left out: inside the kernel's tolerance). Many rows: the reference's
    exact weight, dequantized from the blocks per forward, and a float GEMM (``FastInt4Linear``'s prefill)."""

    def __init__(
        self, blocks: torch.Tensor, out_features: int, in_features: int, scale_dtype: torch.dtype, **kwargs: Any
    ):
        super().__init__(blocks, "GQ4", out_features, in_features, **kwargs)
        self.scale_dtype = self.round_to = scale_dtype

    @staticmethod
    def unsupported_reason(layer: Any) -> str | None:
        """Why ``layer`` (a :class:`~anyquant_cpu.engine.FastInt4Linear`) cannot become GQ4 blocks."""
        if layer.perm is not None:
            return "a g_idx that reorders columns (act-order)"
        if layer.group_size % 32 or layer.in_features % 32:
            return f"group size {layer.group_size} / in_features {layer.in_features} not multiples of 32"
        scales = layer.exact_scales()
        if scales.dtype != torch.float16 and not torch.equal(scales.to(torch.float16).to(scales.dtype), scales):
            return f"{str(scales.dtype).replace('torch.', '')} scales that float16 does not hold exactly"
        if int(layer.exact_zeros().max()) > 2048:
            return "zero points above 2048"
        return None

    @classmethod
    def from_fast(cls, layer: Any, interleave: bool = True) -> GroupInt4BlockLinear:
        """The same weight, bias and options as ``layer`` (a :class:`~anyquant_cpu.engine.FastInt4Linear`
        that :meth:`unsupported_reason` accepts); ``interleave``: the blocks in the kernel's interleaved form."""
        reason = cls.unsupported_reason(layer)
        if reason is not None:
            raise ValueError(f"GQ4 blocks cannot hold this layer: {reason}")
        n, k, repeat = layer.out_features, layer.in_features, layer.group_size // 32
        scales = layer.exact_scales()
        per_block = scales.t().repeat_interleave(repeat, dim=1)  # [out, in/32]
        zeros = layer.exact_zeros().expand(scales.shape).t().repeat_interleave(repeat, dim=1)
        blocks = gq4_blocks(layer._codes_kn().t(), per_block, zeros)
        return cls(
            blocks,
            n,
            k,
            scales.dtype,
            interleave=interleave,
            bias=layer.bias,
            small_rows=layer.small_rows,
            prefill_dtype=layer.prefill_dtype,
            compute_dtype=layer.compute_dtype,
        )

    def dequantize(self) -> torch.Tensor:
        """The exact weight ``[out, in]``: ``round_to(scale dtype, s (q - z))``, in the scales' dtype."""
        n, k = self.out_features, self.in_features
        blocks = self.raw_blocks().view(n, k // 32, 20)
        s = blocks[..., 0:2].contiguous().view(torch.float16).to(torch.float32)  # [n, nb, 1]
        z = blocks[..., 2:4].contiguous().view(torch.float16).to(torch.float32)
        qs = blocks[..., 4:]
        w = torch.cat((qs & 15, qs >> 4), dim=-1).to(torch.float32)  # [n, nb, 32]
        w.sub_(z).mul_(s)
        return w.view(n, k).to(self.scale_dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, type=GQ4 (repacked at load"
            f"{', interleaved' if self.interleaved else ''}), "
            f"passes={self.passes}, small_rows={self.small_rows}, bias={self.bias is not None}"
        )
