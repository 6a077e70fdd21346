"""What core asks of the CPU engine: the module the ``cpu-fast`` backend names as its
:attr:`~anyquant.protocols.BackendSpec.engine`, reached through :mod:`anyquant_runtime.cpu` (core never imports this
distribution). The engine's conversions (:mod:`anyquant_cpu.engine`) and the compiled decode step
(:mod:`anyquant_cpu.step`) behind one list of names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .engine import (
    DEFAULT_SMALL_ROWS,
    FastCPUPlan,
    FastInt4Linear,
    bf16_head_status,
    block_kernel_is_fast,
    fast_cpu_capable,
    fast_cpu_module,
    fast_cpu_reasons,
    fast_linear,
    kv_cache_dtype,
    layout_kinds_run,
    layouts_run,
)

__all__ = [
    "DEFAULT_SMALL_ROWS",
    "FastCPUPlan",
    "FastInt4Linear",
    "bf16_head_status",
    "block_kernel_is_fast",
    "decode_step",
    "fast_cpu_capable",
    "fast_cpu_module",
    "fast_cpu_reasons",
    "fast_linear",
    "kv_cache_dtype",
    "layout_kinds_run",
    "layouts_run",
    "plan",
]


def decode_step(model: nn.Module) -> Any:
    """The native decoder ``model``'s compiled decode step (:class:`anyquant_cpu.step.DecodeStep`), or ``None`` when
    nothing in it compiles."""
    from .step import DecodeStep

    return DecodeStep.build(model)


def plan(extra: Mapping[str, Any]) -> FastCPUPlan:
    """One load's plan from its options (a bad one refused before anything is read): what the runtime's loader base
    asks of every registered backend's engine (:meth:`anyquant_runtime.loaders.TransformersLoader.start_fast`)."""
    return FastCPUPlan.from_options(extra)
