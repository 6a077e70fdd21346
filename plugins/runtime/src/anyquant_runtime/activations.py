"""Input-activation quantization that several formats share, and the module that puts it in front of a fast linear.

A format whose linears quantize their inputs (FP8 W8A8, NVFP4 W4A4) applies the same arithmetic on its exact path
(``forward``) and around whatever module the CPU engine builds for its weight
(:meth:`~anyquant_runtime.qlinear.QuantLinearBase.behind_inputs`, which returns a :class:`QuantizedInputs`). Each
function here states whose arithmetic it is, to the bit:

- :func:`quantize_fp8_activations`: vLLM's ``QuantFP8`` (static per-tensor ``input_scale``, or dynamic per token);
- :func:`quantize_nvfp4_activations`: vLLM's NVFP4 emulation (``ref_nvfp4_quant`` and its dequantization: FP4 E2M1
  values with an E4M3 scale per 16, under a global scale), as vLLM runs W4A4 NVFP4 where the GPU has no FP4;
- :func:`round_fp4`: the nearest E2M1 value with compressed-tensors' and vLLM's tie rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

__all__ = [
    "E2M1",
    "FP8_MAX",
    "MIN_DYNAMIC_SCALE",
    "QuantizedInputs",
    "quantize_fp8_activations",
    "quantize_alike",
    "quantize_nvfp4_activations",
    "round_fp4",
    "shared_inputs",
]

FP8_MAX = 448.0
#: vLLM's ``_FP8_MIN_SCALING_FACTOR``: the least dynamic scale (an all-zero token)
MIN_DYNAMIC_SCALE = 1.0 / (FP8_MAX * 512.0)
#: FP4 E2M1 magnitudes by their 3-bit code (bit 3 is the sign)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0


def round_fp4(x: torch.Tensor) -> torch.Tensor:
    """The nearest E2M1 value of each element (in ``x``'s dtype, sign kept), ties to the even code as
    compressed-tensors' ``cast_to_fp4`` and vLLM's ``cast_to_fp4`` break them (0.25, 1.25, 2.5, 5 down; 0.75, 1.75,
    3.5 up); magnitudes above 5 become 6 (NaN too: times ``sign(NaN)``, 0).

    E2M1's magnitudes are a grid of step 0.5 below 2, 1 below 4 and 2 above, and the even code is the even multiple
    of the step at every tie, so the magnitude divided by its step (exact: a power of two), rounded half to even and
    multiplied back is the rounding; ``fmin`` caps it at 6 (a NaN too). Bit for bit the steps' table (every float32 of
    both signs below 8 checked against it once; the tests check the bounds, their neighbours and the special values
    in every float dtype), in a quarter of ``bucketize``'s time and without its int64 index."""
    a = x.abs()
    step = (a >= 2.0).to(x.dtype).add_((a >= 4.0).to(x.dtype)).exp2_().mul_(0.5)  # 0.5, 1 or 2, exactly
    q = a.div_(step).round_().mul_(step)
    q = torch.fmin(q, torch.tensor(FP4_MAX, dtype=x.dtype, device=x.device), out=q)
    return q.mul_(torch.sign(x))


def quantize_fp8_activations(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` through FP8 e4m3 and back, as vLLM's ``QuantFP8.forward_native`` quantizes a linear's input (and its
    FP8 GEMM scales the product back): ``q = e4m3(clamp(float32(x) * (1 / s), -448, 448))``, then ``float32(q) * s``
    in ``x``'s dtype. ``s``: the stored static per-tensor ``scale``, or (``None``) each token's
    ``max(max|x| / 448, 1 / (448 * 512))``. ModelOpt's own fake quantizer multiplies by ``448 / amax`` instead of
    ``1 / (amax / 448)``: the two differ in a float32 rounding now and then."""
    xf = x.to(torch.float32)
    if scale is None:
        s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_DYNAMIC_SCALE)
    else:
        s = scale.to(torch.float32)
    q = (xf * s.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * s).to(x.dtype)


def _reciprocal(t: torch.Tensor) -> torch.Tensor:
    """vLLM's ``get_reciprocal``: ``1 / t``, with 0 for 0 (``1 / (t + 1e8)`` there)."""
    return 1.0 / (t + (t == 0) * 1e8)


def quantize_nvfp4_activations(x: torch.Tensor, global_scale: torch.Tensor, group_size: int = 16) -> torch.Tensor:
    """``x`` through NVFP4 and back, as vLLM's emulation of a W4A4 NVFP4 linear quantizes its input
    (``ref_nvfp4_quant`` and the dequantization of ``ref_nvfp4_quant_dequant``): ``g = global_scale`` (float32: for
    ModelOpt ``1 / input_scale``, for compressed-tensors' checkpoints ``input_global_scale``); per ``group_size``
    consecutive inputs ``s = float32(e4m3(clamp(g * (max|x| * (1 / 6)), -448, 448)))``, ``q =
    E2M1(clamp(float32(x) * r(s * r(g)), -6, 6))`` (``r``: a reciprocal that keeps 0 at 0; :func:`round_fp4`), and
    back as ``q * (s / g)`` in ``x``'s dtype. The last dimension must be a multiple of ``group_size``."""
    shape = x.shape
    if shape[-1] % group_size:
        raise ValueError(f"{shape[-1]} input columns are not a multiple of the NVFP4 group size {group_size}")
    g = global_scale.to(torch.float32).reshape(())
    xb = x.reshape(-1, shape[-1] // group_size, group_size)
    vmax = xb.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    s = torch.clamp(g * (vmax * (1 / FP4_MAX)), min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scaled = torch.clamp(xb.to(torch.float32) * _reciprocal(s * _reciprocal(g)), -FP4_MAX, FP4_MAX)
    return (round_fp4(scaled) * (s / g)).reshape(shape).to(x.dtype)


class QuantizedInputs(nn.Module):
    """A fast linear behind its format's input quantization: ``inner(quantize(x, **buffers))``. ``buffers`` (the
    stored scales, ``None`` where absent) move with the module; ``describe`` is its ``extra_repr``.

    ``exact_prompts``: the inner layer's prompts (many rows) through its exact weight in float32 (its
    ``prefill_dtype``), whatever the backend's prompt dtype: FP4 activations (NVFP4 W4A4) turn any rounding of their
    inputs (a bfloat16 GEMM's) into a step of a third of an input now and then, and the next layer's quantization
    carries it on. So a prompt's numbers are the exact path's, bit for bit; one token at a time the kernel's sums,
    each layer within float rounding of the exact one, still part from it at such steps."""

    def __init__(
        self,
        inner: nn.Module,
        quantize: Callable[..., torch.Tensor],
        describe: str,
        *,
        exact_prompts: bool = False,
        **buffers: torch.Tensor | None,
    ) -> None:
        super().__init__()
        if exact_prompts and hasattr(inner, "prefill_dtype"):
            setattr(inner, "prefill_dtype", torch.float32)  # noqa: B010 - an attribute of the engine's layers, not nn.Module's
        self.inner, self.quantize, self.describe = inner, quantize, describe
        self._inputs = tuple(buffers)
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor, persistent=False)
        self.in_features, self.out_features = int(inner.in_features), int(inner.out_features)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantize(x, **{name: getattr(self, name) for name in self._inputs})
        out: torch.Tensor = self.inner(q)
        return out

    def dequantize(self) -> torch.Tensor:
        out: torch.Tensor = self.inner.dequantize()  # type: ignore[operator]
        return out

    def same_inputs(self, other: QuantizedInputs) -> bool:
        """Whether ``other`` quantizes an input exactly as this does: the same function with equal arguments and
        equal scales (llm-compressor's NVFP4 gives q/k/v, and gate/up, one input global scale), so one quantized
        input serves both (:func:`quantize_alike`)."""
        mine, theirs = self.quantize, other.quantize
        if getattr(mine, "func", mine) is not getattr(theirs, "func", theirs):
            return False
        if getattr(mine, "args", ()) != getattr(theirs, "args", ()):
            return False
        if getattr(mine, "keywords", {}) != getattr(theirs, "keywords", {}) or self._inputs != other._inputs:
            return False
        for name in self._inputs:
            a, b = getattr(self, name), getattr(other, name)
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                return False
        return True

    def extra_repr(self) -> str:
        return self.describe


def quantize_alike(members: list[nn.Module]) -> bool:
    """Whether ``members`` are two or more :class:`QuantizedInputs` that quantize an input alike
    (:meth:`QuantizedInputs.same_inputs`), so that :func:`shared_inputs` may run them."""
    first = members[0]
    if len(members) < 2 or not all(isinstance(m, QuantizedInputs) for m in members):
        return False
    return all(cast(QuantizedInputs, first).same_inputs(cast(QuantizedInputs, m)) for m in members[1:])


def shared_inputs(members: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """``members`` (:func:`quantize_alike`) applied to ``x`` with its quantization done once: bit for bit the members
    called one by one (their hooks aside), the same quantized input reaching each inner layer."""
    first = cast(QuantizedInputs, members[0])
    q = first.quantize(x, **{name: getattr(first, name) for name in first._inputs})
    return [cast(torch.Tensor, cast(QuantizedInputs, m).inner(q)) for m in members]
