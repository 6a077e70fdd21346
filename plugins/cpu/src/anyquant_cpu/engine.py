"""A fast CPU linear for 4-bit group-quantized weights (GPTQ, AWQ): ``W = (q - z) * s`` per group.

Two execution paths share one packed copy of the weight (about 0.6 bytes per weight in all, against
4 for a dense float32 cache):

- **few rows** (decode and short prompts; ``rows <= small_rows``, default 64): torch's own int4
  CPU kernel, ``aten._weight_int4pack_mm_for_cpu``, on the weight repacked at load time into the
  layout ``aten._convert_weight_to_int4pack_for_cpu`` writes. The kernel computes
  ``x @ ((q - 8) * s + m)`` with ``m = (8 - z) * s``; it is fast only with bfloat16 activations
  (float32 ones take a generic path ~30x slower, float16 ~50x), so the activations, ``s`` and ``m``
  are rounded to bfloat16 and the result is cast back to the caller's dtype.
- **many rows** (prefill; ``rows > small_rows``): the kernel's cost grows linearly with the rows
  (~21 us per row for 576x1536 against ~10.5 us for a float32 GEMM), so the weight is unpacked
  from the same buffer into a transient dense block, ``round_to(scale dtype, (q - z) * s)``
  (bit-identical to the reference dequantizers; ~1.2 ms for 576x1536), and multiplied by a dense
  GEMM: in float32 (the reference's arithmetic up to GEMM summation order), or in bfloat16 with
  ``prefill_dtype=torch.bfloat16`` (about 2x faster on CPUs with AMX/AVX512-BF16; 5-50x slower without
  them). The loaders' default (``cpu_fast_prefill="auto"``) is bfloat16 where :func:`bf16_gemm_is_fast`, else
  the compute dtype. Only one layer's block exists at a time: memory stays packed.

Tolerance against the exact reference (max |y - y_ref| / max |y_ref|): few rows, bfloat16 class:
~4e-3 per layer, up to ~6e-3 on a tiny Llama's logits (tests allow 2e-2); many rows in float32:
~1e-6 (tests allow 1e-5); many rows in bfloat16: ~5e-3 on the tiny models' logits (tests allow 2e-2).
:meth:`FastInt4Linear.dequantize` is exact.

Groups must be contiguous along ``in_features`` and a multiple of 32 (the kernel takes groups of 32,
64, 128 and 256; larger groups, per-channel included, repeat their scales). A GPTQ ``g_idx`` that
scatters columns (``desc_act``) becomes an input permutation: the columns are sorted by group once
at load and every input is gathered the same way (``x[:, perm]``).

The kernel's packed layout depends on the CPU's vector ISA (blocks of 64 output columns with
AVX512, 32 with AVX2, something else without SIMD); :func:`int4pack_status` finds it with a
self-test once per process, and the fast path is unavailable when no known layout matches.

The formats build none of this module's linears themselves: a format's linear describes its weight in the packed
layouts of :mod:`anyquant_runtime.layouts`, and :meth:`FastCPUPlan.convert` (:func:`fast_cpu_module`) checks each
offered layout against what runs here and builds the first that runs (:func:`fast_linear`): ``Int4Groups`` ->
:class:`FastInt4Linear`, ``Int8Blocks`` -> :class:`Int8BlockLinear` (Q8_0 blocks), ``Affine4Blocks`` ->
:class:`Affine4BlockLinear` (Q4_1 blocks), ``Table4`` -> :class:`~anyquant_cpu.kernels.lut.Lut4Linear`,
``E4M3Groups`` -> :class:`~anyquant_cpu.kernels.lut.E4M3Linear`, ``Decoded`` -> :class:`PrepackedBf16Linear`.
Before any tensor is read, a loader describes its checkpoint's layers in the same layouts from the headers and
:func:`layouts_run` counts the ones the engine takes here (``auto``'s choice; :func:`layout_kinds_run`: whether
cpu-fast is available to a format at all), with the checks of the conversion that need no tensor.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, cast

import torch
import torch.nn.functional as F
from torch import nn

from anyquant.plugin import ParameterError
from anyquant_runtime.layouts import (
    Affine4Blocks,
    Decoded,
    E4M3Groups,
    GGUFBlocks,
    Int4Groups,
    Int8Blocks,
    Layout,
    Table4,
)
from anyquant_runtime.layouts import tensor as layout_tensor
from anyquant_runtime.packing import ggml_int4_scales_offsets, int4_codes_from_cols, int4_codes_from_rows
from anyquant_runtime.tensors import FileRows, fill_file_tables

from .kernels.linear import BlockLinear

__all__ = [
    "DEFAULT_SMALL_ROWS",
    "EXPERT_SMALL_ROWS",
    "EXPERT_SMALL_ROWS_16BIT",
    "Affine4BlockLinear",
    "CompactEmbedding",
    "FastCPUPlan",
    "FastHead",
    "FastInt4Linear",
    "GGUFBlockHead",
    "GGUFBlockLinear",
    "GGUFInt4Linear",
    "Int8BlockLinear",
    "KV_CACHE_DTYPES",
    "Int4PackStatus",
    "PrepackedBf16Linear",
    "ROUNDED_WEIGHTS",
    "RowTable",
    "bf16_gemm_is_fast",
    "bf16_head_status",
    "block_kernel_is_fast",
    "head_kind",
    "head_status",
    "install_fast_head",
    "kernel_attention",
    "kernel_norms",
    "contiguous_group_size",
    "expert_small_rows",
    "fast_cpu_capable",
    "fast_cpu_module",
    "fast_cpu_reasons",
    "fast_linear",
    "group_permutation",
    "int4_codes_from_cols",
    "int4_codes_from_rows",
    "int4pack_status",
    "kernel_group_size",
    "layout_kinds_run",
    "layout_unsupported",
    "layouts_run",
    "module_form",
    "pack_int4_blocked",
    "pack_int4_pairs",
    "to_block_kernel",
    "unsupported_reason",
]

log = logging.getLogger(__name__)

#: group sizes ``_weight_int4pack_mm_for_cpu`` accepts, largest first.
KERNEL_GROUPS = (256, 128, 64, 32)
#: ``rows <= DEFAULT_SMALL_ROWS`` use the int4 kernel, more rows the dequantize + GEMM path: the kernel
#: costs more per row than a float32 GEMM, which pays a fixed dequantization of the weight first, so the
#: paths cross at some row count (near 100 on SmolLM2's shapes, docs/benchmarks.md); 64 keeps prompts of a
#: chat turn on the kernel.
DEFAULT_SMALL_ROWS = 64
_LAYOUT_BLOCKS = (64, 32, 16)
_INNER_K_TILES = 2


@dataclass(frozen=True)
class Int4PackStatus:
    """Whether torch's int4 CPU kernel can be used here, and the packed layout it writes."""

    available: bool
    reason: str = ""
    block_n: int = 0  # output rows per packed block: byte (b, k, j) = q[b*B + j, k] | q[b*B + B/2 + j, k] << 4


def pack_int4_blocked(codes: torch.Tensor, block: int) -> torch.Tensor:
    """``[K, N]`` codes (0..15, ``N % block == 0``) -> the int4 kernel's ``[N, K/2]`` uint8 layout with
    ``block`` output columns per block: byte ``(b, k, j)`` = ``q[k, b*B + j] | q[k, b*B + B/2 + j] << 4``."""
    k, n = codes.shape
    halves = codes.to(torch.uint8).reshape(k, n // block, 2, block // 2)
    packed = halves[:, :, 0] | (halves[:, :, 1] << 4)  # [K, N/B, B/2]
    return packed.permute(1, 0, 2).contiguous().view(n, k // 2)


def pack_int4_pairs(pairs: torch.Tensor, block: int) -> torch.Tensor:
    """Bytes that each hold two codes of one row -> the int4 kernel's ``[N, K/2]`` layout
    (:func:`pack_int4_blocked`'s), with no unpacked copy of the codes in between.

    ``pairs`` is uint8 ``[N, A, C, H]`` (any strides): byte ``(n, a, c, i)`` holds ``q[n, k]`` in its low
    nibble and ``q[n, k + H]`` in its high one, ``k = 2H (a C + c) + i`` (GGUF's Q4_0/Q4_1 blocks:
    ``[N, K/32, 1, 16]`` past each block's header; Q4_K: ``[N, K/256, 4, 32]``). ``N % block == 0``.
    Each output byte pairs rows ``n`` and ``n + block/2`` of the same column: two whole-tensor
    nibble merges written straight into the kernel's order (a few large ops: each op costs a
    thread-pool round trip, which a loaded machine makes slow).
    """
    n, a, c, h = pairs.shape
    if n % block:
        raise ValueError(f"{n} rows are not a multiple of the kernel's block of {block}")
    k = 2 * h * a * c
    out = torch.empty(n // block, k, block // 2, dtype=torch.uint8)
    # out[b, k, j] with k split as (a, c, nibble, i), viewed in the source's order [b, j, a, c, nibble, i]
    dst = out.view(n // block, a, c, 2, h, block // 2).permute(0, 5, 1, 2, 3, 4)
    src = pairs.view(n // block, 2, block // 2, a, c, h)
    first, second = src[:, 0], src[:, 1]  # rows b*B + j and b*B + B/2 + j
    torch.bitwise_or(first & 0x0F, second << 4, out=dst[..., 0, :])
    torch.bitwise_or(first >> 4, second & 0xF0, out=dst[..., 1, :])
    return out.view(n, k // 2)


@functools.cache
def int4pack_status() -> Int4PackStatus:
    """Self-test the int4 kernel once per process: it exists, its layout is one we can unpack,
    and it computes ``x @ ((q - 8) * s + m)`` as documented."""
    aten = torch.ops.aten
    if not (hasattr(aten, "_convert_weight_to_int4pack_for_cpu") and hasattr(aten, "_weight_int4pack_mm_for_cpu")):
        return Int4PackStatus(False, f"torch {torch.__version__} has no int4 CPU kernel")
    try:
        gen = torch.Generator().manual_seed(0)
        n, k, group = 128, 64, 32
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        packed = aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES)
        block = next((b for b in _LAYOUT_BLOCKS if torch.equal(packed, pack_int4_blocked(codes.t(), b))), 0)
        if not block:
            return Int4PackStatus(False, "the int4 kernel packs in a layout anyquant cannot unpack on this CPU")
        scales = torch.full((k // group, n), 0.5)
        zeros = torch.randint(0, 16, (k // group, n), generator=gen).float()
        sz = torch.stack([scales, (8 - zeros) * scales], -1).to(torch.bfloat16)
        x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
        got = aten._weight_int4pack_mm_for_cpu(x, packed, group, sz).float()
        weight = (codes.t().float() - zeros.repeat_interleave(group, 0)) * 0.5
        want = x.float() @ weight
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
            return Int4PackStatus(False, "the int4 kernel's self-test gave wrong results on this CPU")
    except (RuntimeError, NotImplementedError) as exc:
        return Int4PackStatus(False, f"the int4 kernel does not run here: {str(exc).splitlines()[0]}")
    return Int4PackStatus(True, block_n=block)


@functools.cache
def bf16_gemm_is_fast() -> bool:
    """bfloat16 GEMMs beat float32 only with AMX or AVX512-BF16 (5-50x slower without)."""
    cpu = torch.cpu
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


#: CPU capabilities where the int4 kernel is vectorized and faster than a dense float32 weight for
#: one row (AVX512; AVX2 with ATEN_CPU_CAPABILITY=avx2). "DEFAULT" (no SIMD) runs a scalar loop, far
#: slower than either.
FAST_CAPABILITIES = ("AVX2", "AVX512")


def fast_cpu_capable() -> tuple[bool, str]:
    """(usable, reason): the int4 kernel passes its self-test and is vectorized on this CPU."""
    status = int4pack_status()
    if not status.available:
        return False, status.reason
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in FAST_CAPABILITIES:
        return False, f"torch's int4 kernel is not vectorized for CPU capability {capability}"
    return True, ""


def kernel_group_size(group_size: int) -> int | None:
    """The int4 kernel's group size for contiguous groups of ``group_size`` columns (largest divisor)."""
    return next((g for g in KERNEL_GROUPS if group_size % g == 0), None)


def contiguous_group_size(g_idx: torch.Tensor | None, in_features: int, num_groups: int) -> int | None:
    """Size of every group once the columns are sorted by group, or ``None`` when they differ."""
    if g_idx is None:
        return in_features // num_groups if in_features % num_groups == 0 else None
    counts = torch.bincount(g_idx.to(torch.int64), minlength=num_groups)
    size = int(counts[0]) if counts.numel() else 0
    return size if size > 0 and bool((counts == size).all()) and size * num_groups == in_features else None


def group_permutation(g_idx: torch.Tensor | None, group_size: int) -> torch.Tensor | None:
    """The column order that makes groups contiguous (``None`` when ``g_idx`` is already ``k // g``)."""
    if g_idx is None:
        return None
    index = g_idx.to(torch.int64)
    if torch.equal(index, torch.arange(index.numel()) // group_size):
        return None
    return torch.sort(index, stable=True).indices


def unsupported_reason(
    bits: int, in_features: int, out_features: int, group_size: int | None, *, status: Int4PackStatus | None = None
) -> str | None:
    """Why a layer cannot use :class:`FastInt4Linear` (``None`` when it can)."""
    status = status or int4pack_status()
    if not status.available:
        return status.reason
    if bits != 4:
        return f"{bits}-bit weights (the int4 kernel is 4-bit only)"
    if group_size is None:
        return "groups of unequal sizes"
    if kernel_group_size(group_size) is None:
        return f"group size {group_size} is not a multiple of 32"
    if in_features % 32:
        return f"in_features={in_features} is not a multiple of 32"
    return None


class FastInt4Linear(nn.Module):
    """``y = x @ W.T + b`` for ``W[n, k] = round_to(scales.dtype, (q[n, k] - z[g(k), n]) * s[g(k), n])``.

    Built from integer codes ``q`` ``[in, out]`` (0..15, any integer dtype), zero points ``z`` ``[G, out]``,
    scales ``s`` ``[G, out]`` and ``g_idx`` ``[in]`` (``None``: ``k // (in / G)``). See the module
    docstring for the two paths and their tolerances.

    A format that can write the kernel's layout straight from its own bytes passes ``packed`` (uint8
    ``[padded_out, in/2]``, e.g. from :func:`pack_int4_pairs`; ``codes`` is then ``None`` and ``g_idx`` must
    be too); one whose kernel offsets are not ``(8 - z) s`` passes ``kernel_pairs``, float32 ``[G, out, 2]``
    of ``(s, m)`` for the kernel's ``(q - 8) s + m``.
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    scales: torch.Tensor | None  # None: exact_scales() recovers them from scales_and_zeros (+ scale_residual)
    scale_residual: torch.Tensor | None
    zeros: torch.Tensor | None  # [1, 1] when uniform; None: exact_zeros() recovers them from scales_and_zeros
    perm: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        codes: torch.Tensor | None,
        zeros: torch.Tensor,
        scales: torch.Tensor,
        g_idx: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        *,
        compute_dtype: torch.dtype = torch.float32,
        small_rows: int = DEFAULT_SMALL_ROWS,
        prefill_dtype: torch.dtype | None = None,
        packed: torch.Tensor | None = None,
        kernel_pairs: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        status = int4pack_status()
        if packed is None:
            if codes is None:
                raise ValueError("FastInt4Linear needs codes or packed")
            in_features, out_features = codes.shape
        else:
            in_features, out_features = 2 * packed.shape[-1], scales.shape[-1]
        num_groups = scales.shape[0]
        if scales.shape != (num_groups, out_features) or zeros.shape != (num_groups, out_features):
            raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not match {out_features}")
        group_size = contiguous_group_size(g_idx, in_features, num_groups)
        reason = unsupported_reason(4, in_features, out_features, group_size, status=status)
        if reason is not None:
            raise ValueError(f"FastInt4Linear cannot run this layer: {reason}")
        assert group_size is not None
        kernel_group = kernel_group_size(group_size)
        assert kernel_group is not None
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.kernel_group = group_size, kernel_group
        self.compute_dtype, self.scale_dtype = compute_dtype, scales.dtype
        self.small_rows = small_rows
        self.prefill_dtype = prefill_dtype
        self.block_n = status.block_n
        self.padded_out = -(-out_features // self.block_n) * self.block_n

        perm = group_permutation(g_idx, group_size)
        pad = self.padded_out - out_features
        if packed is not None:
            if perm is not None or packed.dtype != torch.uint8 or packed.shape != (self.padded_out, in_features // 2):
                raise ValueError(f"packed must be the kernel's uint8 [{self.padded_out}, {in_features // 2}] layout")
            self.register_buffer("packed", packed)
        else:
            assert codes is not None
            codes = codes.to(torch.uint8)
            if perm is not None:
                codes = codes.index_select(0, perm)
            if pad:
                codes = F.pad(codes, (0, pad))
            # the layout _convert_weight_to_int4pack_for_cpu writes on this CPU (int4pack_status checked it),
            # built from uint8 codes: the op itself wants an int32 [N, K] copy (4 bytes per weight)
            self.register_buffer("packed", pack_int4_blocked(codes, self.block_n))
            del codes
        if kernel_pairs is not None:
            if kernel_pairs.shape != (num_groups, out_features, 2):
                raise ValueError(f"kernel_pairs {tuple(kernel_pairs.shape)} is not [{num_groups}, {out_features}, 2]")
            sz = kernel_pairs
        else:  # the kernel's m = (8 - z) * s, per kernel group (larger groups repeat their values)
            s32, z32 = scales.to(torch.float32), zeros.to(torch.float32)
            sz = torch.stack([s32, (8.0 - z32) * s32], -1)
            del s32, z32
        if pad:
            sz = F.pad(sz, (0, 0, 0, pad))
        repeat = group_size // kernel_group
        if repeat > 1:
            sz = sz.repeat_interleave(repeat, dim=0)
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16).contiguous())
        del sz
        if zeros.dtype != torch.uint8 and bool(((zeros < 0) | (zeros > 255)).any()):
            raise ValueError("zero points must lie in [0, 255]")
        self._keep_exact(scales, zeros.to(torch.uint8))
        self.register_buffer("perm", perm)
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))

    # ------------------------------------------------------------------ exact scales and zeros

    def _keep_exact(self, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Keep what the exact (many-rows) path needs beyond ``scales_and_zeros``, as little as is exact.

        The kernel's bfloat16 ``s`` is the exact scale when the scales are bfloat16 (or happen to round to
        themselves); for float16 scales an int8 residual in float16 ulps restores them (1 byte instead of
        2). Uniform zero points (GPTQ symmetric, GGUF) are one value; others are ``8 - m / s`` rounded,
        from the kernel's ``m = (8 - z) * s``. Each is checked against the given tensors here, and kept
        whole where the check fails (zero or non-finite scales, zeros too large to recover): the exact
        weight never changes. SmolLM2-135M 4-bit g64, GPTQ or AWQ: 4.7 MiB -> 1.6 (the residual).
        """
        self.register_buffer("scales", None)
        self.register_buffer("scale_residual", None)
        self.register_buffer("zeros", None)
        bf16 = self._kernel_columns(0)
        if torch.equal(bf16.to(scales.dtype), scales):
            pass  # the kernel's scales are the exact ones
        elif scales.dtype == torch.float16:
            residual = scales.view(torch.int16).to(torch.int32) - bf16.to(torch.float16).contiguous().view(torch.int16)
            if bool((residual.abs() <= 127).all()):
                self.scale_residual = residual.to(torch.int8)
            if self.scale_residual is None or not torch.equal(self.exact_scales(), scales):
                self.scale_residual, self.scales = None, scales.clone()
        else:
            self.scales = scales.clone()
        # one value expanded (stride 0: GGUF's) is uniform without a look; indexed, not flattened (no copy)
        if zeros.numel() and (zeros.stride() == (0, 0) or bool((zeros == zeros[0, 0]).all())):
            self.zeros = zeros[:1, :1].clone(memory_format=torch.contiguous_format)
        elif not torch.equal(self.exact_zeros(), zeros):
            self.zeros = zeros.contiguous()

    def _kernel_columns(self, part: int) -> torch.Tensor:
        """``scales_and_zeros[..., part]`` once per group and without the padded columns: ``[G, out]``."""
        repeat = self.group_size // self.kernel_group
        return self.scales_and_zeros[::repeat, : self.out_features, part]

    def exact_scales(self) -> torch.Tensor:
        """The scales as given (``[G, out]``, their own dtype)."""
        if self.scales is not None:
            return self.scales
        bf16 = self._kernel_columns(0)
        if self.scale_residual is None:
            return bf16.to(self.scale_dtype)
        bits = bf16.to(torch.float16).contiguous().view(torch.int16).to(torch.int32) + self.scale_residual
        return bits.to(torch.int16).view(torch.float16)

    def exact_zeros(self) -> torch.Tensor:
        """The zero points as given (``[G, out]`` uint8; ``[1, 1]`` when they are all the same)."""
        if self.zeros is not None:
            return self.zeros
        m = self._kernel_columns(1).to(torch.float32)
        return (8.0 - m / self.exact_scales().to(torch.float32)).round().clamp(0, 255).to(torch.uint8)

    # ------------------------------------------------------------------ weights

    def _codes_kn(self) -> torch.Tensor:
        """The codes unpacked from the kernel's layout, ``[in, out]`` (columns in sorted order)."""
        k, block = self.in_features, self.block_n
        blocks = self.packed.view(self.padded_out // block, k, block // 2)
        codes = torch.stack((blocks & 15, blocks >> 4), dim=2)  # [nb, K, 2, B/2]
        codes = codes.permute(1, 0, 2, 3).reshape(k, self.padded_out)
        return codes if self.padded_out == self.out_features else codes[:, : self.out_features]

    def weight_kn(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The exact weight, ``[in, out]`` with the input columns in sorted order, cast to ``dtype``."""
        k, n, g = self.in_features, self.out_features, self.group_size
        w = self._codes_kn().reshape(k // g, g, n).to(torch.float32)
        w.sub_(self.exact_zeros().to(torch.float32).unsqueeze(1)).mul_(
            self.exact_scales().to(torch.float32).unsqueeze(1)
        )
        w = w.view(k, n)
        target = dtype or self.scale_dtype
        if target == torch.bfloat16 and self.scale_dtype == torch.float16:
            return w.to(target)  # one rounding instead of two (bfloat16 tolerance either way)
        if self.scale_dtype != torch.float32:
            w = w.to(self.scale_dtype)  # the reference's single rounding (exact product in fp32)
        return w.to(target)

    def dequantize(self) -> torch.Tensor:
        """The exact weight, ``[out, in]`` in the scales' dtype and the original column order."""
        w = self.weight_kn()
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(0, self.perm, w)
        return w.t().contiguous()

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        y: torch.Tensor
        if x2.shape[0] <= self.small_rows:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16), self.packed, self.kernel_group, self.scales_and_zeros.contiguous()
            )
            if self.padded_out != self.out_features:
                y = y[:, : self.out_features]
            y = y.to(x.dtype)
        else:
            dtype = self.prefill_dtype or x.dtype
            y = torch.mm(x2.to(dtype), self.weight_kn(dtype)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Device moves follow ``fn``; dtype casts (``module.half()``) leave the packed data alone."""
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            moved = fn(buf)
            if moved.dtype != buf.dtype and name != "bias":
                moved = buf.to(moved.device)
            self._buffers[name] = moved
        return self

    def packed_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values() if b is not None)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"small_rows={self.small_rows}, prefill_dtype={self.prefill_dtype}, permuted={self.perm is not None}"
        )


# --------------------------------------------------------------------------- the LM head


@functools.cache
def bf16_head_status() -> tuple[bool, str]:
    """(usable, reason): oneDNN's prepacked bfloat16 linear runs here, is fast, and is right.

    ``torch.ops.mkldnn._reorder_linear_weight`` packs a bfloat16 weight once into oneDNN's blocked
    layout; ``_linear_pointwise`` then multiplies without re-laying it out per call (the 49152x576
    head of SmolLM2, 1 row, 1 thread: ~2.2 ms against ~7.5 ms for float32 and ~6 ms for an
    unpacked bfloat16 ``F.linear``). Worth it only with AMX or AVX512-BF16.
    """
    if not bf16_gemm_is_fast():
        return False, "no AMX or AVX512-BF16: bfloat16 GEMMs are slower than float32 here"
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
        x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        ref = F.linear(x.float(), w.float())
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        return False, f"oneDNN's prepacked linear does not run here: {str(exc).splitlines()[0]}"
    if y.shape != ref.shape or float((y.float() - ref).abs().max()) > 2e-2 * float(ref.abs().max()):
        return False, "oneDNN's prepacked linear gave wrong results in its self-test"
    return True, ""


#: ``cpu_fast_head``'s values: the decode form of :class:`FastHead` (``auto``: Q8_0 blocks where the compiled
#: kernel is built, else bfloat16 prepacked where oneDNN runs it fast), or ``dense`` (the exact float head)
HEAD_KINDS = ("auto", "q8_0", "bfloat16", "dense")
#: rows up to which a mixture's expert runs the decode kernel by default: a prompt's tokens spread over the experts, a
#: few each, and the kernel's cost grows with every row while a GEMM's barely does
EXPERT_SMALL_ROWS = 4
#: the same where the prompt GEMM runs in a 16-bit dtype (``cpu_fast_prefill`` bfloat16, the default where the CPU
#: has AMX or AVX512-BF16): its activations rounded to bfloat16 (~4e-3) are further from the exact product than the
#: block kernel's two int8 passes (~1e-4), and forming an expert's exact weight for its GEMM costs as much as ~50
#: rows of the kernel (gpt-oss 2048x1024, one thread: ~1.1 ms for the weight and the GEMM's fixed cost, ~0.036 ms a
#: kernel row): 4-of-32 routing gives a 128-token prompt ~16 tokens an expert, a 512-token one ~64
EXPERT_SMALL_ROWS_16BIT = 48


def expert_small_rows(prefill_dtype: torch.dtype | None, dtype: torch.dtype) -> int:
    """An expert's decode-kernel rows by default: :data:`EXPERT_SMALL_ROWS_16BIT` where a prompt's GEMM (in
    ``prefill_dtype``, else the model's ``dtype``) rounds its activations to 16 bits, else :data:`EXPERT_SMALL_ROWS`."""
    gemm = prefill_dtype or dtype
    return EXPERT_SMALL_ROWS_16BIT if gemm in (torch.bfloat16, torch.float16) else EXPERT_SMALL_ROWS


#: what option ``cpu_fast_weights`` takes: whether a layout that rounds the format's weight again is taken
ROUNDED_WEIGHTS = ("auto", "q8_0", "bfloat16")


def head_status(kind: str) -> tuple[bool, str]:
    """(usable, reason) for a :class:`FastHead` decoding in ``kind`` (``"q8_0"``: the compiled GGUF-block
    kernel, :mod:`anyquant_cpu.kernels`, is built and loads; ``"bfloat16"``: :func:`bf16_head_status`)."""
    if kind == "q8_0":
        from . import kernels

        if kernels.available():
            return True, ""
        return False, "the compiled GGUF-block kernel does not load here (`python -m anyquant_cpu.kernels` says why)"
    if kind == "bfloat16":
        return bf16_head_status()
    return False, f"no FastHead decodes in {kind!r}"


def head_kind(requested: str, in_features: int | None = None) -> tuple[str | None, str]:
    """The :class:`FastHead` decode form for option ``cpu_fast_head`` (:data:`HEAD_KINDS`) of a head ``in_features``
    wide (``None``: not known yet), or ``None`` and why not: ``dense`` asked for, or the form asked for (``auto``:
    either; Q8_0 where :func:`block_kernel_is_fast`) cannot run here or hold that width."""
    if requested == "dense":
        return None, "cpu_fast_head='dense'"
    reasons = []
    for kind in ("q8_0", "bfloat16") if requested == "auto" else (requested,):
        ok, reason = head_status(kind)
        if ok and kind == "q8_0" and requested == "auto" and not block_kernel_is_fast():
            ok, reason = False, "the compiled kernel runs its scalar path here (no AVX2)"
        if ok and kind == "q8_0" and in_features is not None and in_features % 32:
            ok, reason = False, f"Q8_0 blocks need a width divisible by 32, not {in_features}"
        if ok:
            return kind, ""
        reasons.append(reason)
    return None, "; ".join(reasons)


def _compact(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in a 2-byte float dtype that holds every value exactly (bfloat16 first, then
    float16), else unchanged: a float32 copy of a checkpoint's 16-bit table takes half the memory
    again. bfloat16 comes first because the prepacked head is built from a bfloat16 copy: when the
    table holds bfloat16 values, that copy is the table itself (SmolLM2-135M's float16 GPTQ table
    does: one 54 MiB temporary less at the load's peak)."""
    rows = max(1, (1 << 22) // max(1, weight[0].numel())) if weight.dim() > 1 else weight.numel()

    def holds(dtype: torch.dtype) -> bool:
        # checked a slice at a time: a whole round-trip copy would add its size to the load's peak
        return all(
            torch.equal(weight[i : i + rows].to(dtype).to(weight.dtype), weight[i : i + rows])
            for i in range(0, weight.shape[0], rows)
        )

    for dtype in (torch.bfloat16, torch.float16):
        if weight.dtype == dtype:
            return weight
        if dtype.itemsize <= weight.dtype.itemsize and holds(dtype):
            return weight.to(dtype)
    return weight


class RowTable(Protocol):
    """A 2-D table outside memory, read a slice of rows at a time: a :class:`FileRows`, or a plugin's packed
    table decoded on demand (GGUF's tied Q8_0 head: ``anyquant_gguf.qlinear.GGUFRows``; mlx's quantized embedding:
    ``anyquant_mlx.dequant.MlxRows``, which a source's ``file_rows`` hands the build)."""

    shape: tuple[int, int]
    dtype: torch.dtype

    def slice(self, start: int, count: int) -> torch.Tensor: ...

    def read_all(self) -> torch.Tensor: ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``table[ids]``, ``[*ids.shape, dim]``."""
        ...


def _rows(table: torch.Tensor | RowTable, start: int, count: int) -> torch.Tensor:
    """Rows ``start .. start + count`` of an in-memory table or a :class:`RowTable`."""
    return table[start : start + count] if isinstance(table, torch.Tensor) else table.slice(start, count)


def _whole(table: torch.Tensor | RowTable) -> torch.Tensor:
    """An in-memory table itself, or a :class:`FileRows` read whole (a copy)."""
    return table if isinstance(table, torch.Tensor) else table.read_all()


def _where(table: torch.Tensor | RowTable) -> str:
    return "memory" if isinstance(table, torch.Tensor) else "file"


class CompactEmbedding(nn.Module):
    """An input embedding whose table is kept in a narrower dtype that holds it exactly, or left in the
    checkpoint file (a :class:`~anyquant_runtime.tensors.FileRows`: only the looked-up rows are read);
    rows are looked up, then cast to the compute dtype (exact)."""

    def __init__(self, weight: torch.Tensor | FileRows, compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.compute_dtype = compute_dtype
        self.table: torch.Tensor | None
        # an in-memory table is a buffer (moves and state_dict see it); a file table an attribute
        self.file = None if isinstance(weight, torch.Tensor) else weight
        self.register_buffer("table", weight if isinstance(weight, torch.Tensor) else None)

    @property
    def source(self) -> torch.Tensor | FileRows:
        """The exact table: the buffer, or the :class:`FileRows` it is read from."""
        return self.file if self.file is not None else self.table  # type: ignore[return-value]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.file is not None:
            return self.file.rows(ids).to(self.compute_dtype)
        assert self.table is not None  # no file: the table is the buffer
        return F.embedding(ids, self.table).to(self.compute_dtype)

    def dequantize(self) -> torch.Tensor:
        """The table in the compute dtype (exact; a copy: for export and inspection, not the forward)."""
        return _whole(self.source).to(self.compute_dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, table={self.source.dtype} ({_where(self.source)})"


class FastHead(nn.Module):
    """The output projection (LM head) for the ``cpu-fast`` backend.

    - few rows (``<= small_rows``; decode), ``decode="q8_0"``: a Q8_0 copy of the weight (1.06 bytes per
      weight, :func:`~anyquant_cpu.kernels.linear.q8_0_blocks`; in the kernel's interleaved form unless
      ``interleave=False``) on the compiled GGUF-block kernel, activations in one int8 pass (llama.cpp's
      arithmetic for its Q8_0 heads); SmolLM2's 49152x576 head, 1 row, 2 threads: ~1.2 ms against ~4.5 ms
      for the bfloat16 copy; ``decode="bfloat16"``: bfloat16 activations times a bfloat16 copy of the weight
      prepacked for oneDNN (see :func:`bf16_head_status`). Either way within the int8/bfloat16 tolerance of
      the int4 layers, except for the ``EXACT_TOP`` largest logits of each row, computed again from the
      exact weight: the greedy token is the exact head's (oneDNN rounds its output to bfloat16, 0.125 at a
      logit of 25, so near-ties were broken at random: SmolLM2's Q4_1 GGUF answered "L'Étoile" instead of
      "Paris");
    - many rows (prompts, perplexity): the exact weight, upcast to the compute dtype one slice of
      ``CHUNK_ROWS`` vocabulary rows at a time, and a float GEMM, as the dense head computes it.

    The exact weight is kept in the narrowest dtype that holds it exactly (a float16 checkpoint's
    head or tied embedding: half of float32) and may be shared with a :class:`CompactEmbedding`, or
    left outside memory (a :class:`RowTable`: a :class:`~anyquant_runtime.tensors.FileRows`, or a GGUF
    table decoded from its blocks), read a slice at a time: then the decode copy is all the head holds in
    memory (the bfloat16 one is built in ``FILE_PIECES`` pieces of halving size, so the load holds at most
    a sixteenth of a bfloat16 copy besides it; the Q8_0 one is quantized ``CHUNK_ROWS`` rows at a time).
    """

    CHUNK_ROWS = 8192
    #: logits per row recomputed exactly after the bfloat16 product (its error on SmolLM2's head: ~0.1,
    #: where the 64th largest logit lies several units below the largest)
    EXACT_TOP = 64
    #: prepacked pieces of a file-backed head, each half the rows left (the last two equal: 1/2, 1/4, 1/8,
    #: 1/16, 1/16), so the load's peak is the prepacked head plus one sixteenth of it in bfloat16 (equal
    #: quarters: one quarter). One call each per decode step, a little slower than one piece; bitwise the same
    #: result.
    FILE_PIECES = 5

    def __init__(
        self,
        exact: torch.Tensor | RowTable,
        bias: torch.Tensor | None = None,
        *,
        compute_dtype: torch.dtype = torch.float32,
        small_rows: int = DEFAULT_SMALL_ROWS,
        decode: str = "bfloat16",
        interleave: bool = True,
    ) -> None:
        super().__init__()
        ok, reason = head_status(decode)
        if ok and decode == "q8_0" and exact.shape[1] % 32:
            ok, reason = False, f"Q8_0 blocks need a width divisible by 32, not {exact.shape[1]}"
        if not ok:
            raise ValueError(f"FastHead ({decode}) cannot run here: {reason}")
        self.out_features, self.in_features = exact.shape
        self.compute_dtype, self.small_rows = compute_dtype, small_rows
        self.exact: torch.Tensor | None
        # an in-memory table is a buffer (moves and state_dict see it); a file table an attribute
        self.file = None if isinstance(exact, torch.Tensor) else exact
        self.register_buffer("exact", exact if isinstance(exact, torch.Tensor) else None)
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype))
        # the decode copy, in the kernel's or oneDNN's form: attributes, not buffers (state_dict holds the exact
        # weight only; oneDNN's opaque tensors cannot be moved or cast)
        self.packed: list[torch.Tensor] = []
        self.blocks: torch.Tensor | None = None
        self.ggml_type = 0
        if decode == "q8_0":
            self._set_q8_0(exact, interleave)
            return
        reorder = torch.ops.mkldnn._reorder_linear_weight
        if self.file is None:
            self.packed = [reorder(exact.to(torch.bfloat16), None)]  # type: ignore[union-attr]
        else:
            from anyquant.plugin import release_free_heap

            for start, count in _halving_pieces(self.out_features, self.FILE_PIECES):
                piece = torch.empty(count, self.in_features, dtype=torch.bfloat16)
                for at in range(0, piece.shape[0], self.CHUNK_ROWS // 4):  # read and rounded a slice at a time
                    rows = self.file.slice(start + at, min(self.CHUNK_ROWS // 4, piece.shape[0] - at))
                    piece[at : at + rows.shape[0]].copy_(rows)
                self.packed.append(reorder(piece, None))
                del piece, rows
                release_free_heap()  # the piece, before the next one is read

    #: weights per slice of :meth:`_set_q8_0` (its float32 temporaries: 4 MiB each, not ``CHUNK_ROWS`` rows' worth:
    #: 64 MiB each for a 2,048-wide head, several at once, above the load's steady memory)
    Q8_SLICE = 1 << 20

    def _set_q8_0(self, exact: torch.Tensor | RowTable, interleave: bool) -> None:
        """The Q8_0 decode copy, quantized (and copied into the kernel's interleaved form) a slice of rows at a time,
        straight into the one buffer it is held in: the bytes of ``q8_0_blocks`` of the whole weight then
        :meth:`_set_blocks`, without a second whole copy or large float32 temporaries at the load's peak."""
        from .kernels import GGML_TYPES, INTERLEAVED
        from .kernels.linear import q8_0_blocks

        code, bs, qk = GGML_TYPES["Q8_0"]
        n, k = self.out_features, self.in_features
        nb, groups, tile = k // qk, n // 8 if interleave else 0, 64  # the kernel's IL_TILE blocks of 32
        blocks = torch.empty(n * nb * bs, dtype=torch.uint8)
        step = max(8, self.Q8_SLICE // k // 8 * 8)
        for start in range(0, n, step):
            count = min(step, n - start)
            q = q8_0_blocks(_rows(exact, start, count)).reshape(-1)
            whole = max(0, min(count, 8 * groups - start))  # rows in whole groups of 8 (a multiple of 8)
            if whole:
                # the chunk's own interleaved form, tile by tile where the whole weight's puts it (ggml_gemv.cpp's
                # il_piece: each column tile holds every group's pieces, group after group)
                il = torch.ops.anyquant.ggml_interleave(q[: whole * nb * bs], code, whole, k, True)
                g0, gc = start // 8, whole // 8
                for t0 in range(0, nb, tile):
                    tw = min(tile, nb - t0)
                    at = 8 * bs * (groups * t0 + g0 * tw)
                    blocks[at : at + 8 * bs * gc * tw] = il[8 * bs * gc * t0 : 8 * bs * gc * (t0 + tw)]
            # rows past the last whole group (or all rows, not interleaved) stay as they are
            blocks[(start + whole) * nb * bs : (start + count) * nb * bs] = q[whole * nb * bs :]
        self.blocks, self.ggml_type, self.block_type = blocks, code + (INTERLEAVED if interleave else 0), "Q8_0"

    def _set_blocks(self, blocks: torch.Tensor, type_name: str, interleave: bool) -> None:
        """Decode through the compiled kernel on GGUF ``blocks`` of ``type_name`` (the stored form; copied into
        the kernel's interleaved form when ``interleave``)."""
        from .kernels import GGML_TYPES, INTERLEAVED

        code = GGML_TYPES[type_name][0]
        blocks = blocks.reshape(-1).contiguous()
        if interleave:
            blocks = torch.ops.anyquant.ggml_interleave(blocks, code, self.out_features, self.in_features, True)
            code += INTERLEAVED
        self.blocks, self.ggml_type, self.block_type = blocks, code, type_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.small_rows:
            y: torch.Tensor
            if self.blocks is not None:
                # one activation pass: the top logits are computed again exactly, the rest keep its error
                y = torch.ops.anyquant.ggml_gemv(
                    x2, self.blocks, self.ggml_type, self.out_features, self.in_features, -1, 1
                ).to(x.dtype)
            else:
                xb = x2.to(torch.bfloat16)
                linear = torch.ops.mkldnn._linear_pointwise
                parts = [linear(xb, packed, None, "none", [], "") for packed in self.packed]
                y = (parts[0] if len(parts) == 1 else torch.cat(parts, -1)).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
            self._exact_top(x2, y)
        else:
            y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype)
            for start in range(0, self.out_features, self.CHUNK_ROWS):
                w = _rows(self.source, start, self.CHUNK_ROWS).to(x.dtype)
                torch.mm(x2, w.t(), out=y[:, start : start + w.shape[0]])
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _exact_top(self, x2: torch.Tensor, y: torch.Tensor) -> None:
        """Overwrite each row's ``EXACT_TOP`` largest logits of ``y`` (bias included) with exact ones."""
        k = min(self.EXACT_TOP, self.out_features)
        if k == 0:
            return
        top = torch.topk(y, k, dim=-1, sorted=False).indices  # [rows, k]
        source = self.source
        weight = source[top] if isinstance(source, torch.Tensor) else source.rows(top)  # [rows, k, in]
        # products summed per row along its features: each row's numbers the same whatever rows share the call
        # (a batched matmul's kernel changes with the rows: a server's rows then differed from a lone request's),
        # and faster at 8 rows (23 against 113 us; 9 against 5 at one)
        exact = (weight.to(x2.dtype) * x2[:, None, :]).sum(-1)
        if self.bias is not None:
            exact = exact + self.bias.to(x2.dtype)[top]
        y.scatter_(-1, top, exact.to(y.dtype))

    @property
    def source(self) -> torch.Tensor | RowTable:
        """The exact weight: the buffer, or the :class:`RowTable` it is read from."""
        return self.file if self.file is not None else self.exact  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """The exact weight in the compute dtype (a copy: for export and inspection, not the forward)."""
        return _whole(self.source).to(self.compute_dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """The head lives on the CPU in its own dtypes: casts and moves are refused, not half-done."""
        for buf in self._buffers.values():
            if buf is not None:
                moved = fn(buf)
                if moved.device != buf.device:
                    raise RuntimeError("FastHead (cpu-fast backend) runs on the CPU only; load with another backend")
        return self

    def packed_bytes(self) -> int:
        """Bytes held in memory: the decode copy, and the exact table unless it stays in the file."""
        exact = int(self.exact.nbytes) if self.exact is not None else 0
        copy = int(self.blocks.nbytes) if self.blocks is not None else self.out_features * self.in_features * 2
        return exact + copy

    def extra_repr(self) -> str:
        from .kernels import INTERLEAVED

        if self.blocks is None:
            decode = "bfloat16 prepacked"
        else:
            decode = f"{self.block_type} blocks{' interleaved' if self.ggml_type >= INTERLEAVED else ''}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, decode={decode}, "
            f"exact={self.source.dtype} ({_where(self.source)}), small_rows={self.small_rows}"
        )


class PrepackedBf16Linear(nn.Module):
    """A quantized linear run as a bfloat16 weight prepacked for oneDNN: ``cpu-fast`` for formats whose
    weights have no int4-kernel layout (EXL3's trellises and EXL2's variable-bit groups use it).

    The weight is decoded once at load (``source.dequantize()``), rounded to bfloat16 and packed into
    oneDNN's blocked layout (:func:`bf16_head_status`); every forward rounds the activations to bfloat16
    and multiplies with AMX / AVX512-BF16 (SmolLM2's 576x1536, 1 thread: ~50 us for 1 row against ~120 us
    for float32, ~110 us against ~730 us for 64 rows). Tolerance: the bfloat16 class of the int4 path.
    ``source`` (the format's own module, its packed tensors kept: a few bits per weight) gives the exact
    :meth:`dequantize` and the bias. Memory: 2 bytes per weight plus the source's packed size.
    """

    def __init__(self, source: nn.Module, small_rows: int | None = None) -> None:
        super().__init__()
        #: above this many rows the forward is the source's own (exact) one: GGUF's cpu-fast keeps long
        #: prompts exact, as its int4 layers do; ``None`` (EXL3, EXL2): every forward in bfloat16
        self.small_rows = small_rows
        ok, reason = bf16_head_status()
        if not ok:
            raise ValueError(f"PrepackedBf16Linear cannot run here: {reason}")
        self.source = source
        linear: Any = source  # an nn.Linear or a plugin's linear module: in_features / out_features
        self.in_features, self.out_features = int(linear.in_features), int(linear.out_features)
        weight = source.dequantize()  # type: ignore[operator]
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"the source's weight is {tuple(weight.shape)}, not [out, in]")
        # an opaque oneDNN tensor: an attribute, not a buffer (state_dict and .to() cannot take it)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous(), None)

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.source, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.small_rows is not None and x2.shape[0] > self.small_rows:
            return self.source(x)  # type: ignore[no-any-return]
        x2 = x2.to(torch.bfloat16)
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x2, self.packed, None, "none", [], "").to(x.dtype)
        bias = self.bias
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The exact weight, from the source (not the bfloat16 copy)."""
        return self.source.dequantize()  # type: ignore[operator, no-any-return]

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """The prepacked weight lives on the CPU: moves are refused (casts leave it alone)."""
        for buf in self.source.buffers():
            if fn(buf).device != buf.device:
                raise RuntimeError(
                    "PrepackedBf16Linear (cpu-fast backend) runs on the CPU only; load with another backend"
                )
        return self

    def packed_bytes(self) -> int:
        return self.in_features * self.out_features * 2

    def extra_repr(self) -> str:
        rows = "" if self.small_rows is None else f", exact above {self.small_rows} rows"
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=bfloat16 prepacked{rows}"


def _halving_pieces(rows: int, pieces: int, align: int = 64) -> list[tuple[int, int]]:
    """``(start, count)`` of ``pieces`` row ranges, each half of what is left (multiples of ``align``), the
    last taking the rest: 49152 rows in 4 -> 24576, 12288, 6144, 6144."""
    out, start = [], 0
    for _ in range(pieces - 1):
        count = (rows - start) // 2 // align * align
        if count:
            out.append((start, count))
            start += count
    out.append((start, rows - start))
    return out


def _file_table(module: Any, param: torch.Tensor, tables: Mapping[str, FileRows]) -> FileRows | None:
    """The file table the build left ``param`` (a meta parameter) to, under any of its names."""
    for name, p in module.named_parameters(remove_duplicate=False):
        if p is param and name in tables:
            return tables[name]
    return None


def _embedding_in_file(module: Any, tables: Mapping[str, FileRows], compute: torch.dtype) -> None:
    """An input embedding the build left in the file that no fast head took over (a head of the format's own, or a
    dense one) and that nothing else shares: a :class:`CompactEmbedding` over the table (looked-up rows read, never
    the whole table held)."""
    get_in = getattr(module, "get_input_embeddings", None)
    emb = get_in() if get_in is not None else None
    if type(emb) is not nn.Embedding or not emb.weight.is_meta:
        return
    shared = sum(1 for _, p in module.named_parameters(remove_duplicate=False) if p is emb.weight)
    table = _file_table(module, emb.weight, tables)
    if table is not None and shared == 1:
        module.set_input_embeddings(CompactEmbedding(table, compute))


def install_fast_head(
    module: Any,
    *,
    small_rows: int = DEFAULT_SMALL_ROWS,
    compute_dtype: torch.dtype | None = None,
    tables: Mapping[str, FileRows] | None = None,
    kind: str = "auto",
    interleave: bool = True,
) -> dict[str, Any]:
    """Swap a built model's dense LM head for a :class:`FastHead` (and, when the head is tied to
    the input embedding, the embedding for a :class:`CompactEmbedding` sharing its exact table).

    ``tables``: parameters the build left on the meta device, by name, as file tables
    (:func:`anyquant_runtime.build.build_model`'s ``file_tables``): the head and embedding then read
    them from the file. ``kind``: the decode form (:func:`head_kind`), ``interleave``: a Q8_0 copy in the kernel's
    interleaved form. Returns what was done, for ``LoadedModel.info``; leaves the model alone (and
    says why) when the head is not a plain float ``nn.Linear`` on the CPU or no decode form runs here
    (the caller then fills what the build left: :func:`~anyquant_runtime.tensors.fill_file_tables`).
    """
    tables = tables or {}
    get_out = getattr(module, "get_output_embeddings", None)
    head = get_out() if get_out is not None else None
    if (
        type(head) is not nn.Linear
        or not head.weight.dtype.is_floating_point
        or head.weight.device.type not in ("cpu", "meta")
    ):
        return {"head": "dense", "reason": f"the output projection is a {type(head).__name__}, not a dense Linear"}
    decode, reason = head_kind(kind, head.in_features)
    if decode is None:
        return {"head": "dense", "reason": reason}
    head_file = _file_table(module, head.weight, tables) if head.weight.is_meta else None
    if head.weight.is_meta and head_file is None:
        return {"head": "dense", "reason": "the head's weight was not read"}
    # the head's own dtype unless the build kept a 16-bit embedding (and tied head) for us
    compute = compute_dtype or head.weight.dtype
    emb = module.get_input_embeddings()
    tied = type(emb) is nn.Embedding and emb.weight is head.weight
    exact: torch.Tensor | FileRows = head_file if head_file is not None else _compact(head.weight.detach())
    bias = None if head.bias is None else head.bias.detach()
    table = exact if tied else None
    if type(emb) is nn.Embedding and emb.weight.is_meta:
        table = exact if tied else _file_table(module, emb.weight, tables)
        if table is not None:
            module.set_input_embeddings(CompactEmbedding(table, compute))
    elif type(emb) is nn.Embedding and emb.weight.dtype in (compute, torch.float16, torch.bfloat16):
        table = exact if tied else _compact(emb.weight.detach())
        if tied or table.dtype != compute:
            module.set_input_embeddings(CompactEmbedding(table, compute))
    # drop the float head (and a tied table) before the prepacked copy exists: a lower peak
    module.set_output_embeddings(nn.Identity())
    del head, emb
    fast = FastHead(exact, bias, compute_dtype=compute, small_rows=small_rows, decode=decode, interleave=interleave)
    module.set_output_embeddings(fast)
    # the config keeps tie_word_embeddings: both modules share ``exact``, and a dense export
    # (export_dense turns them back into an nn.Embedding and an nn.Linear) stays tied as it was
    return {
        "head": "bfloat16 prepacked" if decode == "bfloat16" else "Q8_0 blocks",
        **({"interleaved": interleave} if decode == "q8_0" else {}),
        "exact_dtype": str(exact.dtype).replace("torch.", ""),
        "exact_in": _where(exact),
        "embedding_dtype": None if table is None else str(table.dtype).replace("torch.", ""),
        "embedding_in": None if table is None else _where(table),
        "tied": tied,
    }


def _restore_embedding_dtype(module: Any, dtype: torch.dtype) -> None:
    """A plain embedding (and the head tied to it) the build kept 16-bit, back in the compute dtype."""
    emb = module.get_input_embeddings()
    if type(emb) is not nn.Embedding or emb.weight.dtype == dtype:
        return
    head = module.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    emb.weight = nn.Parameter(emb.weight.detach().to(dtype), requires_grad=False)
    if tied:
        head.weight = emb.weight


def kernel_norms(module: nn.Module, rows: int) -> int:
    """The native decoder's RMSNorms on the compiled kernel's ``anyquant::rms_norm`` up to ``rows`` tokens
    (:attr:`~anyquant_runtime.layers.RMSNorm.kernel_rows`; Qwen3's per-head q/k norms up to ``rows`` times their
    attention's query or key heads, the rows they see): cpu-fast's decode path, one call instead of torch's six ops
    (SmolLM2: 61 norms a token, ~10 us each at 2 threads); longer prompts keep torch's exact ``rms_norm``. Returns
    how many, 0 where the kernel is not built."""
    from . import kernels

    if not kernels.available():
        return 0
    count = 0
    for name, m in module.named_modules():
        # the norms that take the op declare kernel_rows (the native RMSNorm; Gemma's and transformers' do not)
        if not hasattr(type(m), "kernel_rows"):
            continue
        per = 1
        if name.endswith(("q_norm", "k_norm")):
            attn = module.get_submodule(name.rpartition(".")[0])
            per = getattr(attn, "heads" if name.endswith("q_norm") else "kv_heads", 0)
            if not per:
                continue
        m.kernel_rows = rows * per
        count += 1
    return count


def kernel_attention(module: nn.Module) -> int:
    """The native decoder's attention layers on the compiled kernel's ``anyquant::decode_attention`` for decode
    steps (:attr:`~anyquant_runtime.native.Attention.decode_kernel`): one call a layer for every row of a step,
    the cache write included, where torch's ``scaled_dot_product_attention`` is one call per row (~25 us each on
    2 threads, 240 a step for 8 rows of SmolLM2) after a write per row. Prompts keep torch's. Returns how many,
    0 where the kernel is not built."""
    from . import kernels

    if not kernels.attention_available():
        return 0
    count = 0
    for m in module.modules():
        if hasattr(type(m), "decode_kernel"):
            setattr(m, "decode_kernel", True)  # noqa: B010 - an nn.Module attribute mypy types as Tensor | Module
            count += 1
    return count


def block_kernel_is_fast() -> bool:
    """Whether the compiled block kernel is built and runs a vector path here (AVX2 or AVX512-VNNI; its scalar
    path is for tests): then GPTQ / AWQ 4-bit layers decode faster on it than on torch's int4 kernel
    (bench/kernels.py, SmolLM2's shapes, 1 row: 1.07-1.30x at 2 threads, 1.14-1.37x at 1 thread; 4 to 64 rows
    within -30 % / +10 % of it, the small q/o and k/v shapes the slower ones; AMD EPYC, AVX512-VNNI)."""
    from . import kernels

    return kernels.available() and kernels.isa() >= 1


def to_block_kernel(module: nn.Module, interleave: bool = True) -> dict[str, Any]:
    """Swap ``module``'s :class:`FastInt4Linear` layers for
    :class:`~anyquant_cpu.kernels.linear.GroupInt4BlockLinear` (the same weight as GQ4 blocks, read by
    the compiled kernel: faster than torch's int4 kernel for a few rows) when the kernel is built.

    All or none of a decoder layer's (a module with ``self_attn`` and ``mlp``), so that the compiled decode
    step plans it whole ("ggml", or "mixed_moe" for a mixture-of-experts layer, its experts on the kernel too:
    faster than "int4_moe" on torch's kernel, bench/moe.py; else "int4"). ``interleave``: the blocks in the kernel's interleaved
    form (:mod:`anyquant_cpu.kernels`). Returns the record for ``info["cpu_fast"]``:
    ``{}`` when the kernel is not built, else the count converted and why the others were not."""
    from . import kernels

    if not kernels.available():
        return {}
    from anyquant.plugin import release_free_heap
    from anyquant_runtime.build import TRIM_LAYERS

    from .kernels.linear import GroupInt4BlockLinear

    def int4_children(root: nn.Module, prefix: str = "") -> list[tuple[nn.Module, str, FastInt4Linear, str]]:
        return [
            (m, name, child, f"{where}.{name}" if where else name)
            for where, m in root.named_modules(prefix=prefix)
            for name, child in m.named_children()
            if type(child) is FastInt4Linear and id(child) not in taken
        ]

    taken: set[int] = set()
    groups: list[tuple[str, list[tuple[nn.Module, str, FastInt4Linear, str]]]] = []
    for name, m in module.named_modules():
        if hasattr(m, "self_attn") and hasattr(m, "mlp"):
            members = int4_children(m, name)
            taken.update(id(c[2]) for c in members)
            groups.append((name, members))
    groups += [(c[3], [c]) for c in int4_children(module)]  # linears outside decoder layers, one by one
    skipped: dict[str, str] = {}
    converted = 0
    # a group at a time, its torch-int4 linears dropped (from the list too) and, every few layers, their pages handed
    # back to the system: the load's peak holds a few layers in both forms, not the whole model (1.1B W4A16: 1,604 ->
    # 1,054 MiB; a hand-back after every layer costs a tenth of the load in page faults)
    groups.reverse()
    trimmed = 0
    while groups:
        owner, members = groups.pop()
        if not members:
            continue
        reason = next((r for c in members if (r := GroupInt4BlockLinear.unsupported_reason(c[2])) is not None), None)
        if reason is not None:
            skipped[owner] = reason
            continue
        while members:
            parent, child_name, child, _ = members.pop()
            setattr(parent, child_name, GroupInt4BlockLinear.from_fast(child, interleave=interleave))
            converted += 1
        del child
        trimmed += 1
        if trimmed % TRIM_LAYERS == 0:
            release_free_heap()
    if skipped:
        log.info(
            "cpu-fast: %d int4 groups stay on torch's int4 kernel (%s)", len(skipped), "; ".join(set(skipped.values()))
        )
    return {"gq4_layers": converted, "int4_kernel": skipped}


# --------------------------------------------------------------------------- GGUF blocks (llama.cpp's GGML types)

#: the GGML types whose blocks repack for torch's int4 kernel (4-bit codes, a scale and an offset per 32 weights):
#: (the block's header bytes before its nibbles, half a chunk: weights ``i`` and ``half + i`` of each chunk of
#: ``2 * half`` weights share nibble byte ``i``)
_GGML_INT4 = {"Q4_0": (2, 16), "Q4_1": (4, 16), "Q4_K": (16, 32)}


def _ggml_int4_pairs(b: torch.Tensor, type_name: str, out_features: int) -> torch.Tensor:
    """The blocks' nibble bytes as :func:`pack_int4_pairs` reads them (a view): Q4_0/Q4_1 hold weights ``i`` and
    ``16 + i`` of a 32-weight block in byte ``i``; Q4_K weights ``64c + i`` and ``64c + 32 + i`` of a 256-weight
    super-block in byte ``32c + i``."""
    header, half = _GGML_INT4[type_name]
    blocks = b.view(out_features, -1, b.shape[-1])[:, :, header:]
    return blocks.view(out_features, blocks.shape[1], -1, half)


def _unpermute_qk_rows(blocks: torch.Tensor, rows: int, heads: int) -> torch.Tensor:
    """A "llama" GGUF file's Q/K rows (permuted by llama.cpp's converter, in ``heads`` heads) in the model's order (a
    copy)."""
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows cannot be split into {heads} heads of even size")
    grouped = blocks.reshape(heads, rows // heads // 2, 2, -1)
    return grouped.transpose(1, 2).reshape(rows, -1)


class GGUFInt4Linear(FastInt4Linear):
    """:class:`~anyquant_runtime.layouts.GGUFBlocks` of Q4_0/Q4_1/Q4_K repacked for torch's int4 CPU kernel (decode:
    bfloat16 activations; prompts: the exact float32 weight, dequantized per forward, and a GEMM):
    :class:`FastInt4Linear` with a float offset per group.

    The base takes integer zero points (``W = (q - z) * s``); these types' offsets are arbitrary floats. The int4
    kernel computes ``(q - 8) * s + m`` with any ``m``, so only its ``scales_and_zeros`` (``m = offset + 8 s``,
    bfloat16 like the base's) and the exact dense weight of the many-rows path (``s * q + offset`` in float32)
    differ. The kernel's layout is written straight from the blocks' nibble bytes (:func:`pack_int4_pairs`: no
    unpacked codes, a few whole-tensor ops per layer) when the rows fill the kernel's blocks, else from unpacked,
    padded codes.
    """

    offsets: torch.Tensor

    def __init__(
        self,
        blocks: torch.Tensor,
        type_name: str,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        from .kernels import GGML_TYPES

        if type_name not in _GGML_INT4:
            raise ValueError(f"{type_name} has no int4 kernel")
        b = blocks.reshape(-1, GGML_TYPES[type_name][1])
        block = int4pack_status().block_n
        pairs_og = _ggml_int4_pairs(b, type_name, out_features)
        if block > 0 and out_features % block == 0:
            scales_og, offsets_og = ggml_int4_scales_offsets(b, type_name, out_features, offsets=type_name != "Q4_0")
            codes = None
            packed = pack_int4_pairs(pairs_og, block)
        else:
            scales_og, offsets_og = ggml_int4_scales_offsets(b, type_name, out_features)
            scales_og, offsets_og = scales_og.contiguous(), offsets_og.contiguous()
            nibbles = torch.stack([pairs_og & 0x0F, pairs_og >> 4], dim=-2)  # each chunk's low weights, then high
            codes, packed = nibbles.reshape(out_features, in_features).t(), None
        del pairs_og
        scales = scales_og.t()  # [G, out]
        groups = scales.shape[0]
        offsets = torch.empty(groups, out_features)
        if type_name == "Q4_0":  # -8 d, as _ggml_int4_scales_offsets gives it, written straight in [G, out] order
            torch.mul(scales, -8.0, out=offsets)
        else:
            offsets.copy_(offsets_og.t())
        # the kernel's (s, m = offset + 8 s); s stays what the base keeps as the exact scale (bf16(s) in the kernel's
        # column: the many-rows path recovers s bit for bit from the base's buffers)
        pairs = torch.empty(groups, out_features, 2)
        pairs[..., 0].copy_(scales)
        torch.mul(scales, 8.0, out=pairs[..., 1])
        pairs[..., 1].add_(offsets)
        zeros = torch.zeros((1, 1), dtype=torch.uint8).expand(groups, out_features)
        super().__init__(codes, zeros, scales, bias=bias, packed=packed, kernel_pairs=pairs, **kwargs)
        del codes, packed, pairs
        self.type_name = type_name
        self.register_buffer("offsets", offsets)

    def weight_kn(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        w = self._codes_kn().reshape(k // 32, 32, n).to(torch.float32)
        w.mul_(self.exact_scales().unsqueeze(1)).add_(self.offsets.unsqueeze(1))
        return w.view(k, n).to(dtype or torch.float32)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, qtype={self.type_name}"


class GGUFBlockLinear(BlockLinear):
    """:class:`~anyquant_runtime.layouts.GGUFBlocks` on the compiled GGUF-block kernel (decode), the blocks read in
    place or held in the kernel's interleaved form (``interleave``); prompts dequantize the blocks per forward (the
    kernel's ``ggml_dequantize``: bitwise the GGUF format's own dequantization, tested)."""

    def dequantize(self) -> torch.Tensor:
        return self.exact_weight(torch.float32)


class GGUFBlockHead(FastHead):
    """:class:`FastHead` whose decode product is the GGUF-block kernel on the table's own blocks (read in place, or
    copied once into the kernel's interleaved form when ``interleave``; nothing quantized again); the ``EXACT_TOP``
    largest logits of each row are computed again from the exact table (``table``: the format's rows, read a slice
    at a time; :meth:`FastCPUPlan.table_head` gives a table with a ``decode_rows`` slot the kernel's decoder), as
    FastHead does, and prompts use its exact path."""

    def __init__(
        self, table: RowTable, blocks: torch.Tensor, type_name: str, *, small_rows: int, interleave: bool = False
    ) -> None:
        nn.Module.__init__(self)  # FastHead's own __init__ makes a copy of its own: not wanted here
        self.out_features, self.in_features = table.shape
        self.compute_dtype, self.small_rows = torch.float32, small_rows
        self.file = table
        self.table = table
        self.register_buffer("exact", None)
        self.register_buffer("bias", None)
        self.packed = []
        self._set_blocks(blocks, type_name, interleave)
        self.interleaved = interleave

    def packed_bytes(self) -> int:
        copy = self.blocks if self.interleaved else None  # else the table's bytes are the format's (the file's)
        return 0 if copy is None else int(copy.nbytes)


def _kernel_rows(type_name: str, dim: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A packed GGUF table's ``decode_rows`` (``(blocks [n, bytes_per_row], n) -> [n, dim]`` float32) by the kernel's
    ``ggml_dequantize``: one call instead of the format's torch ops, bit for bit its rows (tested)."""
    from .kernels import GGML_TYPES

    code = GGML_TYPES[type_name][0]

    def decode_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
        out: torch.Tensor = torch.ops.anyquant.ggml_dequantize(rows.reshape(-1), code, n, dim, torch.float32)
        return out

    return decode_rows


def _gguf_on_kernel(lay: GGUFBlocks) -> bool:
    """Whether the compiled GGUF-block kernel reads ``lay``'s blocks as stored here (built, any ISA; the type its own)."""
    from . import kernels

    return lay.as_stored and lay.type_name in kernels.GGML_TYPES and lay.type_name != "GQ4" and kernels.available()


# --------------------------------------------------------------------------- packed layouts: the CPU engine


class Int8BlockLinear(BlockLinear):
    """:class:`~anyquant_runtime.layouts.Int8Blocks` as Q8_0 blocks on the compiled kernel (its codes as they are, its
    scale per block of 32): the exact weight, ``round_to(q * d)`` (the format's own arithmetic), from the blocks."""

    def __init__(
        self,
        blocks: torch.Tensor,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        *,
        round_to: torch.dtype,
        **kwargs: Any,
    ) -> None:
        super().__init__(blocks, "Q8_0", out_features, in_features, bias, **kwargs)
        self.round_to = round_to

    def dequantize(self) -> torch.Tensor:
        assert self.round_to is not None
        return self.exact_weight(self.round_to)


class Affine4BlockLinear(BlockLinear):
    """:class:`~anyquant_runtime.layouts.Affine4Blocks` (mlx's 4-bit affine) as Q4_1 blocks (``d`` the scale, ``m``
    the offset, per block of 32) on the compiled kernel. Few rows: the kernel (``q d + m`` in float32). Many rows and
    :meth:`dequantize`: the format's own arithmetic from the blocks, ``scale * q`` then ``+ offset``, each rounded to
    the scales' dtype."""

    def __init__(
        self,
        blocks: torch.Tensor,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        *,
        scale_dtype: torch.dtype,
        **kwargs: Any,
    ) -> None:
        super().__init__(blocks, "Q4_1", out_features, in_features, bias, **kwargs)
        self.scale_dtype = scale_dtype

    def dequantize(self) -> torch.Tensor:
        return self._rows(self.raw_blocks(), self.out_features)

    def _rows(self, raw: torch.Tensor, rows: int) -> torch.Tensor:
        """The exact weight of ``rows`` rows from their Q4_1 blocks ``raw`` (stored layout), in the scales' dtype."""
        raw = raw.reshape(rows, self.in_features // 32, 20)
        d = raw[..., 0:2].contiguous().view(torch.float16).to(self.scale_dtype)
        m = raw[..., 2:4].contiguous().view(torch.float16).to(self.scale_dtype)
        qs = raw[..., 4:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).to(self.scale_dtype)
        return (d * q + m).reshape(rows, self.in_features)

    def exact_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize().to(dtype)

    def exact_rows(self, raw: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        return self._rows(raw, rows).to(dtype)


#: FP4 E2M1 by code (bit 3 the sign): a 4-bit table equal to it, with a power-of-two scale per 32, is MXFP4
_E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: the scale exponents whose every product with an E2M1 value is a finite float32 and bfloat16, held exactly
_MXFP4_EXPONENTS = (-126, 125)


class MXFP4BlockLinear(BlockLinear):
    """A :class:`~anyquant_runtime.layouts.Table4` whose table is FP4 E2M1 and whose scales are powers of two per
    block of 32 (MXFP4, whichever format stores it) as GGML's MXFP4 blocks on the compiled kernel (its int8 table
    values by a byte shuffle, two activation passes: within 1e-4 of the largest output per linear). The weights are
    the layout's, bit for bit (:meth:`dequantize`: its table, signed zero included, times the scale, in ``round_to``);
    the prompt path's GEMM weight comes from the kernel's dequantization (the same values)."""

    table: torch.Tensor

    def __init__(
        self,
        blocks: torch.Tensor,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        *,
        table: torch.Tensor,
        round_to: torch.dtype,
        **kwargs: Any,
    ) -> None:
        super().__init__(blocks, "MXFP4", out_features, in_features, bias, **kwargs)
        self.round_to = round_to
        self.register_buffer("table", table.to(torch.float32).contiguous())

    def dequantize(self) -> torch.Tensor:
        return self._rows(self.raw_blocks(), self.out_features)

    def exact_rows(self, raw: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        return self._rows(raw, rows).to(dtype)

    def _rows(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        """The exact weight of ``n`` rows from their MXFP4 blocks ``raw`` (stored layout), in ``round_to``."""
        k = self.in_features
        raw = raw.reshape(n, k // 32, 17)
        # 2 ** (e - 127) by its bits (the exponents were checked normal when the blocks were made)
        scales = (raw[..., 0].to(torch.int32) << 23).view(torch.float32)
        assert self.round_to is not None
        from . import kernels

        if kernels.lut_available():  # the table kernel's exact weights: GGML's nibble order is its own
            from .kernels.lut import ROUND_CODES

            codes = raw[..., 1:].reshape(n, k // 2)
            w: torch.Tensor = torch.ops.anyquant.lut4_dequant(codes, scales, self.table, 32, ROUND_CODES[self.round_to])
            return w.to(self.round_to)
        qs = raw[..., 1:]
        codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1).to(torch.long)
        w = self.table[codes] * scales.unsqueeze(-1)
        return w.reshape(n, k).to(self.round_to)

    def exact_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:meth:`dequantize` in ``dtype`` (the table kernel's dequantization: ~3x the block kernel's for this type)."""
        return self.dequantize().to(dtype)

    def packed_bytes(self) -> int:
        return sum(b.nbytes for name, b in self._buffers.items() if b is not None and name != "table")


def _mxfp4_blocks(lay: Table4) -> torch.Tensor | None:
    """``lay``'s weights as GGML MXFP4 blocks (uint8 ``[out, in/32, 17]``: the E8M0 exponent, then element ``j`` in
    byte ``j``'s low nibble and ``j + 16`` in its high one), or ``None`` when it is not MXFP4: a table other than
    E2M1, groups other than 32, a scale that is not a power of two in :data:`_MXFP4_EXPONENTS`, or a ``round_to``
    that would round its products (float16)."""
    if lay.group != 32 or lay.round_to not in (torch.float32, torch.bfloat16):
        return None
    table = layout_tensor(lay.table).to(torch.float32).reshape(-1)
    if table.numel() != 16 or not bool((table == torch.tensor(_E2M1_TABLE)).all()):
        return None
    scales = layout_tensor(lay.scales).to(torch.float32)
    mantissa, exponent = torch.frexp(scales)
    exponent = exponent - 1  # scale = 2 ** exponent where mantissa is exactly 0.5
    low, high = _MXFP4_EXPONENTS
    if not bool(((mantissa == 0.5) & (exponent >= low) & (exponent <= high)).all()):
        return None
    n, k = lay.out_features, lay.in_features
    codes = layout_tensor(lay.codes).to(torch.uint8).reshape(n, k // 32, 32)
    blocks = torch.empty(n, k // 32, 17, dtype=torch.uint8)
    blocks[..., 0] = (exponent + 127).to(torch.uint8)
    torch.bitwise_or(codes[..., :16], codes[..., 16:] << 4, out=blocks[..., 1:])
    return blocks


@dataclass(frozen=True)
class _Build:
    """What the engine builds a layout's module with (``None`` in its place: check only). ``interleave`` and
    ``passes``: the GGUF-block kernel's form of stored blocks and its activation passes (:class:`FastCPUPlan`)."""

    small_rows: int
    prefill_dtype: torch.dtype | None
    compute_dtype: torch.dtype
    interleave: bool = True
    passes: int = 2


#: ``build`` of a check from the layout's metadata alone (its tensors neither read nor formed)
_METADATA: Literal["metadata"] = "metadata"
#: what an engine function is asked for: build with these options, check only (``None``), or check the metadata only
_Stage: TypeAlias = _Build | Literal["metadata"] | None


def _int4_unsupported() -> str | None:
    status = int4pack_status()
    return None if status.available else status.reason


def _block_kernel_unsupported(what: str) -> str | None:
    if block_kernel_is_fast():
        return None
    return f"{what} run on the compiled block kernel, which is not built (or not vectorized) here"


def _lut_unsupported() -> str | None:
    from . import kernels

    if kernels.lut_available():
        return None
    return "4-bit table codes run on the compiled 4-bit table kernel, which is not built here"


def _fp8_unsupported() -> str | None:
    from .kernels.lut import fp8_kernel_runs

    if fp8_kernel_runs():
        return None
    return "FP8 weights run on the compiled kernel's fp8_gemv, which has no vector path here (AVX512F)"


def _bf16_unsupported() -> str | None:
    ok, reason = bf16_head_status()
    return None if ok else reason


def _kind_unsupported(kind: type) -> str | None:
    """Why the kernel that runs layouts of ``kind`` is not usable here (``None``: it is), shapes aside."""
    return _kernel(kind)[0]()


def _int4_groups(lay: Int4Groups, build: _Stage) -> nn.Module | str | None:
    """torch's int4 kernel (:class:`FastInt4Linear`; GQ4 blocks on the compiled kernel after :func:`to_block_kernel`)."""
    status = int4pack_status()
    if not status.available or lay.bits != 4:
        return unsupported_reason(lay.bits, lay.in_features, lay.out_features, None, status=status)
    scales = None
    if (lay.g_idx is None or build == _METADATA) and lay.group_size is not None:
        group = lay.group_size if lay.in_features % lay.group_size == 0 else None
    elif build == _METADATA:
        return "no group_size in the layout's metadata (the groups' size is not known before the tensors)"
    else:
        scales = layout_tensor(lay.scales)
        group = contiguous_group_size(lay.g_idx, lay.in_features, scales.shape[0])
    reason = unsupported_reason(4, lay.in_features, lay.out_features, group, status=status)
    if reason is not None or not isinstance(build, _Build):
        return reason
    return FastInt4Linear(
        layout_tensor(lay.codes),
        layout_tensor(lay.zeros),
        layout_tensor(lay.scales) if scales is None else scales,
        lay.g_idx,
        lay.bias,
        compute_dtype=build.compute_dtype,
        small_rows=build.small_rows,
        prefill_dtype=build.prefill_dtype,
    )


def _int8_blocks(lay: Int8Blocks, build: _Stage) -> nn.Module | str | None:
    """Q8_0 blocks of the codes as they are on the compiled kernel (:class:`Int8BlockLinear`)."""
    from .kernels.linear import fp16_exact, q8_0_from_codes

    if (reason := _kind_unsupported(Int8Blocks)) is not None:
        return reason
    if lay.in_features % 32 or lay.group % 32 or lay.in_features % lay.group:
        return f"8-bit groups of {lay.group} in rows of {lay.in_features} (Q8_0 blocks are 32)"
    if build == _METADATA:
        return None
    if lay.q8_0 is not None and lay.group == 32:  # the format's own Q8_0 blocks: float16 scales by construction
        if not isinstance(build, _Build):
            return None
        blocks = layout_tensor(lay.q8_0)
    else:
        scales = layout_tensor(lay.scales)
        if not fp16_exact(scales):
            return "8-bit scales that float16 does not hold exactly (Q8_0 blocks keep float16 scales)"
        if not isinstance(build, _Build):
            return None
        per = lay.group // 32
        d = scales.repeat_interleave(per, dim=1) if per > 1 else scales
        blocks = q8_0_from_codes(layout_tensor(lay.codes), d)
    return Int8BlockLinear(
        blocks,
        lay.out_features,
        lay.in_features,
        lay.bias,
        round_to=lay.round_to,
        small_rows=build.small_rows,
        prefill_dtype=build.prefill_dtype,
        compute_dtype=build.compute_dtype,
        interleave=True,
    )


def _affine4_blocks(lay: Affine4Blocks, build: _Stage) -> nn.Module | str | None:
    """Q4_1 blocks (``d`` the scale, ``m`` the offset) on the compiled kernel (:class:`Affine4BlockLinear`)."""
    from .kernels.linear import fp16_exact, q4_1_from_codes

    if lay.group % 32 or lay.in_features % lay.group:
        return f"4-bit affine groups of {lay.group} in rows of {lay.in_features} (Q4_1 blocks are 32)"
    if (reason := _kind_unsupported(Affine4Blocks)) is not None:
        return reason
    if build == _METADATA:
        return None
    scales, biases = layout_tensor(lay.scales), layout_tensor(lay.biases)
    if scales.dtype not in (torch.bfloat16, torch.float16):
        return f"{scales.dtype} scales"
    if not (fp16_exact(scales) and fp16_exact(biases)):
        return "scales or biases that float16 does not hold exactly"
    if not isinstance(build, _Build):
        return None
    per = lay.group // 32
    blocks = q4_1_from_codes(
        layout_tensor(lay.codes), scales.repeat_interleave(per, dim=1), biases.repeat_interleave(per, dim=1)
    )
    return Affine4BlockLinear(
        blocks,
        lay.out_features,
        lay.in_features,
        lay.bias,
        scale_dtype=scales.dtype,
        small_rows=build.small_rows,
        prefill_dtype=build.prefill_dtype,
        compute_dtype=build.compute_dtype,
        interleave=True,
    )


def _table4(lay: Table4, build: _Stage) -> nn.Module | str | None:
    """The codes kept packed on the compiled 4-bit table kernel (:class:`~anyquant_cpu.kernels.lut.Lut4Linear`);
    MXFP4 (an E2M1 table, power-of-two scales per 32) as GGML MXFP4 blocks on the block kernel where that is fast
    (:class:`MXFP4BlockLinear`: ~2.9x lut4's decode speed on a 2880x2880 layer, one thread; int8 activations)."""
    if (reason := _kind_unsupported(Table4)) is not None:
        return reason
    k, group = lay.in_features, lay.group
    if k % 32 or group < 16 or group % 16 or k % group:
        return f"groups of {group} in rows of {k} (the 4-bit table kernel takes rows of 32s in groups of 16s)"
    if not isinstance(build, _Build):
        return None
    if block_kernel_is_fast() and (blocks := _mxfp4_blocks(lay)) is not None:
        return MXFP4BlockLinear(
            blocks,
            lay.out_features,
            lay.in_features,
            lay.bias,
            table=layout_tensor(lay.table),
            round_to=lay.round_to,
            small_rows=build.small_rows,
            prefill_dtype=build.prefill_dtype,
            compute_dtype=build.compute_dtype,
            interleave=True,
        )
    from .kernels.lut import Lut4Linear

    return Lut4Linear(
        layout_tensor(lay.codes),
        layout_tensor(lay.scales),
        layout_tensor(lay.table),
        group=group,
        round_to=lay.round_to,
        bias=lay.bias,
        small_rows=build.small_rows,
        prefill_dtype=build.prefill_dtype,
        compute_dtype=build.compute_dtype,
    )


def _e4m3_groups(lay: E4M3Groups, build: _Stage) -> nn.Module | str | None:
    """The FP8 bytes as they are on the compiled kernel's ``fp8_gemv`` (:class:`~anyquant_cpu.kernels.lut.E4M3Linear`)."""
    if (reason := _kind_unsupported(E4M3Groups)) is not None:
        return reason
    k, group = lay.in_features, lay.group
    if k % 16 or group < 16 or group % 16 or k % group:
        return f"FP8 scales per {group} inputs in rows of {k} (fp8_gemv takes groups of 16s)"
    if not isinstance(build, _Build):
        return None
    from .kernels.lut import E4M3Linear

    scales = layout_tensor(lay.scales).to(torch.float32)
    if lay.rows > 1:  # the op's groups are per row: each block's scale repeated over its rows
        scales = scales.repeat_interleave(lay.rows, dim=0)[: lay.out_features]
    return E4M3Linear(
        layout_tensor(lay.weight),
        scales.contiguous(),
        group=group,
        round_to=lay.round_to,
        bias=lay.bias,
        small_rows=build.small_rows,
        prefill_dtype=build.prefill_dtype,
        compute_dtype=build.compute_dtype,
    )


def _decoded(lay: Decoded, build: _Stage) -> nn.Module | str | None:
    """A bfloat16 copy prepacked for oneDNN (:class:`PrepackedBf16Linear`)."""
    if (reason := _kind_unsupported(Decoded)) is not None:
        return reason
    if not isinstance(build, _Build):
        return None
    return PrepackedBf16Linear(lay.source, small_rows=build.small_rows if lay.exact_prompts else None)


def _gguf_unsupported() -> str | None:
    from . import kernels

    if kernels.available() or int4pack_status().available:
        return None
    why = int4pack_status().reason
    return f"GGUF blocks run on the compiled GGUF-block kernel, which is not built here, or torch's int4 kernel: {why}"


def _gguf_blocks(lay: GGUFBlocks, build: _Stage) -> nn.Module | str | None:
    """The blocks as stored on the compiled GGUF-block kernel (:class:`GGUFBlockLinear`: read in place, or copied
    into the kernel's interleaved form with the plan's ``interleave``), else Q4_0/Q4_1/Q4_K repacked for torch's int4
    kernel (:class:`GGUFInt4Linear`). Permuted Q/K rows are read back in the model's order by the interleaving copy
    (heads of 16s rows), else un-permuted first (a copy)."""
    from .kernels import GGML_TYPES

    n, k = lay.out_features, lay.in_features
    if _gguf_on_kernel(lay):
        weights = GGML_TYPES[lay.type_name][2]
        if k % weights:
            return f"{lay.type_name} rows of {k} weights (its blocks hold {weights})"
        if not isinstance(build, _Build):
            return None
        blocks, heads = layout_tensor(lay.blocks), lay.qk_heads or 0
        if heads and not (build.interleave and n // heads % 16 == 0):  # the interleaving copy reads 16-row heads
            blocks, heads = _unpermute_qk_rows(blocks, n, heads), 0
        return GGUFBlockLinear(
            blocks,
            lay.type_name,
            n,
            k,
            lay.bias,
            small_rows=build.small_rows,
            prefill_dtype=build.prefill_dtype,
            compute_dtype=build.compute_dtype,
            passes=build.passes,
            interleave=build.interleave,
            qk_heads=heads,
        )
    if lay.type_name not in _GGML_INT4:
        return f"{lay.type_name} has no int4 kernel"
    reason = unsupported_reason(4, k, n, 32)
    if reason is not None:
        return f"FastInt4Linear cannot run this layer: {reason}"
    if not isinstance(build, _Build):
        return None
    blocks = layout_tensor(lay.blocks)
    if lay.qk_heads:
        blocks = _unpermute_qk_rows(blocks, n, lay.qk_heads)
    return GGUFInt4Linear(
        blocks,
        lay.type_name,
        n,
        k,
        lay.bias,
        small_rows=build.small_rows,
        prefill_dtype=build.prefill_dtype,
        compute_dtype=build.compute_dtype,
    )


#: each layout kind: why its kernel does not run here (``None``: it does), and the builder of its fast module
_KERNELS: dict[type, tuple[Callable[[], str | None], Callable[[Any, _Stage], nn.Module | str | None]]] = {
    Int4Groups: (_int4_unsupported, _int4_groups),
    Int8Blocks: (lambda: _block_kernel_unsupported("8-bit weights"), _int8_blocks),
    Affine4Blocks: (lambda: _block_kernel_unsupported("4-bit affine groups"), _affine4_blocks),
    Table4: (_lut_unsupported, _table4),
    E4M3Groups: (_fp8_unsupported, _e4m3_groups),
    GGUFBlocks: (_gguf_unsupported, _gguf_blocks),
    Decoded: (_bf16_unsupported, _decoded),
}


def _kernel(kind: type) -> tuple[Callable[[], str | None], Callable[[Any, _Stage], nn.Module | str | None]]:
    for cls in kind.__mro__:
        if cls in _KERNELS:
            return _KERNELS[cls]
    raise TypeError(f"{kind.__name__} is not a packed layout of anyquant_runtime.layouts")


def _engine(layout: Layout, build: _Stage) -> nn.Module | str | None:
    return _kernel(type(layout))[1](layout, build)


def layout_unsupported(layout: Layout, *, metadata_only: bool = False) -> str | None:
    """Why the CPU engine cannot run ``layout`` here (``None`` when it can): the kernel it needs is not built or not
    vectorized, or its shapes, groups or scales are not ones that kernel takes.

    ``metadata_only``: decide from the layout's metadata alone (its shapes, group, bits; the checks that need no
    tensor): its tensor fields are never read or formed, and may be ``None`` (a loader's description of a layer
    from the headers, :func:`layouts_run`). What only the tensors tell (scales float16 holds exactly, a ``g_idx``'s
    groups) is checked when the layer is converted."""
    out = _engine(layout, _METADATA if metadata_only else None)
    return out if isinstance(out, str) else None


def layouts_run(layers: Iterable[Sequence[Layout] | str]) -> int:
    """How many of ``layers`` the CPU engine takes here, decided before any tensor is read: each item is one layer's
    packed layouts as its format offers them (:meth:`~anyquant_runtime.qlinear.QuantLinearBase.packed_layouts`'s
    order), described from the checkpoint's headers (tensor fields ``None``), or why it offers none; a layer counts
    when one of its layouts runs (:func:`layout_unsupported` with ``metadata_only``). A loader's ``auto`` passes
    cpu-fast by where this is 0."""
    return sum(
        1
        for offered in layers
        if not isinstance(offered, str) and any(layout_unsupported(lay, metadata_only=True) is None for lay in offered)
    )


def layout_kinds_run(*kinds: type[Layout]) -> tuple[bool, str]:
    """(usable, reason): the kernel of one of these layout kinds (:mod:`anyquant_runtime.layouts`' classes) is built
    and runs here, shapes aside: a format's cpu-fast is available where the layouts its layers offer can run. The
    reason: each kind's, joined."""
    reasons: list[str] = []
    for kind in kinds:
        reason = _kind_unsupported(kind)
        if reason is None:
            return True, ""
        reasons.append(reason)
    return False, "; ".join(dict.fromkeys(reasons)) or "no packed layout kind given"


def fast_linear(
    layout: Layout,
    *,
    small_rows: int = DEFAULT_SMALL_ROWS,
    prefill_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype = torch.float32,
    interleave: bool = True,
    passes: int = 2,
) -> nn.Module | str:
    """The CPU engine's module for ``layout`` (the weight as its layout's kernel reads it; decode up to ``small_rows``
    rows on the kernel, longer prompts through the exact weight and a GEMM in ``prefill_dtype``; bias and outputs in
    ``compute_dtype``), or why it cannot run here (:func:`layout_unsupported`). ``interleave``, ``passes``: GGUF
    blocks' form on the GGUF-block kernel and its activation passes (:class:`FastCPUPlan`)."""
    out = _engine(layout, _Build(small_rows, prefill_dtype, compute_dtype, interleave, passes))
    assert out is not None
    return out


def fast_cpu_module(
    layer: _Convertible,
    *,
    small_rows: int = DEFAULT_SMALL_ROWS,
    prefill_dtype: torch.dtype | None = None,
    interleave: bool = True,
    passes: int = 2,
    rounded: bool = True,
) -> nn.Module | str:
    """``layer``'s first offered layout (:meth:`~anyquant_runtime.qlinear.QuantLinearBase.packed_layouts`) that runs
    here, as :func:`fast_linear` builds it behind the layer's input quantization (``layer.behind_inputs``); or why
    none runs: the layer's own reason, or each offered layout's, joined. ``rounded=False``: a layout that is a second
    rounding of the format's weight (:attr:`~anyquant_runtime.layouts.Int8Blocks.rounded`) is passed by."""
    offered = layer.packed_layouts()
    if isinstance(offered, str):
        return offered
    if not rounded:
        offered = [lay for lay in offered if not getattr(lay, "rounded", False)]
    reasons: list[str] = []
    for layout in offered:
        fast = fast_linear(
            layout,
            small_rows=small_rows,
            prefill_dtype=prefill_dtype,
            compute_dtype=layer.compute_dtype,
            interleave=interleave,
            passes=passes,
        )
        if not isinstance(fast, str):
            return layer.behind_inputs(fast)
        reasons.append(fast)
    return "; ".join(dict.fromkeys(reasons)) or f"{type(layer).__name__} offers no packed layout"


def fast_cpu_reasons(layer: _Convertible) -> str | None:
    """Why :func:`fast_cpu_module` cannot run ``layer`` here (``None`` when it can), without building anything."""
    offered = layer.packed_layouts()
    if isinstance(offered, str):
        return offered
    reasons: list[str] = []
    for layout in offered:
        reason = layout_unsupported(layout)
        if reason is None:
            return None
        reasons.append(reason)
    return "; ".join(dict.fromkeys(reasons)) or f"{type(layer).__name__} offers no packed layout"


def module_form(module: nn.Module) -> str:
    """How a converted module holds its weight, for a load's record: ``"Q8_0 blocks"`` (a block-kernel module's GGML
    type), ``"bfloat16 prepacked"``, else its class's name."""
    type_name = getattr(module, "type_name", None)
    if isinstance(type_name, str):
        return f"{type_name} blocks"
    if isinstance(module, PrepackedBf16Linear):
        return "bfloat16 prepacked"
    return type(module).__name__


class _Convertible(Protocol):
    mode: str
    compute_dtype: torch.dtype

    def packed_layouts(self) -> Sequence[Layout] | str: ...

    def behind_inputs(self, fast: nn.Module) -> nn.Module: ...

    def finalize(self) -> Any: ...


_PREFILL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: the dtypes the native decoder's KV cache may hold on cpu-fast, by the name load option ``cpu_fast_kv_cache`` takes
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_cache_dtype(extra: Mapping[str, Any], compute_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of the ``cpu-fast`` native decoder's KV cache: load option ``cpu_fast_kv_cache``
    (``"float16"``, ``"bfloat16"`` or ``"float32"``); by default ``None``, the activations' own dtype. float16
    halves the cache (10 mantissa bits, as llama.cpp's default f16 cache) but every decode step reads the
    history back to float32, which costs 14-18 % of decode speed at 1,000-4,000 tokens of context, so it is
    not the default: an 8,000-token prompt stays within 1.5x of llama.cpp's peak memory without it."""
    given = extra.get("cpu_fast_kv_cache")
    if given is None:
        return None
    if given not in KV_CACHE_DTYPES:
        raise ParameterError(f"cpu_fast_kv_cache={given!r} is not one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[given]


@dataclass
class FastCPUPlan:
    """What a loader's ``cpu-fast`` backend does with each quantized layer, and the record of it.

    Load options (``anyquant.load(..., cpu_fast_prefill="bfloat16", cpu_fast_small_rows=8)``):
    ``cpu_fast_prefill`` is the GEMM dtype of the many-rows path (default ``"auto"``: bfloat16 where
    :func:`bf16_gemm_is_fast`, else the compute dtype; ``"float32"``: the exact weights in float32, prompts' logits
    within 1e-5 of the reference's; ``None``: the compute dtype), ``cpu_fast_small_rows`` the row count up
    to which the int4 kernel (and the fast head) runs, ``cpu_fast_head`` ``"auto"`` (default: a :class:`FastHead`
    decoding through Q8_0 blocks on the compiled kernel where it is built, else through a bfloat16 copy where
    :func:`bf16_head_status` allows), ``"q8_0"``, ``"bfloat16"`` (that form only) or ``"dense"`` (the exact float
    head),
    ``cpu_fast_tables`` ``"file"`` (default: the fast head's exact table and the input embedding stay in
    the safetensors file, read a few rows or a slice at a time) or ``"memory"`` (read at load),
    ``cpu_fast_kernel`` ``"auto"`` (default: ``"gq4"`` where :func:`block_kernel_is_fast`, else ``"torch"``),
    ``"gq4"`` (:func:`to_block_kernel` where the compiled kernel is built) or ``"torch"`` (torch's int4 kernel
    for every 4-bit layer),
    ``cpu_fast_interleave`` ``True`` (default: weights on the compiled block kernel copied once at load into its
    interleaved form, the file's pages released) or ``False`` (GGUF blocks read in place from the file),
    ``cpu_fast_activation_passes`` the int8 passes over the activations of the GGUF-block kernel on GGUF blocks (2,
    or 1: llama.cpp's int8 arithmetic), ``cpu_fast_weights`` the form of a layout its format offers as a second
    rounding of its weight (:attr:`~anyquant_runtime.layouts.Int8Blocks.rounded`): ``"auto"`` (taken where its kernel
    runs), ``"q8_0"`` (asked for: refused where the block kernel does not run) or ``"bfloat16"`` (never taken), and
    ``cpu_fast_kv_cache`` the native decoder's KV cache dtype (:func:`kv_cache_dtype`). The options' declarations:
    :mod:`anyquant_cpu.options`.
    """

    small_rows: int = DEFAULT_SMALL_ROWS
    #: whether ``cpu_fast_small_rows`` was given (then it holds for a mixture's experts too)
    rows_given: bool = False
    prefill_dtype: torch.dtype | None = None
    head_kind: str = "auto"
    tables: str = "file"
    block_kernel: bool = False
    interleave: bool = True
    passes: int = 2
    weights: str = "auto"
    kv_cache: torch.dtype | None = None
    converted: int = 0
    #: each converted module (weakly: one a later step replaces, as the GQ4 repacking does, leaves the record) and its
    #: form (:func:`module_form`), by ``id``, for the record
    forms: dict[int, tuple[weakref.ref[nn.Module], str]] = field(default_factory=dict)
    fallback: dict[str, str] = field(default_factory=dict)
    head_info: dict[str, Any] = field(default_factory=dict)
    block_info: dict[str, Any] = field(default_factory=dict)
    norms: int = 0
    attention: int = 0  # attention layers on the decode kernel (kernel_attention)

    @property
    def prefill_name(self) -> str:
        """The prompt GEMM's dtype as the load's record names it (``"compute dtype"`` where none is set)."""
        return str(self.prefill_dtype).replace("torch.", "") if self.prefill_dtype else "compute dtype"

    @classmethod
    def from_options(cls, extra: Mapping[str, Any]) -> FastCPUPlan:
        prefill = extra.get("cpu_fast_prefill", "auto")
        if prefill == "auto":
            prefill = "bfloat16" if bf16_gemm_is_fast() else None
        if prefill is not None and prefill not in _PREFILL_DTYPES:
            raise ParameterError(f"cpu_fast_prefill={prefill!r} is not one of {sorted(_PREFILL_DTYPES)} or 'auto'")
        given = extra.get("cpu_fast_small_rows", DEFAULT_SMALL_ROWS)
        try:
            rows = int(given)  # an int, or its text (options given on a command line)
        except (TypeError, ValueError):
            rows = 0
        if isinstance(given, (bool, float)) or rows < 1:
            raise ParameterError(f"cpu_fast_small_rows={given!r} is not a positive integer")
        head = extra.get("cpu_fast_head", "auto")
        if head not in HEAD_KINDS:
            raise ParameterError(f"cpu_fast_head={head!r} is not one of {', '.join(map(repr, HEAD_KINDS))}")
        tables = extra.get("cpu_fast_tables", "file")
        if tables not in ("file", "memory"):
            raise ParameterError(f"cpu_fast_tables={tables!r} is not 'file' or 'memory'")
        kernel = extra.get("cpu_fast_kernel", "auto")
        if kernel not in ("auto", "torch", "gq4"):
            raise ParameterError(f"cpu_fast_kernel={kernel!r} is not 'auto', 'torch' or 'gq4'")
        if kernel == "auto":
            kernel = "gq4" if block_kernel_is_fast() else "torch"
        interleave = extra.get("cpu_fast_interleave", True)
        if interleave not in (True, False, "true", "false"):
            raise ParameterError(f"cpu_fast_interleave={interleave!r} is not True or False")
        passes = extra.get("cpu_fast_activation_passes", 2)
        if passes not in (1, 2, "1", "2") or isinstance(passes, bool):
            raise ParameterError(f"cpu_fast_activation_passes={passes!r} is not 1 or 2")
        weights = extra.get("cpu_fast_weights", "auto")
        if weights not in ROUNDED_WEIGHTS:
            raise ParameterError(f"cpu_fast_weights={weights!r} is not one of {', '.join(map(repr, ROUNDED_WEIGHTS))}")
        if weights == "q8_0" and not block_kernel_is_fast():
            raise ParameterError(
                "cpu_fast_weights='q8_0' runs on the compiled block kernel, which is not built (or not vectorized) "
                "here (python -m anyquant_cpu.kernels says why); 'auto' or 'bfloat16' hold the weights in bfloat16"
            )
        return cls(
            small_rows=rows,
            rows_given="cpu_fast_small_rows" in extra,
            prefill_dtype=None if prefill is None else _PREFILL_DTYPES[prefill],
            head_kind=head,
            tables=tables,
            block_kernel=kernel == "gq4",
            interleave=interleave in (True, "true"),
            passes=int(passes),
            weights=str(weights),
            kv_cache=kv_cache_dtype(extra, torch.float32),
        )

    def kv_cache_dtype(self, compute_dtype: torch.dtype) -> torch.dtype | None:
        """The native decoder's KV cache dtype (``None``: ``compute_dtype``, the activations' own)."""
        return self.kv_cache

    @property
    def head(self) -> bool:
        """Whether :meth:`finish` installs a fast head (``cpu_fast_head`` is not ``"dense"``)."""
        return self.head_kind != "dense"

    def file_tables(self) -> bool:
        """Whether the build may leave the embedding and a dense head in the checkpoint file for
        :meth:`finish` (option ``cpu_fast_tables``: ``"file"``, the default, or ``"memory"``)."""
        return self.tables == "file" and self.keeps_embedding_dtype()

    def keeps_embedding_dtype(self) -> bool:
        """Whether the build may keep the input embedding in its 16-bit checkpoint dtype: :meth:`finish`
        replaces it (or casts it to the compute dtype when the head stays dense)."""
        return self.head and head_kind(self.head_kind)[0] is not None

    def finish(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        tables: Mapping[str, FileRows] | None = None,
    ) -> None:
        """After the build: the int4 linears on the compiled block kernel where it is built and asked for
        (:func:`to_block_kernel`), and the LM head (and a tied embedding) as in :func:`install_fast_head`.

        Only when some layer runs the int4 kernel: a model whose layers all fell back to exact
        dequantized weights keeps its exact head too. ``compute_dtype``: the model's (an embedding kept
        16-bit by the build is cast to it when no fast head takes it over). ``tables``: what the build
        left in the file (:meth:`file_tables`); read into memory here when no fast head takes it."""
        from anyquant.plugin import release_free_heap

        release_free_heap()  # the tokenizer's parse left freed memory in the heap: not under the head's peak
        self.block_info = to_block_kernel(module, self.interleave) if self.block_kernel else {}
        # the decode path's norms too, where some layer decodes on a fast kernel (else the model stays exact)
        self.norms = kernel_norms(module, self.small_rows) if self.converted else 0
        self.attention = kernel_attention(module) if self.converted else 0
        if self.head and self.converted == 0:
            self.head_info = {"head": "dense", "reason": "no layer runs the int4 kernel: the model stays exact"}
        elif self.head:
            self.head_info = install_fast_head(
                module,
                small_rows=self.small_rows,
                compute_dtype=compute_dtype,
                tables=tables,
                kind=self.head_kind,
                interleave=self.interleave,
            )
        else:
            self.head_info = {"head": "dense", "reason": "cpu_fast_head='dense'"}
        if tables:
            _embedding_in_file(module, tables, compute_dtype or torch.float32)
            fill_file_tables(module, tables, compute_dtype)
        if self.head_info.get("head") == "dense" and compute_dtype is not None:
            _restore_embedding_dtype(module, compute_dtype)
        head = getattr(module, "get_output_embeddings", None)
        quantized_head = None if head is None else self._form_of(head())
        if quantized_head is not None:  # built as the linears are (its format quantizes it)
            self.head_info = {"head": f"{quantized_head} (a quantized head)"}

    def _form_of(self, module: object) -> str | None:
        """The form :meth:`convert` built ``module`` in (``None``: not one it built, or no longer in the model)."""
        entry = self.forms.get(id(module))
        return entry[1] if entry is not None and entry[0]() is module else None

    def convert(
        self, name: str, layer: _Convertible, *, small_rows: int | None = None, expert: bool = False
    ) -> nn.Module:
        """``layer`` (built in ``reference`` mode) as the module of the first packed layout it offers that runs here
        (:func:`fast_cpu_module`), or dequantized (its exact path) with the reasons recorded when none runs.
        ``small_rows``: this layer's rows up to which the decode kernel runs, where the caller knows better than the
        plan's default; ``expert``: the layer is one of a mixture's experts (a prompt's tokens spread over them, a few
        each: :func:`expert_small_rows` unless ``cpu_fast_small_rows`` was given)."""
        if small_rows is None and expert and not self.rows_given:
            small_rows = expert_small_rows(self.prefill_dtype, layer.compute_dtype)
        rows = self.small_rows if small_rows is None else small_rows
        fast = fast_cpu_module(
            layer,
            small_rows=rows,
            prefill_dtype=self.prefill_dtype,
            interleave=self.interleave,
            passes=self.passes,
            rounded=self.weights != "bfloat16",
        )
        if not isinstance(fast, str):
            self.converted += 1
            self.forms[id(fast)] = (weakref.ref(fast), module_form(fast))
            return fast
        self.fallback[name] = fast
        layer.mode = "dequantized"
        out: nn.Module = layer.finalize()
        return out

    def table_head(self, table: RowTable, blocks: GGUFBlocks | None = None) -> tuple[nn.Module, bool] | None:
        """The LM head over a table its format keeps packed (``table``: its exact rows, read a slice at a time;
        ``blocks``: the table's own GGUF blocks), for a format that installs its head itself: ``(head, False)``, the
        blocks on the GGUF-block kernel where it reads them (:class:`GGUFBlockHead`: no copy of another type); else
        ``(head, True)``, a :class:`FastHead` decoding from a copy as :attr:`head_kind` asks; ``None`` where neither
        runs here. Both compute the top logits of each row again exactly."""
        if blocks is not None and _gguf_on_kernel(blocks):
            if hasattr(table, "decode_rows"):  # the exact rows (top logits, prompts) decoded by the kernel too
                cast(Any, table).decode_rows = _kernel_rows(blocks.type_name, int(table.shape[1]))
            head = GGUFBlockHead(
                table,
                layout_tensor(blocks.blocks),
                blocks.type_name,
                small_rows=self.small_rows,
                interleave=self.interleave,
            )
            return head, False
        decode = head_kind(self.head_kind, int(table.shape[1]))[0]
        if decode is None:
            return None
        return FastHead(table, small_rows=self.small_rows, decode=decode, interleave=self.interleave), True

    def install_embedding_rows(self, module: nn.Module) -> str | None:
        """An input embedding that keeps its table packed and offers it as layouts (``packed_layouts()``, with a
        ``decode_rows`` slot: GGUF's) decodes its looked-up rows with the compiled kernel's ``ggml_dequantize`` where
        it reads the first layout as stored (one call a lookup instead of the format's torch ops; bit for bit); returns
        the table's type, or ``None`` where nothing changed."""
        get_in = getattr(module, "get_input_embeddings", None)
        emb = get_in() if get_in is not None else None
        offered = getattr(emb, "packed_layouts", None)
        if emb is None or offered is None or not hasattr(emb, "decode_rows"):
            return None
        lay = next(iter(offered()), None)
        if not isinstance(lay, GGUFBlocks) or not _gguf_on_kernel(lay):
            return None
        emb.decode_rows = _kernel_rows(lay.type_name, lay.in_features)
        return lay.type_name

    def install_norms(self, module: nn.Module) -> int:
        """The decode path's RMSNorms on the compiled kernel up to :attr:`small_rows` tokens (:func:`kernel_norms`),
        for a format that finishes its model itself; returns (and records) how many."""
        self.norms = kernel_norms(module, self.small_rows)
        self.attention = kernel_attention(module)
        return self.norms

    def summary(self) -> dict[str, Any]:
        """For ``LoadedModel.info["cpu_fast"]``; logs the fallbacks once."""
        if self.fallback:
            reasons = sorted(set(self.fallback.values()))
            log.warning(
                "cpu-fast: %d of %d quantized layers run dequantized instead (%s)",
                len(self.fallback),
                len(self.fallback) + self.converted,
                "; ".join(reasons),
            )
        counts = Counter(form for ref, form in self.forms.values() if ref() is not None)
        # the one form, or each with its count
        linears = next(iter(counts)) if len(counts) == 1 else ", ".join(f"{f} x{n}" for f, n in counts.most_common())
        return {
            "fast_layers": self.converted,
            **({"linears": linears} if counts else {}),
            "weights": self.weights,
            "dequantized_layers": dict(self.fallback),
            "small_rows": self.small_rows,
            "prefill_dtype": self.prefill_name,
            "int4_layout_block": int4pack_status().block_n,
            **({"block_kernel": self.block_info} if self.block_info else {}),
            **({"kernel_norms": self.norms} if self.norms else {}),
            **({"kernel_attention": self.attention} if self.attention else {}),
            **({"lm_head": self.head_info} if self.head_info else {}),
        }
