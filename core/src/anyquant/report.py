"""``anyquant inspect``: a per-module table and totals, from headers only."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .headers import SAFETENSORS_DTYPE_BITS
from .probe import Probe
from .protocols import Detection, ModuleInfo

__all__ = [
    "EXPERTS_KEYS",
    "EXPERTS_PER_TOKEN_KEYS",
    "Report",
    "bits_per_weight",
    "build_report",
    "coded_rows",
    "dense_rows",
    "natural_key",
    "tensors_by_module",
]

#: a MoE config's routed experts per layer, and experts per token, under the names families use
EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token")


@dataclass
class Report:
    detection: Detection
    modules: list[ModuleInfo]
    totals: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "detection": self.detection.to_dict(),
            "modules": [
                {
                    "name": m.name,
                    "format": m.format,
                    "shape": list(m.shape),
                    "bits": m.bits,
                    "group_size": m.group_size,
                    "bytes": m.nbytes,
                    **({"extra": dict(m.extra)} if m.extra else {}),
                }
                for m in self.modules
            ],
            "totals": self.totals,
        }


def tensors_by_module(probe: Probe) -> dict[str, list[Any]]:
    """The probe's tensors grouped by module prefix (the name before the last dot)."""
    groups: dict[str, list[Any]] = {}
    for t in probe.tensors.values():
        groups.setdefault(t.name.rsplit(".", 1)[0], []).append(t)
    return groups


def dense_rows(
    probe: Probe, skip: Collection[str] | None = None, groups: Mapping[str, list[Any]] | None = None
) -> list[ModuleInfo]:
    """One row per tensor-owning module that no quantized row covers (weights, norms, embeddings).
    ``groups``: :func:`tensors_by_module`'s result when the caller has it already."""
    skip = set(skip or ())
    rows = []
    for prefix, ts in sorted((groups if groups is not None else tensors_by_module(probe)).items()):
        if prefix in skip:
            continue
        weight = next((t for t in ts if t.name.endswith(".weight")), ts[0])
        rows.append(
            ModuleInfo(
                name=prefix,
                format="dense",
                shape=weight.shape,
                bits=float(SAFETENSORS_DTYPE_BITS.get(weight.dtype, 0)),
                group_size=None,
                nbytes=sum(t.nbytes for t in ts),
                extra={"dtype": weight.dtype},
            )
        )
    return rows


def coded_rows(probe: Probe, detection: Detection) -> list[ModuleInfo]:
    """Rows for a loader without ``inspect()``: modules holding integer codes are the detected format's
    (bits and group size unknown, shape of the largest code tensor as stored), the rest dense. Never a
    quantized module shown as dense because its plugin describes nothing."""
    from .builtin import integer_tensors

    if detection.format == "dense":
        return dense_rows(probe)
    groups = tensors_by_module(probe)
    coded: dict[str, list[Any]] = {}
    for name in integer_tensors(probe):
        coded.setdefault(name.rsplit(".", 1)[0], []).append(probe.tensors[name])
    rows = []
    for prefix, codes in sorted(coded.items()):
        ts = groups[prefix]
        largest = max(codes, key=lambda t: t.nbytes)
        rows.append(
            ModuleInfo(
                name=prefix,
                format=detection.format,
                shape=largest.shape,
                bits=None,
                group_size=None,
                nbytes=sum(t.nbytes for t in ts),
                extra={"note": "the plugin has no inspect(): shape as stored, bits unknown"},
            )
        )
    return rows + dense_rows(probe, skip=set(coded), groups=groups)


def bits_per_weight(modules: Iterable[Any]) -> float | None:
    """Bits per weight of a checkpoint's quantized modules: every byte they store (codes, scales, zero points,
    group indices) x 8, over the number of weights they stand for (their logical shapes), to 4 decimals. Dense
    rows (embeddings, norms, an unquantized head) do not count, nor a row whose bits its plugin does not know
    (its shape is the packed tensor's). ``anyquant inspect`` and ``anyquant estimate`` both report this; it is
    the quantity ``estimate --bits`` takes. ``None`` when no module is quantized."""
    rows = [m for m in modules if m.format != "dense" and m.bits is not None]
    weights = sum(_numel(m.shape) for m in rows)
    return round(8 * sum(m.nbytes for m in rows) / weights, 4) if weights else None


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that reads the numbers in a name as numbers: ``blk.2`` before ``blk.10``."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)


def build_report(probe: Probe, detection: Detection, loader: Any | None) -> Report:
    describe = getattr(loader, "inspect", None)
    rows: list[ModuleInfo] = list(describe(probe, detection)) if callable(describe) else coded_rows(probe, detection)
    rows.sort(key=lambda m: natural_key(m.name))
    quant = [m for m in rows if m.format != "dense"]
    params = sum(_numel(m.shape) for m in rows)
    files = [h.size for h in probe.safetensors] + [g.size for g in probe.gguf]
    parts = detection.details.get("parts") if probe.gguf else None
    if isinstance(parts, list) and len(parts) > 1:  # a GGUF model split by gguf-split: every part's bytes
        files = [(probe.root / str(name)).stat().st_size for name in parts]
    totals = {
        "modules": len(rows),
        "quantized_modules": len(quant),
        "parameters": params,
        "bytes_on_disk": sum(files),
        "tensor_bytes": sum(m.nbytes for m in rows),
        "avg_bits_quantized": bits_per_weight(rows),
        "avg_bits_all": round(8 * sum(m.nbytes for m in rows) / params, 4) if params else None,
    }
    totals.update(_experts(probe, rows, params))
    return Report(detection, rows, totals)


def _experts(probe: Probe, rows: list[ModuleInfo], params: int) -> dict[str, Any]:
    """A mixture-of-experts model's experts per layer, experts per token and the parameters one token reads
    (every non-expert module and ``experts_per_token / experts`` of the experts'); empty for other models."""
    cfg = probe.config or {}
    count = next((cfg[k] for k in EXPERTS_KEYS if cfg.get(k)), None)
    per_token = next((cfg[k] for k in EXPERTS_PER_TOKEN_KEYS if cfg.get(k)), None)
    if not isinstance(count, int) or not isinstance(per_token, int) or not 0 < per_token <= count:
        return {}
    in_experts = sum(_numel(m.shape) for m in rows if ".experts." in m.name)
    if not in_experts:
        return {}
    return {
        "experts": count,
        "experts_per_token": per_token,
        "active_parameters": params - in_experts + in_experts * per_token // count,
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
