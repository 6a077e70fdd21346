"""GPTQ tensor signature, read from headers only (no torch)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import repeat
from operator import add, attrgetter, floordiv, itemgetter, mul
from typing import Any, NamedTuple

from anyquant.plugin import Probe

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
        """How many modules have each bit width, in order of first appearance."""
        return dict(Counter(map(_bits, self.modules)))


def _bits_from_rows(rows: int, k: int) -> int | None:
    for b in PACKED_BITS:
        if rows * 32 == k * b:
            return b
    return None


def read_signature(probe: Probe) -> GPTQSignature:
    """Every ``P.qweight`` that has the GPTQ shape ``[K*b/32, N]`` with ``P.g_idx [K]``,
    ``P.scales [G, N]``, ``P.qzeros [G, N*b/32]``; plus Marlin-packed ``P.B``/``P.s`` modules."""
    t = probe.tensors
    prefixes = tuple(probe.modules_with("qweight"))
    sig = GPTQSignature(modules=_consistent_modules(prefixes, t))
    if len(sig.modules) != len(prefixes):
        sig = GPTQSignature()
        for prefix in prefixes:
            _check_module(prefix, t, sig)
    sig.marlin = [prefix for prefix in probe.modules_with("B") if f"{prefix}.s" in t]
    return sig


def _consistent_modules(prefixes: tuple[str, ...], t: Any) -> list[GPTQModule]:
    """The modules, computed a column at a time, when every prefix has all four tensors with
    consistent shapes (the usual case: detection time on a 70B checkpoint is dominated by this);
    an empty list otherwise, and :func:`_check_module` walks the prefixes one by one to say which
    module is wrong and how."""
    if not prefixes:
        return []
    qw, qz, sc, gi = (list(map(t.get, map(add, prefixes, repeat(s)))) for s in _PARTS)
    if None in qz or None in sc or None in gi:
        return []
    qws, qzs, scs, gis = (list(map(_shape, c)) for c in (qw, qz, sc, gi))
    if (
        set(map(len, qws)) != {2}
        or set(map(len, qzs)) != {2}
        or set(map(len, scs)) != {2}
        or set(map(len, gis)) != {1}
        or set(map(_dtype, qw)) != {"I32"}
        or set(map(_dtype, gi)) != {"I32"}
    ):
        return []
    k, n, rows, groups = list(map(_first, gis)), list(map(_second, qws)), list(map(_first, qws)), list(map(_first, scs))
    if 0 in k:
        return []
    rows32 = list(map(mul, rows, repeat(32)))
    bits = list(map(floordiv, rows32, k))
    if (
        not _PACKED.issuperset(bits)
        or list(map(mul, bits, k)) != rows32
        or list(map(_second, scs)) != n
        or list(map(_first, qzs)) != groups
        or list(map(mul, map(_second, qzs), repeat(32))) != list(map(mul, n, bits))
    ):
        return []
    has_bias = map(t.__contains__, map(add, prefixes, repeat(".bias")))
    return list(map(_new_row, repeat(GPTQModule), zip(prefixes, k, n, bits, groups, has_bias, strict=True)))


def _check_module(prefix: str, t: Any, sig: GPTQSignature) -> None:
    """One module's tensors, checked one at a time: appends the module (with any problem found)
    or only the problem, or nothing when a tensor is missing."""
    qw, qz, sc, gi = (t.get(prefix + s) for s in _PARTS)
    if qw is None or gi is None or qz is None or sc is None:
        return
    if len(qw.shape) != 2 or len(gi.shape) != 1 or len(sc.shape) != 2 or len(qz.shape) != 2:
        sig.problems.append(f"{prefix}: qweight/qzeros/scales/g_idx have unexpected ranks")
        return
    k = gi.shape[0]
    n = qw.shape[1]
    bits = _bits_from_rows(qw.shape[0], k) if qw.dtype == "I32" else None
    if bits is None:
        sig.problems.append(f"{prefix}: qweight {qw.dtype}{list(qw.shape)} does not pack K={k} at 2/3/4/8 bits")
        return
    groups = sc.shape[0]
    if sc.shape[1] != n:
        sig.problems.append(f"{prefix}: scales {list(sc.shape)} do not match N={n}")
    if qz.shape[0] != groups or qz.shape[1] * 32 != n * bits:
        sig.problems.append(f"{prefix}: qzeros {list(qz.shape)} do not match [{groups}, {n}*{bits}/32]")
    if gi.dtype != "I32":
        sig.problems.append(f"{prefix}: g_idx is {gi.dtype}, expected I32")
    sig.modules.append(GPTQModule(prefix, k, n, bits, groups, f"{prefix}.bias" in t))


_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")
_PACKED = frozenset(PACKED_BITS)
_shape = attrgetter("shape")
_dtype = attrgetter("dtype")
_bits = attrgetter("bits")
_first = itemgetter(0)
_second = itemgetter(1)
_new_row = tuple.__new__  # a GPTQModule from a row tuple, without NamedTuple's Python-level __new__


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
