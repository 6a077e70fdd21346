"""GPTQ tensor signature, read from headers only (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from anyquant.probe import Probe

__all__ = ["GPTQModule", "GPTQSignature", "read_signature"]

PACKED_BITS = (2, 3, 4, 8)


class GPTQModule(NamedTuple):
    name: str
    in_features: int
    out_features: int
    bits: int
    groups: int
    has_bias: bool

    @property
    def group_size(self) -> int:
        return -1 if self.groups == 1 else self.in_features // self.groups


@dataclass
class GPTQSignature:
    modules: list[GPTQModule] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    marlin: list[str] = field(default_factory=list)

    def bits_histogram(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for m in self.modules:
            out[m.bits] = out.get(m.bits, 0) + 1
        return out


def _bits_from_rows(rows: int, k: int) -> int | None:
    for b in PACKED_BITS:
        if rows * 32 == k * b:
            return b
    return None


def read_signature(probe: Probe) -> GPTQSignature:
    """Every ``P.qweight`` that has the GPTQ shape ``[K*b/32, N]`` with ``P.g_idx [K]``,
    ``P.scales [G, N]``, ``P.qzeros [G, N*b/32]``; plus Marlin-packed ``P.B``/``P.s`` modules."""
    sig = GPTQSignature()
    t = probe.tensors
    for prefix in probe.modules_with("qweight"):
        qw, qz, sc, gi = (
            t.get(prefix + ".qweight"),
            t.get(prefix + ".qzeros"),
            t.get(prefix + ".scales"),
            t.get(prefix + ".g_idx"),
        )
        if qw is None or gi is None or qz is None or sc is None:
            continue
        if len(qw.shape) != 2 or len(gi.shape) != 1 or len(sc.shape) != 2 or len(qz.shape) != 2:
            sig.problems.append(f"{prefix}: qweight/qzeros/scales/g_idx have unexpected ranks")
            continue
        k = gi.shape[0]
        n = qw.shape[1]
        bits = _bits_from_rows(qw.shape[0], k) if qw.dtype == "I32" else None
        if bits is None:
            sig.problems.append(f"{prefix}: qweight {qw.dtype}{list(qw.shape)} does not pack K={k} at 2/3/4/8 bits")
            continue
        groups = sc.shape[0]
        if sc.shape[1] != n:
            sig.problems.append(f"{prefix}: scales {list(sc.shape)} do not match N={n}")
        if qz.shape[0] != groups or qz.shape[1] * 32 != n * bits:
            sig.problems.append(f"{prefix}: qzeros {list(qz.shape)} do not match [{groups}, {n}*{bits}/32]")
        if gi.dtype != "I32":
            sig.problems.append(f"{prefix}: g_idx is {gi.dtype}, expected I32")
        sig.modules.append(GPTQModule(prefix, k, n, bits, groups, f"{prefix}.bias" in t))
    for prefix in probe.modules_with("B"):
        if f"{prefix}.s" in t:
            sig.marlin.append(prefix)
    return sig


def config_summary(qc: Any) -> dict[str, Any]:
    """The GPTQ keys of a quantization config (any producer's spelling)."""
    if qc is None:
        return {}
    out: dict[str, Any] = {}
    for key in ("bits", "group_size", "sym", "desc_act", "lm_head", "pack_dtype", "true_sequential"):
        if key in qc:
            out[key] = qc[key]
    fmt = qc.get("checkpoint_format", qc.get("format"))
    if isinstance(fmt, str):
        out["checkpoint_format"] = fmt.lower()
    if qc.get("is_marlin_format"):
        out["checkpoint_format"] = "marlin"
    meta = qc.get("meta")
    if meta is not None and hasattr(meta, "get"):
        quantizer = meta.get("quantizer")
        if isinstance(quantizer, str):
            out["quantizer"] = [quantizer]
        elif isinstance(quantizer, (list, tuple)):  # anything else names no producer
            out["quantizer"] = [q for q in quantizer if isinstance(q, str)]
    dynamic = qc.get("dynamic")
    if dynamic:
        if hasattr(dynamic, "items") and all(isinstance(k, str) and hasattr(v, "items") for k, v in dynamic.items()):
            out["dynamic"] = {k: dict(v) for k, v in dynamic.items()}
        else:
            out["config_problems"] = ["quantization_config.dynamic must map module patterns to objects of overrides"]
    return out
