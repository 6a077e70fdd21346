"""A base class for quantized linear modules.

A subclass holds its packed tensors as buffers and implements :meth:`dequantize` (the exact
weight, ``[out_features, in_features]``). The base gives two execution modes:

- ``"reference"``: dequantize on every forward (memory stays at the packed size; slow);
- ``"dequantized"``: dequantize once at load, keep the weight in the compute dtype (dense speed
  and dense memory).

The ``cpu-fast`` backend runs a layer from its packed weight where the subclass describes it:
:meth:`QuantLinearBase.packed_layouts` (the layouts of :mod:`anyquant_runtime.layouts` it can be run from, in the
format's order of preference) and :meth:`QuantLinearBase.behind_inputs` (the format's input quantization around the
module the engine builds); :class:`anyquant_cpu.engine.FastCPUPlan` does the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .finite import check_finite

if TYPE_CHECKING:
    from .layouts import Layout

__all__ = ["QuantLinearBase"]

MODES = ("reference", "dequantized")


class QuantLinearBase(nn.Module):
    in_features: int
    out_features: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mode: str = "reference",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        self.in_features, self.out_features = in_features, out_features
        self.mode = mode
        self.compute_dtype = compute_dtype
        self.register_buffer("bias", None, persistent=False)
        self._weight: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def packed_layouts(self) -> Sequence[Layout] | str:
        """The packed layouts (:mod:`anyquant_runtime.layouts`) this layer's weight can be run from, in the format's
        order of preference, or why it must stay on its exact path (e.g. ``"the packed tensors were dropped"``). The
        CPU engine runs the first it can and falls back to the exact dequantized weight when none runs. The default:
        none (a format that describes no layout stays exact)."""
        return f"{type(self).__name__} describes no packed layout"

    def behind_inputs(self, fast: nn.Module) -> nn.Module:
        """``fast`` (the engine's module for one of :meth:`packed_layouts`) behind this format's input quantization,
        when it quantizes its inputs (a module that applies it, then ``fast``); the default: ``fast`` itself."""
        return fast

    def fast_cpu_unsupported(self) -> str | None:
        """Why the CPU engine cannot run this layer here (``None`` when it can): see
        :func:`anyquant_cpu.engine.fast_cpu_reasons`."""
        from .cpu import fast_reasons

        return fast_reasons(self)

    def to_fast_cpu(self, *, small_rows: int | None = None, prefill_dtype: torch.dtype | None = None) -> nn.Module:
        """This layer as the CPU engine runs it (:func:`anyquant_cpu.engine.fast_cpu_module`, as
        :meth:`~anyquant_cpu.engine.FastCPUPlan.convert` builds it); ``ValueError`` when it cannot."""
        from .cpu import fast_module

        fast = fast_module(self, small_rows=small_rows, prefill_dtype=prefill_dtype)
        if isinstance(fast, str):
            raise ValueError(f"{type(self).__name__} cannot run on the fast CPU path: {fast}")
        return fast

    def set_packed(self, bias: torch.Tensor | None = None, **tensors: torch.Tensor | None) -> QuantLinearBase:
        """Register the packed tensors (named as in ``packed_names``; ``None`` allowed) and the bias,
        then :meth:`finalize`: what every subclass constructor ends with."""
        unknown = set(tensors) - set(getattr(self, "packed_names", ()))
        if unknown:
            raise ValueError(f"{type(self).__name__} has no packed tensor {sorted(unknown)}")
        for name, tensor in tensors.items():
            if tensor is not None:
                check_finite(name, tensor)  # scales, EXL3's suh/svh: a NaN or inf one makes the layer's output NaN
            self.register_buffer(name, tensor)
        self.set_bias(bias)
        return self.finalize()

    def set_bias(self, bias: torch.Tensor | None) -> None:
        if bias is not None and (tuple(bias.shape) != (self.out_features,) or not bias.is_floating_point()):
            from anyquant.errors import CheckpointError

            raise CheckpointError(
                f"a bias of {str(bias.dtype).removeprefix('torch.')}{list(bias.shape)} for a layer of "
                f"{self.out_features} outputs (expected a float vector of that length)"
            )
        self.register_buffer("bias", None if bias is None else bias.to(self.compute_dtype), persistent=False)

    def finalize(self) -> QuantLinearBase:
        """Call once the packed buffers are set: caches the weight in ``dequantized`` mode and
        drops the packed buffers there (the weight is all that forward needs)."""
        if self.mode == "dequantized":
            self._weight = self.dequantize().to(self.compute_dtype).contiguous()
            self.drop_packed()
        return self

    def drop_packed(self) -> None:
        """Free the packed buffers (subclasses list them in ``packed_names``)."""
        for name in getattr(self, "packed_names", ()):
            if name in self._buffers:
                self._buffers[name] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._weight if self._weight is not None else self.dequantize().to(x.dtype)
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        stored: torch.Tensor | None = self._buffers.get("bias")
        bias = stored.to(x.dtype) if stored is not None else None
        return F.linear(x, weight, bias)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        if self._weight is not None:
            self._weight = fn(self._weight)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"
