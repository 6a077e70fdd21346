"""Pure-torch EXL3 linear-layer decoder (format doc §3.1, §3.7).

Stages, each exposed for testing:

1. :func:`decode_states` - trellis bitstream -> 16-bit states per tile.
2. :func:`decode_what` - states -> codebook values -> ``Ŵ`` ``[k_pad, n_pad]`` (exllamav3 ``[in, out]`` layout),
   equal to exllamav3's ``ext.reconstruct``: fp16, rounded once from the exact fp32 codebook value.
3. :func:`decode_exl3` - ``W = diag(suh) · H · Ŵ · H · diag(svh)``, trimmed to the unpadded dims, returned in
   ``nn.Linear`` orientation ``[out_features, in_features]``.

Everything is processed in chunks of 128-row blocks of the padded input dimension (the left Hadamard mixes rows
inside one 128-block only), so the transient memory stays a fraction of the output.
"""

from __future__ import annotations

from typing import Literal

import torch

from .codebook import codebook_lut, normalize_codebook
from .hadamard import HAD_DIM, had_left, had_right
from .trellis import TILE, bits_per_weight, states_matrix, unpack_states

Steps = Literal["fp32", "library"]
Layout = Literal["linear", "exl3"]

#: Target transient bytes per chunk when ``chunk_rows`` is not given.
CHUNK_BYTES = 16 << 20
#: Rough transient bytes per weight inside a chunk (int64 gather index and states, fp32 transforms).
_BYTES_PER_WEIGHT = 40


def _check_trellis(trellis: torch.Tensor) -> None:
    if trellis.dim() != 3:
        raise ValueError(f"EXL3 linear trellis must be 3-D [k/16, n/16, 16K], got shape {tuple(trellis.shape)}")
    if trellis.dtype != torch.int16:
        raise TypeError(f"trellis must be int16, got {trellis.dtype}")
    bits_per_weight(trellis)


def _chunk_rows(chunk_rows: int | None, k_pad: int, n_pad: int) -> int:
    """Rows per chunk: a positive multiple of 128 (the Hadamard block)."""
    if chunk_rows is None:
        chunk_rows = CHUNK_BYTES // max(1, n_pad * _BYTES_PER_WEIGHT)
    rows = max(HAD_DIM, (int(chunk_rows) // HAD_DIM) * HAD_DIM)
    return min(rows, max(k_pad, HAD_DIM))


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Legacy ``su``/``sv``: int16 ``[m/16]`` sign bitfields -> fp16 ±1 ``[m]``.

    Bit ``i`` of word ``w`` is element ``16·w + i``; a set bit means -1 (exllamav3 ``pack_signs`` / ``unpack_bf``).
    """
    words = packed.reshape(-1).to(torch.int64) & 0xFFFF
    bits = (words[:, None] >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bits).reshape(-1).to(torch.float16)


def decode_states(trellis: torch.Tensor, *, order: Literal["stream", "row_major"] = "stream") -> torch.Tensor:
    """16-bit trellis states of every tile, int32 ``[k/16, n/16, 256]`` (values 0..65535).

    ``order="stream"`` is encoding (tensor-core) order, as exllamav3's ``unpack_trellis`` and GPTQModel's
    ``_unpack_indices`` return them; ``"row_major"`` gives tile position ``16·r + c``.
    """
    _check_trellis(trellis)
    return unpack_states(trellis, order=order)


def _what_chunk(trellis_rows: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Ŵ rows for a slice of tile rows: ``[16·tk, 16·tn]`` in the LUT's dtype."""
    return torch.take(lut, states_matrix(trellis_rows))


def decode_what(
    trellis: torch.Tensor,
    *,
    codebook: str,
    multiplier: int | None = None,
    codebook_fp16: bool = True,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``Ŵ`` ``[k_pad, n_pad]`` in exllamav3 ``[in, out]`` layout (the rotated basis, before Hadamards and scales).

    fp16 rounded like the CUDA kernels by default; ``codebook_fp16=False`` gives the exact fp32 codebook values
    (GPTQModel's ``get_inner_weight_tensor``).
    """
    _check_trellis(trellis)
    lut = codebook_lut(normalize_codebook(codebook), multiplier=multiplier, fp16=codebook_fp16).to(trellis.device)
    tk, tn = trellis.shape[0], trellis.shape[1]
    out = torch.empty((tk * TILE, tn * TILE), dtype=lut.dtype, device=trellis.device)
    step = max(1, _chunk_rows(chunk_rows, tk * TILE, tn * TILE) // TILE)
    for t0 in range(0, tk, step):
        out[t0 * TILE : (t0 + step) * TILE] = _what_chunk(trellis[t0 : t0 + step], lut)
    return out


def _check_dims(k_pad: int, n_pad: int, in_features: int | None, out_features: int | None) -> tuple[int, int]:
    """Validated unpadded (in, out) dims; the padded ones must be multiples of the Hadamard size."""
    if k_pad % HAD_DIM or n_pad % HAD_DIM:
        raise ValueError(f"padded dims {k_pad}x{n_pad} must be multiples of {HAD_DIM}")
    n_in = k_pad if in_features is None else int(in_features)
    n_out = n_pad if out_features is None else int(out_features)
    if not (0 < n_in <= k_pad and 0 < n_out <= n_pad):
        raise ValueError(f"unpadded dims {n_in}x{n_out} do not fit the padded trellis dims {k_pad}x{n_pad}")
    return n_in, n_out


def _scales(scale: torch.Tensor | None, signs: torch.Tensor | None, size: int, name: str) -> torch.Tensor:
    """The fp16 (or given dtype) scale vector of one side: ``suh``/``svh``, else unpacked legacy ``su``/``sv``."""
    if scale is None:
        if signs is None:
            raise ValueError(f"either {name}h or the legacy packed {name} is required")
        scale = unpack_signs(signs)
    scale = scale.reshape(-1)
    if scale.numel() != size:
        raise ValueError(f"{name} scale has {scale.numel()} elements, expected the padded size {size}")
    return scale


def _transform_fp32(what: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """§3.7 step 6 in fp32: ``(H·Ŵ)`` rows x suh, then ``·H``, columns x svh."""
    x = had_left(what.to(torch.float32))
    x.mul_(suh.to(torch.float32)[:, None])
    x = had_right(x)
    x.mul_(svh.to(torch.float32)[None, :])
    return x


def _round_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(torch.float32)


def _transform_library(what: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """``LinearEXL3.get_weight_tensor``: each step's fp32 result rounded back to fp16 (``preapply_had_l/r``)."""
    x = _round_like(had_left(what.to(torch.float32)), torch.float16)
    x = _round_like(x * suh.to(torch.float16).to(torch.float32)[:, None], torch.float16)
    x = _round_like(had_right(x), torch.float16)
    return _round_like(x * svh.to(torch.float16).to(torch.float32)[None, :], torch.float16)


def decode_exl3(
    trellis: torch.Tensor,
    suh: torch.Tensor | None,
    svh: torch.Tensor | None,
    *,
    codebook: str,
    su: torch.Tensor | None = None,
    sv: torch.Tensor | None = None,
    in_features: int | None = None,
    out_features: int | None = None,
    chunk_rows: int | None = None,
    multiplier: int | None = None,
    codebook_fp16: bool = True,
    steps: Steps = "fp32",
    dtype: torch.dtype = torch.float16,
    layout: Layout = "linear",
) -> torch.Tensor:
    """Dequantize one EXL3 linear layer.

    Args:
        trellis: int16 ``[k_pad/16, n_pad/16, 16·K]`` (K in 1..8 or 1.5/2.5/3.5).
        suh, svh: fp16 input/output sign-and-scale vectors ``[k_pad]`` / ``[n_pad]``; ``None`` to use the legacy
            packed ``su``/``sv`` sign bitfields instead (``suh``/``svh`` win when both are given, as in exllamav3).
        codebook: ``"3inst"`` (no marker), ``"mcg"`` or ``"mul1"``.
        in_features, out_features: unpadded dims to trim to (default: the padded dims).
        chunk_rows: padded input rows per chunk (rounded down to a multiple of 128; default from ``CHUNK_BYTES``).
        multiplier: codebook multiplier override (legacy v0.0.4-v0.0.8 checkpoints), see ``codebook_from_markers``.
        codebook_fp16: round codebook values to fp16 as the CUDA kernels do (default), or keep exact fp32.
        steps: ``"fp32"``: Hadamards and scales in fp32, one final rounding (§3.7); ``"library"``: round to fp16
            after each step like exllamav3's ``LinearEXL3.get_weight_tensor``.
        dtype: output dtype (fp16 by default; fp32 keeps the unrounded fp32 result in ``steps="fp32"``).
        layout: ``"linear"`` -> ``[out_features, in_features]`` (``nn.Linear.weight``); ``"exl3"`` -> ``[in, out]``.
    """
    _check_trellis(trellis)
    k_pad, n_pad = trellis.shape[0] * TILE, trellis.shape[1] * TILE
    n_in, n_out = _check_dims(k_pad, n_pad, in_features, out_features)
    if steps not in ("fp32", "library"):
        raise ValueError(f"steps must be 'fp32' or 'library', got {steps!r}")
    if layout not in ("linear", "exl3"):
        raise ValueError(f"layout must be 'linear' or 'exl3', got {layout!r}")
    row_scale = _scales(suh, su, k_pad, "su").to(trellis.device)
    col_scale = _scales(svh, sv, n_pad, "sv").to(trellis.device)
    # fp32 table of the (fp16-rounded by default) codebook values: the transforms run in fp32 anyway
    lut = codebook_lut(normalize_codebook(codebook), multiplier=multiplier, fp16=codebook_fp16)
    lut = lut.to(trellis.device, torch.float32)
    transform = _transform_fp32 if steps == "fp32" else _transform_library

    out = torch.empty((n_out, n_in) if layout == "linear" else (n_in, n_out), dtype=dtype, device=trellis.device)
    rows = _chunk_rows(chunk_rows, k_pad, n_pad)
    for r0 in range(0, n_in, rows):
        r1 = min(r0 + rows, k_pad)
        what = _what_chunk(trellis[r0 // TILE : r1 // TILE], lut)
        w = transform(what, row_scale[r0:r1], col_scale)[: min(r1, n_in) - r0, :n_out]
        if layout == "linear":
            out[:, r0 : r0 + w.shape[0]] = w.t()
        else:
            out[r0 : r0 + w.shape[0]] = w
    return out
