"""cpu-fast's gpt-oss experts: each expert's MXFP4 weights kept packed (4.25 bits a weight) on the compiled 4-bit
table kernel, instead of decoded to the compute dtype.

An expert's ``gate_up_proj`` and ``down_proj`` become one :class:`~anyquant.runtime.kernels.lut.Lut4Linear` each (the
E2M1 table, each block's ``2**(s - 127)`` its scale, rounded to the checkpoint's dtype as transformers' decode is:
the exact weight, bit for bit), with the expert's biases. :class:`PackedGptOssExperts` computes what transformers'
eager ``GptOssExperts`` computes (the clamped SwiGLU on the interleaved gate/up columns, the routing weights, the
per-expert sums in ascending expert order) and reads only the experts some token chose. Attention, router,
embeddings and head stay the checkpoint's tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from anyquant.plugin import CheckpointError

from .dequant import FP4_VALUES, check_scales
from .scheme import BLOCK, BLOCK_BYTES, MXFP4Tensor

if TYPE_CHECKING:
    from anyquant.runtime.kernels.lut import Lut4Linear

__all__ = ["PackedGptOssExperts", "lut4_linear", "packed_unsupported"]

#: the largest E8M0 exponent (``s - 127``) whose blocks cannot pass the compute dtype's range (6 * 2**125 fits every
#: dtype with float32's exponent; float16's is checked block by block)
_SAFE_EXPONENT = 125


def packed_unsupported(dtype: torch.dtype) -> str | None:
    """Why the packed experts cannot run here (``None``: they can)."""
    from anyquant.runtime import kernels

    if not kernels.lut_available():
        return "the compiled 4-bit table kernel is not built here"
    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        return f"MXFP4 decoded to {dtype}"
    return None


def _check_range(spec: MXFP4Tensor, codes: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype) -> None:
    """Values past ``dtype``'s range: the :class:`~anyquant.errors.NumericalError` the exact decode gives, naming the
    tensor (only blocks with a large exponent are formed to find them)."""
    from anyquant.runtime.finite import check_finite

    big = exps > _SAFE_EXPONENT if dtype != torch.float16 else exps > -127
    if not bool(big.any()):
        return
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    rows, blocks = big.nonzero(as_tuple=True)
    values = lut[codes.view(codes.shape[0], -1, BLOCK)[rows, blocks].to(torch.long)]
    check_finite(spec.name, torch.ldexp(values, exps[rows, blocks, None].to(torch.float32)).to(dtype))


def lut4_linear(
    spec: MXFP4Tensor,
    expert: int,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    small_rows: int = 4,
    prefill_dtype: torch.dtype | None = None,
) -> Lut4Linear:
    """Expert ``expert`` of ``spec``: ``blocks`` U8 ``[out, in/32, 16]`` (even element in the low nibble), ``scales``
    U8 ``[out, in/32]``, as a packed linear ``[out, in]``."""
    from anyquant.runtime.kernels.lut import Lut4Linear

    n, k = spec.out_features, spec.in_features
    if tuple(blocks.shape) != (n, k // BLOCK, BLOCK_BYTES) or tuple(scales.shape) != (n, k // BLOCK):
        raise CheckpointError(
            f"{spec.blocks}: expert {expert} is {list(blocks.shape)} / {list(scales.shape)}; expected "
            f"[{n}, {k // BLOCK}, {BLOCK_BYTES}] / [{n}, {k // BLOCK}] (the file changed after it was probed)"
        )
    blocks, scales = blocks.view(torch.uint8), scales.view(torch.uint8)
    check_scales(spec, scales)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(n, k)
    exps = scales.to(torch.int32) - 127
    _check_range(spec, codes, exps, dtype)
    return Lut4Linear(
        codes,
        torch.ldexp(torch.ones(n, k // BLOCK), exps.to(torch.float32)),
        torch.tensor(FP4_VALUES, dtype=torch.float32),
        group=BLOCK,
        round_to=dtype,
        bias=bias,
        small_rows=small_rows,
        prefill_dtype=prefill_dtype,
        compute_dtype=dtype,
    )


class PackedGptOssExperts(nn.Module):
    """``GptOssExperts`` with each expert's two weights packed: called as transformers calls it,
    ``experts(hidden_states [T, H], router_indices [T, k], routing_weights [T, k]) -> [T, H]``."""

    def __init__(self, gate_up: list[Lut4Linear], down: list[Lut4Linear], *, alpha: float, limit: float) -> None:
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
        return next_states

    def packed_bytes(self) -> int:
        return sum(int(m.packed_bytes()) for m in (*self.gate_up, *self.down))

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, MXFP4 packed (4-bit table kernel), alpha={self.alpha}, limit={self.limit}"
        )


def build_packed(
    module: Any,
    gate_up: MXFP4Tensor,
    down: MXFP4Tensor,
    read: Any,
    biases: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
    **fast: Any,
) -> PackedGptOssExperts:
    """The packed form of transformers' ``module`` (a ``GptOssExperts`` on the meta device) from ``read(name)``."""
    if gate_up.experts != down.experts:
        raise CheckpointError(f"{gate_up.blocks} has {gate_up.experts} experts, {down.blocks} {down.experts}")
    gu_blocks, gu_scales, d_blocks, d_scales = (
        read(n) for n in (gate_up.blocks, gate_up.scales, down.blocks, down.scales)
    )
    gu_bias, d_bias = biases
    return PackedGptOssExperts(
        [
            lut4_linear(gate_up, e, gu_blocks[e], gu_scales[e], gu_bias[e], dtype=dtype, **fast)
            for e in range(gate_up.experts)
        ],
        [lut4_linear(down, e, d_blocks[e], d_scales[e], d_bias[e], dtype=dtype, **fast) for e in range(down.experts)],
        alpha=float(module.alpha),
        limit=float(module.limit),
    )
