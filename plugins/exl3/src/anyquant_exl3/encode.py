"""CPU EXL3 encoder: regularization, tail-biting Viterbi per 16x16 tile, trellis packing (format doc §3.6).

This follows exllamav3's ``regularize``, ``quantize_tiles`` and (given a Hessian) ``ldlq``: the weight is turned
into a Gaussian-like matrix by random signs, channel scales and block Hadamards, then every tile is encoded by
an exact Viterbi search over all 65536 trellis states, vectorized over tiles; with the layer's input Hessian the
16-row strips are encoded last to first with LDLQ error feedback. It is a reference and test tool:
on CPU it encodes a few thousand weights per second, fine for small layers, far too slow for whole models.

Tail-biting is handled as in ``quantize_tiles_kernel.cuh``: a first unconstrained pass over the ring rolled by
half a tile finds the state entering position 0; a second pass starts from that state's overlap bits and must
end on them, so the packed ring decodes back to exactly the chosen states.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from .codebook import CODEBOOK_SCALE_3INST, LOCKED_MULTIPLIERS, codebook_lut, normalize_codebook
from .hadamard import HAD_DIM, had_left, had_right
from .trellis import TILE_NUMEL, matrix_to_tiles, pack_states, step_bits, tensor_core_perm, tiles_to_matrix

#: Transient memory budget (bytes) for one Viterbi batch: every step's prior costs plus the cost arrays.
VITERBI_BYTES = 256 << 20
#: Default tiles per Viterbi batch (small batches keep the 256 KiB-per-tile cost arrays in cache).
DEFAULT_BATCH = 8
_STATES = 1 << 16


# ----------------------------------------------------------------------------------------------------------------
# Viterbi


@contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count (``None``: leave it alone).

    The Viterbi loop runs thousands of ~100 µs ops; intra-op threading gains little there and collapses on an
    oversubscribed CPU, so the encoder defaults to one thread. The setting is process-wide while it lasts.
    """
    if num_threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, int(num_threads)))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _batch_tiles(k_bits: float, batch_tiles: int | None) -> int:
    if batch_tiles is not None:
        return max(1, int(batch_tiles))
    per_tile = 4 * sum(_STATES >> d for d in step_bits(k_bits)) + 2 * 4 * _STATES
    return int(min(DEFAULT_BATCH, max(1, VITERBI_BYTES // per_tile)))


class _Buffers:
    """Preallocated Viterbi storage for a batch of ``tiles``: two cost arrays and every step's prior."""

    def __init__(self, tiles: int, steps: Sequence[int], device: torch.device) -> None:
        self.cost = torch.empty((2, tiles, _STATES), dtype=torch.float32, device=device)
        self.scratch = torch.empty(tiles * (_STATES >> min(steps)), dtype=torch.float32, device=device)
        sizes = [_STATES >> d for d in steps]
        flat = torch.empty(tiles * sum(sizes), dtype=torch.float32, device=device)
        self.priors: list[torch.Tensor] = []
        offset = 0
        for size in sizes:
            self.priors.append(flat[offset : offset + tiles * size].view(tiles, size))
            offset += tiles * size

    def narrow(self, tiles: int) -> _Buffers:
        """The same storage for a smaller (last) batch."""
        view = object.__new__(_Buffers)
        view.cost = self.cost[:, :tiles]
        view.scratch = self.scratch
        view.priors = [p[:tiles] for p in self.priors]
        return view


def _rotate(states: torch.Tensor, d: int) -> torch.Tensor:
    """Position of a state in the step layout ``[low d bits, high 16-d bits]`` (see :class:`_Tables`)."""
    return ((states & ((1 << d) - 1)) << (16 - d)) | (states >> d)


def _unrotate(index: torch.Tensor, d: int) -> torch.Tensor:
    """Inverse of :func:`_rotate`."""
    return ((index & ((_STATES >> d) - 1)) << d) | (index >> (16 - d))


class _Tables:
    """Codebook values per step layout.

    The cost array of a step with ``d`` new bits is stored with the state's ``d`` new bits as the outer index
    and its ``16-d`` overlap bits (``state >> d``) as the inner one, so adding the previous step's best cost
    (indexed by the overlap bits) broadcasts over a contiguous inner dimension.
    """

    def __init__(self, lut: torch.Tensor, steps: Sequence[int]) -> None:
        self.lut = lut
        self.rot: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for d in set(steps):
            values = lut[_unrotate(torch.arange(_STATES, device=lut.device), d)]
            self.rot[d] = (values, values * values)


def _step_costs(tables: _Tables, x: torch.Tensor, prior: torch.Tensor, d: int, out: torch.Tensor) -> torch.Tensor:
    """Cost of every state at a step, ``(lut - x)² - x² + prior[state >> d]``, in the step's layout -> ``out``.

    ``prior`` ``[T, 2**(16-d)]`` is the best cost of the previous state over its free top bits, indexed by the
    overlap bits it shares with this state. The dropped ``x²`` is the same for every state.
    """
    values, squares = tables.rot[d]
    torch.addcmul(squares, x, values, value=-2.0, out=out)
    out.view(x.shape[0], 1 << d, _STATES >> d).add_(prior.unsqueeze(1))
    return out


def _best_prior(cost: torch.Tensor, d_prev: int, d: int, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """``out[e] = min over the top d bits h of cost[state = h << (16-d) | e]`` for a cost in layout ``d_prev``.

    With ``e = e_hi << d_prev | e_lo`` the state's layout position is ``e_lo, h, e_hi`` (needs d + d_prev <= 16).
    """
    tiles = cost.shape[0]
    rest = 16 - d_prev - d
    best = scratch[: tiles << (d_prev + rest)].view(tiles, 1 << d_prev, 1 << rest)
    torch.amin(cost.view(tiles, 1 << d_prev, 1 << d, 1 << rest), dim=2, out=best)
    out.view(tiles, 1 << rest, 1 << d_prev).copy_(best.transpose(1, 2))


def _forward(
    x: torch.Tensor,
    steps: Sequence[int],
    tables: _Tables,
    prior: torch.Tensor,
    buffers: _Buffers,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Viterbi over the positions of ``x`` (``[T, L]``, processing order; ``steps[i]`` new bits at step i).

    ``prior`` is the cost of the overlap bits entering step 0 (0 or inf). Returns the final cost (layout of the
    last step) and the prior each step used (in ``buffers``): backtracking recomputes the 2**D candidate costs
    of the previous step from it instead of storing argmins (a plain min reduction is several times faster
    than one that also returns indices).
    """
    length = x.shape[1]
    priors = buffers.priors
    priors[0].copy_(prior)
    cost = _step_costs(tables, x[:, :1], priors[0], steps[0], buffers.cost[0])
    for i in range(1, length):
        _best_prior(cost, steps[i - 1], steps[i], priors[i], buffers.scratch)
        cost = _step_costs(tables, x[:, i : i + 1], priors[i], steps[i], buffers.cost[i % 2])
    return cost, priors


def _backtrack(
    final: torch.Tensor,
    x: torch.Tensor,
    priors: Sequence[torch.Tensor | None],
    steps: Sequence[int],
    lut: torch.Tensor,
    stop: int,
) -> torch.Tensor:
    """States ``[T, L]`` traced back from the final states; entries before ``stop`` are left at 0."""
    length = len(steps)
    out = torch.zeros((final.shape[0], length), dtype=torch.int64, device=final.device)
    state = final.to(torch.int64)
    out[:, length - 1] = state
    for i in range(length - 1, stop, -1):
        d, d_prev = steps[i], steps[i - 1]
        edge = state >> d
        top = torch.arange(1 << d, device=x.device)
        cand = (top[None, :] << (16 - d)) | edge[:, None]  # [T, 2**d] possible previous states
        vals = lut[cand]
        cost = (vals - x[:, i - 1 : i]).square() + priors[i - 1].gather(1, cand >> d_prev)  # type: ignore[union-attr]
        state = cand.gather(1, cost.argmin(dim=1, keepdim=True)).squeeze(1)
        out[:, i - 1] = state
    return out


def _viterbi_batch(x: torch.Tensor, steps: list[int], tables: _Tables, buffers: _Buffers) -> torch.Tensor:
    tiles, length = x.shape
    half = length // 2
    # pass 1: ring rolled by half a tile, unconstrained; trace back to position 0
    order = list(range(half, length)) + list(range(half))
    rolled = [steps[p] for p in order]
    assert rolled == steps, "the step pattern must have a period dividing half a tile"
    x1 = x[:, order]
    free = torch.zeros((tiles, _STATES >> rolled[0]), dtype=torch.float32, device=x.device)
    cost, priors = _forward(x1, rolled, tables, free, buffers)
    final = _unrotate(cost.argmin(dim=1), rolled[-1])
    first = _backtrack(final, x1, priors, rolled, tables.lut, stop=half)[:, half]
    # pass 2: start from the overlap bits of that state and end on them (tail-biting)
    d0 = steps[0]
    edge = first >> d0
    start = torch.full((tiles, _STATES >> d0), math.inf, dtype=torch.float32, device=x.device)
    start.scatter_(1, edge.unsqueeze(1), 0.0)
    cost, priors = _forward(x, steps, tables, start, buffers)
    cand = (torch.arange(1 << d0, device=x.device)[None, :] << (16 - d0)) | edge[:, None]
    ends = cost.gather(1, _rotate(cand, steps[-1]))
    final = cand.gather(1, ends.argmin(dim=1, keepdim=True)).squeeze(1)
    return _backtrack(final, x, priors, steps, tables.lut, stop=0)


class TileEncoder:
    """Reusable Viterbi set-up (codebook tables and batch storage) for many :meth:`encode` calls at one K.

    LDLQ encodes a weight one 16-row strip at a time, so it builds the tables and buffers once here.
    """

    def __init__(
        self,
        k_bits: float,
        codebook: str,
        device: torch.device | str = "cpu",
        *,
        multiplier: int | None = None,
        batch_tiles: int | None = None,
    ) -> None:
        self.k_bits = k_bits
        self.steps = step_bits(k_bits)
        self.lut = codebook_lut(normalize_codebook(codebook), multiplier=multiplier).to(device, torch.float32)
        self.tables = _Tables(self.lut, self.steps)
        self.batch = _batch_tiles(k_bits, batch_tiles)
        self._buffers: _Buffers | None = None

    def encode(self, tiles: torch.Tensor, num_threads: int | None = 1) -> torch.Tensor:
        """int32 states ``[T, 256]`` for float tiles ``[T, 256]`` in stream order (see :func:`viterbi_encode`)."""
        if tiles.dim() != 2 or tiles.shape[1] != TILE_NUMEL:
            raise ValueError(f"tiles must be [T, {TILE_NUMEL}], got {tuple(tiles.shape)}")
        x = tiles.to(torch.float32)
        out = torch.empty(x.shape, dtype=torch.int32, device=x.device)
        batch = min(self.batch, max(1, x.shape[0]))
        if self._buffers is None or self._buffers.cost.shape[1] < batch:
            # both passes: rolling by 128 keeps the period-16 step pattern
            self._buffers = _Buffers(batch, self.steps, x.device)
        with torch_threads(num_threads):
            for start in range(0, x.shape[0], batch):
                chunk = x[start : start + batch]
                states = _viterbi_batch(chunk, self.steps, self.tables, self._buffers.narrow(chunk.shape[0]))
                out[start : start + batch] = states.to(torch.int32)
        return out

    def values(self, states: torch.Tensor) -> torch.Tensor:
        """The fp32 values (fp16 codebook values) the decoder gives for ``states``."""
        return self.lut[states.long()]


def viterbi_encode(
    tiles: torch.Tensor,
    k_bits: float,
    codebook: str,
    *,
    multiplier: int | None = None,
    batch_tiles: int | None = None,
    num_threads: int | None = 1,
) -> torch.Tensor:
    """Tail-biting trellis states minimizing the squared error to each tile.

    ``tiles``: float ``[T, 256]`` in stream (tensor-core) order. Returns int32 states ``[T, 256]`` whose packed
    ring (:func:`anyquant_exl3.trellis.pack_states`) decodes back to exactly these states. The codebook values
    are the fp16 ones the decoder produces.
    """
    if tiles.dim() != 2 or tiles.shape[1] != TILE_NUMEL:
        raise ValueError(f"tiles must be [T, {TILE_NUMEL}], got {tuple(tiles.shape)}")
    encoder = TileEncoder(k_bits, codebook, tiles.device, multiplier=multiplier, batch_tiles=batch_tiles)
    return encoder.encode(tiles, num_threads)


# ----------------------------------------------------------------------------------------------------------------
# regularization


def _rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.square().mean(dim=dim, keepdim=True).sqrt()


def random_signs(size: int, generator: torch.Generator) -> torch.Tensor:
    """Random ±1 fp32 vector."""
    return 1.0 - 2.0 * torch.randint(0, 2, (size,), generator=generator).to(torch.float32)


def regularize(
    weight: torch.Tensor,
    su_signs: torch.Tensor,
    sv_signs: torch.Tensor,
    *,
    apply_out_scales: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """exllamav3 ``regularize`` without the global scale: ``[in, out]`` fp32 weight -> (Ŵ target, su, sv).

    Output channels are divided by ``sv`` (signs x channel RMS / mean RMS with out-scales), then rotated by the
    right Hadamard; input rows are divided by ``su = signs x row RMS / -1.24371088`` and rotated by the left
    Hadamard. The decoder's ``diag(su) H Ŵ H diag(sv)`` inverts this exactly.
    """
    w = weight.to(torch.float32).clone()
    out_scales = _rms(w, 0).reshape(-1)
    mean = float(out_scales.mean())
    zero_out = out_scales.abs() < 1e-30
    sv = sv_signs.to(torch.float32).clone()
    if mean > 1e-30:
        out_scales = out_scales / mean
    if apply_out_scales:
        out_scales = torch.where(zero_out, torch.full_like(out_scales, 0.1), out_scales)
        sv = sv * out_scales + 1e-10
    w /= sv[None, :]
    sv[zero_out] = 0.0
    w = had_right(w)
    in_scales = _rms(w, 1).reshape(-1)
    in_scales = torch.where(in_scales.abs() < 1e-30, torch.full_like(in_scales, 0.1), in_scales)
    su = su_signs.to(torch.float32) * in_scales / (-CODEBOOK_SCALE_3INST) + 1e-10
    w /= su[:, None]
    return had_left(w), su, sv


# ----------------------------------------------------------------------------------------------------------------
# tiles and global scale


def matrix_to_stream_tiles(matrix: torch.Tensor) -> torch.Tensor:
    """``[16·tk, 16·tn]`` -> ``[tk, tn, 256]`` tiles in stream (tensor-core) order."""
    return matrix_to_tiles(matrix)[..., tensor_core_perm().to(matrix.device)]


def stream_tiles_to_matrix(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`matrix_to_stream_tiles`."""
    rowmajor = torch.empty_like(tiles)
    rowmajor[..., tensor_core_perm().to(tiles.device)] = tiles
    return tiles_to_matrix(rowmajor)


def quantize_tiles(
    tiles: torch.Tensor,
    k_bits: float,
    codebook: str,
    *,
    batch_tiles: int | None = None,
    num_threads: int | None = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(states, fp32 reconstructed values) for stream-order tiles ``[T, 256]``."""
    states = viterbi_encode(tiles, k_bits, codebook, batch_tiles=batch_tiles, num_threads=num_threads)
    values = codebook_lut(normalize_codebook(codebook)).to(tiles.device)[states.long()].to(torch.float32)
    return states, values


def sample_tiles(matrix: torch.Tensor, count: int) -> torch.Tensor:
    """Up to ``count`` stream-order tiles along a wrapped diagonal (every tile row and column hit if possible)."""
    tiles = matrix_to_stream_tiles(matrix)
    tk, tn = tiles.shape[0], tiles.shape[1]
    idx = torch.arange(min(count, tk * tn), device=tiles.device)
    return tiles[idx % tk, (idx + idx // max(tk, 1)) % tn]


def search_global_scale(
    matrix: torch.Tensor,
    k_bits: float,
    codebook: str,
    *,
    count: int = 8,
    grid: Sequence[float] = (0.55, 0.7, 0.85, 1.0, 1.15),
    batch_tiles: int | None = None,
    num_threads: int | None = 1,
) -> float:
    """Global scale g minimizing the sample tiles' error of ``quantize(g·W)/g`` (coarse grid + parabola)."""
    sample = sample_tiles(matrix, count).reshape(-1, TILE_NUMEL)
    errors = []
    for g in grid:
        _, values = quantize_tiles(sample * g, k_bits, codebook, batch_tiles=batch_tiles, num_threads=num_threads)
        errors.append(float((values / g - sample).square().mean()))
    best = min(range(len(grid)), key=errors.__getitem__)
    if 0 < best < len(grid) - 1:
        y0, y1, y2 = errors[best - 1 : best + 2]
        denom = y0 - 2.0 * y1 + y2
        step = grid[best + 1] - grid[best]
        if denom > 0:
            return float(grid[best] + max(-0.5, min(0.5, 0.5 * (y0 - y2) / denom)) * step)
    return float(grid[best])


def default_global_scale(codebook: str) -> float:
    """Scale that brings the regularized rows (RMS 1.2437, the 3INST codebook RMS) to the codebook's own RMS."""
    lut = codebook_lut(normalize_codebook(codebook)).double()
    return float(lut.square().mean().sqrt()) / CODEBOOK_SCALE_3INST


# ----------------------------------------------------------------------------------------------------------------
# Hessian-aware encoding (LDLQ)

#: Diagonal damping of the Hessian, as a fraction of its mean diagonal (exllamav3's ``sigma_reg`` default).
SIGMA_REG = 0.025


class HessianError(ValueError):
    """A Hessian that cannot be used: wrong shape, not finite, or not positive definite even after damping."""


def damp_hessian(hessian: torch.Tensor, size: int, sigma_reg: float = SIGMA_REG) -> torch.Tensor:
    """``[in, in]`` Hessian ``E[x xᵀ]`` -> float64 ``[size, size]`` (zero-padded) with ``sigma_reg · mean diag`` added.

    The padded inputs are always zero, so their rows and columns carry only the damping.
    """
    n = hessian.shape[0]
    if hessian.dim() != 2 or hessian.shape[1] != n or n > size:
        raise HessianError(f"Hessian must be square [in, in] with in <= {size}, got {tuple(hessian.shape)}")
    if not bool(torch.isfinite(hessian).all()):
        raise HessianError("Hessian has non-finite entries")
    h = torch.zeros((size, size), dtype=torch.float64, device=hessian.device)
    h[:n, :n] = hessian.to(torch.float64)
    mean = float(h.diagonal()[:n].mean())
    if not mean > 0:
        raise HessianError("Hessian has no positive diagonal: no calibration input reached this layer")
    h.diagonal().add_(sigma_reg * mean)
    return h


def block_ldl(hessian: torch.Tensor, block: int = 16, retries: int = 10, sigma_reg: float = SIGMA_REG) -> torch.Tensor:
    """Block LDLᵀ of a symmetric positive definite matrix: ``H = (I + L) D (I + L)ᵀ``; returns ``L``.

    ``L`` is strictly block-lower-triangular (its ``block x block`` diagonal blocks are zero) and ``D`` is
    block-diagonal. From the Cholesky factor ``C``: ``I + L = C · blockdiag(C_ii)⁻¹``. A failed Cholesky adds
    ``2 · sigma_reg · mean diag`` and retries, as exllamav3 does.
    """
    n = hessian.shape[0]
    if n % block:
        raise HessianError(f"Hessian size {n} is not a multiple of {block}")
    m = n // block
    h = hessian.clone()
    for _ in range(retries + 1):
        chol, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            break
        h.diagonal().add_(2.0 * sigma_reg * float(h.diagonal().mean()))
    else:
        raise HessianError(f"Hessian is not positive definite after {retries} damping steps")
    diag = chol.view(m, block, m, block).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # [m, b, b]
    unit = torch.einsum("rib,ibc->ric", chol.view(n, m, block), torch.linalg.inv(diag)).reshape(n, n)
    unit.view(m, block, m, block).diagonal(dim1=0, dim2=2).zero_()
    return unit


def rotate_hessian(hessian: torch.Tensor, su: torch.Tensor) -> torch.Tensor:
    """The Hessian of the regularized weight's inputs: ``Hl · diag(su) · H · diag(su) · Hl``.

    The decoder computes ``x W = (x diag(su) Hl) Ŵ (Hr diag(sv))``, so ``Ŵ`` sees the inputs ``x diag(su) Hl``.
    (exllamav3 rotates with the signs of su only; with the channel scales the LDLQ error weights match the
    weight that is actually encoded.)
    """
    s = su.to(hessian.dtype)
    return had_right(had_left(hessian * s[:, None] * s[None, :]))


def ldlq(
    target: torch.Tensor,
    unit_lower: torch.Tensor,
    encoder: TileEncoder,
    *,
    num_threads: int | None = 1,
) -> torch.Tensor:
    """LDLQ over 16-row strips of the regularized weight ``[k, n]`` -> states ``[k/16, n/16, 256]``.

    Strips are encoded from the last to the first; strip ``r`` is encoded from
    ``target_r + Σ_{s>r} L[s, r]ᵀ (target_s - quantized_s)``, which makes the proxy loss
    ``tr(Eᵀ H E)`` the sum of each strip's own (D-weighted) Viterbi error (QuIP#/QTIP's LDLQ as exllamav3 runs
    it). ``unit_lower`` is :func:`block_ldl` of the rotated Hessian.
    """
    k, n = target.shape
    tk, tn = k // 16, n // 16
    lower = unit_lower.to(target.device, torch.float32)
    err = torch.zeros_like(target, dtype=torch.float32)
    states = torch.empty((tk, tn, TILE_NUMEL), dtype=torch.int32, device=target.device)
    for r in range(tk - 1, -1, -1):
        r0, r1 = 16 * r, 16 * r + 16
        strip = target[r0:r1].to(torch.float32)
        if r1 < k:
            strip = strip + lower[r1:, r0:r1].t() @ err[r1:]
        tiles = matrix_to_stream_tiles(strip).reshape(tn, TILE_NUMEL)
        found = encoder.encode(tiles, num_threads)
        states[r] = found
        err[r0:r1] = target[r0:r1] - stream_tiles_to_matrix(encoder.values(found).view(1, tn, TILE_NUMEL))
    return states


# ----------------------------------------------------------------------------------------------------------------
# layer


def _marker(codebook: str) -> dict[str, torch.Tensor]:
    if codebook not in LOCKED_MULTIPLIERS:
        return {}
    value = LOCKED_MULTIPLIERS[codebook]
    return {codebook: torch.tensor(value - (1 << 32) if value >= 1 << 31 else value, dtype=torch.int32)}


def _padded(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear ``[out, in]`` -> zero-padded ``[in_pad, out_pad]`` fp32 (multiples of 128)."""
    out_f, in_f = weight.shape
    k_pad = -(-in_f // HAD_DIM) * HAD_DIM
    n_pad = -(-out_f // HAD_DIM) * HAD_DIM
    w = torch.zeros((k_pad, n_pad), dtype=torch.float32, device=weight.device)
    w[:in_f, :out_f] = weight.t().to(torch.float32)
    return w


def encode_exl3(
    weight: torch.Tensor,
    k_bits: float,
    *,
    codebook: str = "mul1",
    seed: int = 0,
    apply_out_scales: bool = True,
    g_scale: float | str | None = None,
    hessian: torch.Tensor | None = None,
    sigma_reg: float = SIGMA_REG,
    batch_tiles: int | None = None,
    num_threads: int | None = 1,
) -> dict[str, torch.Tensor]:
    """Quantize an ``nn.Linear`` weight ``[out, in]`` to EXL3 tensors.

    Returns ``{"trellis", "suh", "svh"}`` plus the codebook marker (``"mcg"``/``"mul1"``) as exllamav3 stores them;
    dims are padded to multiples of 128 (decode with ``in_features``/``out_features`` to trim). ``g_scale``: a
    float, ``"search"`` (sampled grid search like exllamav3's), or ``None`` for :func:`default_global_scale`.
    ``hessian``: ``E[x xᵀ]`` of the layer's inputs ``[in, in]``; given, the tiles are encoded with LDLQ
    (:func:`ldlq`, damping ``sigma_reg``), which minimizes the output error ``tr(E H Eᵀ)`` instead of the
    weight error. ``num_threads``: torch intra-op threads during the Viterbi search (``None`` keeps the current
    setting).
    """
    cb = normalize_codebook(codebook)
    step_bits(k_bits)  # validates K
    w = _padded(weight)
    damped = None if hessian is None else damp_hessian(hessian.to(w.device), w.shape[0], sigma_reg)
    gen = torch.Generator().manual_seed(int(seed))
    su_signs = random_signs(w.shape[0], gen).to(w.device)
    sv_signs = random_signs(w.shape[1], gen).to(w.device)
    target, su, sv = regularize(w, su_signs, sv_signs, apply_out_scales=apply_out_scales)
    if g_scale is None:
        g = default_global_scale(cb)
    elif g_scale == "search":
        g = search_global_scale(target, k_bits, cb, batch_tiles=batch_tiles, num_threads=num_threads)
    else:
        g = float(g_scale)
    target *= g
    su /= g
    encoder = TileEncoder(k_bits, cb, w.device, batch_tiles=batch_tiles)
    if damped is None:
        tiles = matrix_to_stream_tiles(target)
        states = encoder.encode(tiles.reshape(-1, TILE_NUMEL), num_threads).view(tiles.shape)
    else:
        states = ldlq(
            target, block_ldl(rotate_hessian(damped, su), sigma_reg=sigma_reg), encoder, num_threads=num_threads
        )
    trellis = pack_states(states, k_bits)
    return {"trellis": trellis, "suh": su.half(), "svh": sv.half(), **_marker(cb)}
