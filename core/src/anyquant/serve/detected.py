"""The engine command for a checkpoint on disk: its format detected, its config and GGUF header read (this module
imports detection; :mod:`anyquant.serve.engines`, which :mod:`anyquant.tools.advise` uses, does not)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .engines import VllmPlan, vllm_plan

__all__ = ["vllm_command"]


def vllm_command(path: str | Path, **kwargs: Any) -> VllmPlan:
    """:func:`vllm_plan` for a checkpoint on disk: its format detected, its config and GGUF header read."""
    from ..api import detect
    from ..probe import Probe

    detection = detect(path)
    probe = Probe.open(path)
    context = None
    if probe.gguf:
        context = _gguf_context(probe)
    return vllm_plan(
        path,
        detection.format,
        config=probe.config,
        quantization_config=probe.quantization_config,
        gguf_context=context,
        **kwargs,
    )


def _gguf_context(probe: Any) -> int | None:
    header = probe.gguf[0]
    meta = getattr(header, "metadata", {}) or {}
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.context_length") if arch else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
