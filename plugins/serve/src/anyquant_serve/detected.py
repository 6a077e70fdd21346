"""The engine command for a checkpoint on disk: its format detected, its config and GGUF header read (this module
imports detection; core's ``anyquant_tools.engines``, which ``advise`` uses, does not)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anyquant_tools import VllmPlan, vllm_plan

__all__ = ["vllm_command"]


def vllm_command(path: str | Path, **kwargs: Any) -> VllmPlan:
    """:func:`vllm_plan` for a checkpoint on disk: its format detected, its config and GGUF header read. A Hub model
    id (``owner/name@revision``, read from the local cache) is given to vLLM as ``owner/name`` with ``--revision``, not
    with ``@revision`` in the id (which vLLM would take for part of the name); one naming a file inside the repository
    (a GGUF) as that file's path in the cache."""
    from anyquant import detect
    from anyquant.plugin import Probe, parse_model_id

    detection = detect(path)
    probe = Probe.open(path)
    context = None
    if probe.gguf:
        context = _gguf_context(probe)
    model: str | Path = path
    mid = None if Path(path).exists() else parse_model_id(path)
    if mid is not None:
        model = probe.path if mid.inside else mid.repo_id
        if mid.revision is not None and not mid.inside:
            kwargs.setdefault("revision", mid.revision)
    return vllm_plan(
        model,
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
