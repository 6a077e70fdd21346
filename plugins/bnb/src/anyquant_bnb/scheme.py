"""A bitsandbytes checkpoint's quantized modules, from the headers (standard library only).

transformers saves a 4-bit linear ``P`` as ``P.weight`` (the packed codes, two a byte, in a ``[bytes, 1]`` tensor of the
``bnb_4bit_quant_storage`` dtype), ``P.weight.absmax`` (float32 per block, or uint8 codes with double quantization's
``P.weight.nested_absmax``/``nested_quant_map``), ``P.weight.quant_map`` (the 16 code values) and
``P.weight.quant_state.bitsandbytes__{nf4,fp4}`` (the rest of the quant state, JSON in a uint8 tensor); an 8-bit one as
``P.weight`` (int8 ``[out, in]``), ``P.SCB`` (float32 row maxima) and ``P.weight_format`` (0: row-major).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from anyquant.plugin import Probe

__all__ = ["BnbModule", "BnbScheme", "read_scheme"]

STATE_PREFIX = "quant_state.bitsandbytes__"
QUANT_TYPES = ("nf4", "fp4")
#: the largest serialized quant state read (its JSON is ~100-200 bytes)
MAX_STATE_BYTES = 4096


@dataclass(frozen=True)
class BnbModule:
    name: str
    bits: int  # 4 or 8
    quant_type: str | None  # "nf4"/"fp4" (4-bit), None (8-bit)
    nested: bool
    has_bias: bool
    state_tensor: str | None  # 4-bit: the serialized quant state's tensor name


@dataclass
class BnbScheme:
    modules: list[BnbModule] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def kinds(self) -> list[str]:
        return sorted(
            {f"{m.quant_type}{'+double quant' if m.nested else ''}" if m.bits == 4 else "int8" for m in self.modules}
        )


def read_scheme(probe: Probe) -> BnbScheme:
    t = probe.tensors
    scheme = BnbScheme()
    for weight in sorted(probe.modules_with("absmax")):  # "P.weight"
        name = weight.removesuffix(".weight")
        states = [n for n in t if n.startswith(f"{weight}.{STATE_PREFIX}")]
        w, absmax, qmap = t.get(weight), t[f"{weight}.absmax"], t.get(f"{weight}.quant_map")
        if w is None or qmap is None or len(states) != 1:
            scheme.problems.append(f"{name}: a 4-bit weight needs weight, absmax, quant_map and one quant_state")
            continue
        quant_type = states[0].rpartition("__")[2]
        if quant_type not in QUANT_TYPES:
            scheme.problems.append(f"{name}: quant state {quant_type!r} is not nf4 or fp4")
            continue
        nested = f"{weight}.nested_absmax" in t
        problems = []
        if len(w.shape) != 2 or w.shape[1] != 1 or w.dtype in ("I8",):
            problems.append(f"weight is {w.dtype}{list(w.shape)}; expected packed codes [bytes, 1]")
        if qmap.dtype != "F32" or tuple(qmap.shape) != (16,):
            problems.append(f"quant_map is {qmap.dtype}{list(qmap.shape)}; expected F32[16]")
        if len(absmax.shape) != 1 or absmax.dtype != ("U8" if nested else "F32"):
            problems.append(
                f"absmax is {absmax.dtype}{list(absmax.shape)}; expected {'U8' if nested else 'F32'}[blocks]"
            )
        if nested:
            nmap, nabs = t.get(f"{weight}.nested_quant_map"), t[f"{weight}.nested_absmax"]
            if nmap is None or nmap.dtype != "F32" or tuple(nmap.shape) != (256,):
                problems.append("double quantization without an F32[256] nested_quant_map")
            if nabs.dtype != "F32" or len(nabs.shape) != 1:
                problems.append(f"nested_absmax is {nabs.dtype}{list(nabs.shape)}; expected F32[blocks]")
        state = t[states[0]]
        if state.dtype != "U8" or len(state.shape) != 1 or not 0 < state.shape[0] <= MAX_STATE_BYTES:
            problems.append(f"the quant state is {state.dtype}{list(state.shape)}; expected U8 JSON of at most 4 KB")
        if problems:
            scheme.problems += [f"{name}: {p}" for p in problems]
            continue
        scheme.modules.append(BnbModule(name, 4, quant_type, nested, f"{name}.bias" in t, states[0]))
    for name in sorted(probe.modules_with("SCB")):
        w, scb = t.get(f"{name}.weight"), t[f"{name}.SCB"]
        if w is None or w.dtype != "I8" or len(w.shape) != 2:
            got = f"{w.dtype}{list(w.shape)}" if w is not None else "missing"
            scheme.problems.append(f"{name}: an 8-bit weight must be I8 [out, in] (it is {got})")
            continue
        if scb.dtype != "F32" or tuple(scb.shape) != (w.shape[0],):
            scheme.problems.append(f"{name}.SCB is {scb.dtype}{list(scb.shape)}; expected F32[{w.shape[0]}]")
            continue
        scheme.modules.append(BnbModule(name, 8, None, False, f"{name}.bias" in t, None))
    return scheme
