"""gpt-oss's experts as one linear per expert: each expert's two MXFP4 weights kept packed (4.25 bits a weight) as
:class:`MXFP4Linear` layers, which describe their weight as a 4-bit table layout for the CPU engine, instead of decoded
into transformers' fused ``[E, in, out]`` parameters.

An expert's ``gate_up_proj`` and ``down_proj`` are each an :class:`MXFP4Linear` (the E2M1 table, each block's
``2**(s - 127)`` its scale, rounded to the checkpoint's dtype as transformers' decode is: the exact weight, bit for
bit), with the expert's biases; the loader hands them to the engine's plan, which runs them on the kernel of the
first layout that runs here (or keeps them exact). :class:`PackedGptOssExperts` computes what transformers' eager
``GptOssExperts`` computes (the clamped SwiGLU on the interleaved gate/up columns, the routing weights, the
per-expert sums in ascending expert order) over whatever linears it holds, and reads only the experts some token
chose. Attention, router, embeddings and head stay the checkpoint's tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from anyquant.plugin import CheckpointError
from anyquant_runtime.qlinear import QuantLinearBase

from .dequant import FP4_VALUES, check_scales, dequantize
from .scheme import BLOCK, BLOCK_BYTES, MXFP4Tensor

if TYPE_CHECKING:
    from anyquant_runtime.layouts import Layout

__all__ = ["MXFP4Linear", "PackedGptOssExperts", "build_packed", "table4_layout"]

#: tokens from which a prompt's experts hand the C heap's free pages back (after a layer, once the process grew
#: :data:`TRIM_GROWTH` bytes since the last time): glibc keeps the freed temporaries of a long prompt (attention's
#: scores, the experts' exact weights) and each layer added to them (a 512-token gpt-oss prompt: ~+250 MiB of RSS
#: over its 12 layers); a ``malloc_trim`` after every layer cost ~7 % of that prompt's time (its pages faulted in again)
TRIM_TOKENS = 256
TRIM_GROWTH = 64 << 20
_trimmed_at = [0]


def _resident() -> int:
    """This process's resident bytes (``/proc/self/statm``; 0 where there is none)."""
    import os

    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _trim_heap() -> None:
    """``release_free_heap`` when the process grew :data:`TRIM_GROWTH` since the last one (or since none)."""
    from anyquant.plugin import release_free_heap

    now = _resident()
    if now and now - _trimmed_at[0] < TRIM_GROWTH:
        return
    release_free_heap()
    _trimmed_at[0] = _resident()


#: the largest E8M0 exponent (``s - 127``) whose blocks cannot pass the compute dtype's range (6 * 2**125 fits every
#: dtype with float32's exponent; float16's is checked block by block)
_SAFE_EXPONENT = 125


def _check_range(spec: MXFP4Tensor, blocks: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype) -> None:
    """Values past ``dtype``'s range: the :class:`~anyquant.errors.NumericalError` the exact decode gives, naming the
    tensor (only blocks with a large exponent are formed to find them)."""
    from anyquant_runtime.finite import check_finite

    big = exps > _SAFE_EXPONENT if dtype != torch.float16 else exps > -127
    if not bool(big.any()):
        return
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    rows, cols = big.nonzero(as_tuple=True)
    chosen = blocks[rows, cols]
    codes = torch.stack((chosen & 0x0F, chosen >> 4), dim=-1).reshape(-1, BLOCK)
    check_finite(spec.name, torch.ldexp(lut[codes.to(torch.long)], exps[rows, cols, None].to(torch.float32)).to(dtype))


def table4_layout(
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    codes: Callable[[], torch.Tensor] | None = None,
    scales: Callable[[], torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
) -> Layout:
    """An MXFP4 weight as the engine's 4-bit table layout: E2M1 codes, ``2**(s - 127)`` per block of 32, each weight
    rounded to ``dtype`` (transformers' decode); without tensors, its description from the headers."""
    from anyquant_runtime.layouts import Table4

    table = None if codes is None else (lambda: torch.tensor(FP4_VALUES, dtype=torch.float32))
    return Table4(in_features, out_features, BLOCK, codes, scales, table, round_to=dtype, bias=bias)


class MXFP4Linear(QuantLinearBase):
    """Expert ``expert`` of a gpt-oss MXFP4 weight as a linear ``[out, in]``: ``blocks`` U8 ``[out, in/32, 16]``
    (even element in the low nibble), ``scales`` U8 ``[out, in/32]`` (E8M0), ``bias`` ``[out]``. Its exact weight is
    transformers' decoded expert (``dequantize``); :meth:`packed_layouts` offers the 4-bit table layout."""

    packed_names = ("blocks", "scales")
    blocks: torch.Tensor
    scales: torch.Tensor

    def __init__(
        self,
        spec: MXFP4Tensor,
        expert: int,
        blocks: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        dtype: torch.dtype,
    ) -> None:
        n, k = spec.out_features, spec.in_features
        super().__init__(k, n, mode="reference", compute_dtype=dtype)
        if tuple(blocks.shape) != (n, k // BLOCK, BLOCK_BYTES) or tuple(scales.shape) != (n, k // BLOCK):
            raise CheckpointError(
                f"{spec.blocks}: expert {expert} is {list(blocks.shape)} / {list(scales.shape)}; expected "
                f"[{n}, {k // BLOCK}, {BLOCK_BYTES}] / [{n}, {k // BLOCK}] (the file changed after it was probed)"
            )
        blocks, scales = blocks.view(torch.uint8), scales.view(torch.uint8)
        check_scales(spec, scales)
        _check_range(spec, blocks, scales.to(torch.int32) - 127, dtype)
        self.set_packed(bias, blocks=blocks, scales=scales)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.blocks, self.scales, self.compute_dtype)

    def _codes(self) -> torch.Tensor:
        return torch.stack((self.blocks & 0x0F, self.blocks >> 4), dim=-1).reshape(self.out_features, -1)

    def _scales(self) -> torch.Tensor:
        exps = self.scales.to(torch.int32) - 127
        return torch.ldexp(torch.ones(exps.shape), exps.to(torch.float32))

    def packed_layouts(self) -> Sequence[Layout] | str:
        if self.mode != "reference":
            return "the packed tensors were dropped (dequantized mode)"
        return [
            table4_layout(
                self.in_features,
                self.out_features,
                self.compute_dtype,
                self._codes,
                self._scales,
                self._buffers.get("bias"),
            )
        ]


class PackedGptOssExperts(nn.Module):
    """``GptOssExperts`` with each expert's two weights packed: called as transformers calls it,
    ``experts(hidden_states [T, H], router_indices [T, k], routing_weights [T, k]) -> [T, H]``."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module], *, alpha: float, limit: float) -> None:
        super().__init__()
        if not gate_up or len(gate_up) != len(down):
            raise ValueError("PackedGptOssExperts needs one gate_up and one down linear per expert")
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.num_experts = len(gate_up)
        self.alpha, self.limit = float(alpha), float(limit)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up[e](x)
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        out: torch.Tensor = self.down[e]((up + 1) * glu)
        return out

    def forward(
        self, hidden_states: torch.Tensor, router_indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> torch.Tensor:
        next_states = torch.zeros_like(hidden_states)
        if hidden_states.shape[0] == 1:  # decode: the token's experts, the same sums without a gather or scatter
            chosen = router_indices[0].tolist()
            for pos, e in sorted(enumerate(chosen), key=lambda item: item[1]):
                if 0 <= e < self.num_experts:
                    out = self._expert(e, hidden_states) * routing_weights[0, pos]
                    next_states = next_states + out.to(hidden_states.dtype)
            return next_states
        for e in torch.unique(router_indices).tolist():  # ascending, as transformers adds them
            if not 0 <= e < self.num_experts:
                continue
            token_idx, top_k_pos = torch.where(router_indices == e)
            out = self._expert(e, hidden_states[token_idx]) * routing_weights[token_idx, top_k_pos, None]
            next_states.index_add_(0, token_idx, out.to(hidden_states.dtype))
        if hidden_states.shape[0] >= TRIM_TOKENS:
            _trim_heap()
        return next_states

    def packed_bytes(self) -> int:
        """The bytes the experts' linears hold (their fast form's, or their exact weight's)."""
        total = 0
        for m in (*self.gate_up, *self.down):
            held = getattr(m, "packed_bytes", None)
            total += int(held()) if callable(held) else sum(t.numel() * t.element_size() for t in m.buffers())
        return total

    def extra_repr(self) -> str:
        kinds = ", ".join(sorted({type(m).__name__ for m in (*self.gate_up, *self.down)}))
        return f"num_experts={self.num_experts} ({kinds}), alpha={self.alpha}, limit={self.limit}"


def build_packed(
    module: Any,
    gate_up: MXFP4Tensor,
    down: MXFP4Tensor,
    read: Any,
    biases: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
    convert: Callable[[str, MXFP4Linear], nn.Module],
) -> PackedGptOssExperts:
    """The per-expert form of transformers' ``module`` (a ``GptOssExperts`` on the meta device) from ``read(name)``,
    each expert's :class:`MXFP4Linear` passed through ``convert(name, layer)`` (the engine's plan)."""
    if gate_up.experts != down.experts:
        raise CheckpointError(f"{gate_up.blocks} has {gate_up.experts} experts, {down.blocks} {down.experts}")

    def linears(spec: MXFP4Tensor, bias: torch.Tensor) -> list[nn.Module]:
        blocks, scales = read(spec.blocks), read(spec.scales)
        return [
            convert(f"{spec.name}.{e}", MXFP4Linear(spec, e, blocks[e], scales[e], bias[e], dtype=dtype))
            for e in range(spec.experts)
        ]

    return PackedGptOssExperts(
        linears(gate_up, biases[0]), linears(down, biases[1]), alpha=float(module.alpha), limit=float(module.limit)
    )
