"""The FP8 checkpoint's layout from its headers: which modules are FP8, their block size, and what disagrees.

transformers' FineGrainedFP8 format (``quant_method: "fp8"``): every quantized linear stores ``weight`` as
float8_e4m3fn ``[out, in]`` and ``weight_scale_inv`` float32, either ``[ceil(out/bh), ceil(in/bw)]`` for
``weight_block_size: [bh, bw]`` or one value (``weight_block_size: null``). Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from anyquant.plugin import ConfigError, Probe, UnsupportedFormatError

__all__ = ["FP8Module", "FP8Scheme", "read_scheme"]

DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


@dataclass(frozen=True)
class FP8Module:
    name: str
    out_features: int
    in_features: int
    has_bias: bool


@dataclass
class FP8Scheme:
    block: tuple[int, int] | None
    activation_scheme: str
    #: the dtype transformers dequantizes to (the model's: config.json ``dtype``/``torch_dtype``)
    dtype: str
    modules: list[FP8Module] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.block:
            return f"{self.block[0]}x{self.block[1]} blocks, {self.activation_scheme} activations"
        return f"one scale per tensor, {self.activation_scheme} activations"


def _block(qc: Mapping[str, Any]) -> tuple[int, int] | None:
    raw = qc.get("weight_block_size")
    if raw is None:
        return None
    if (
        not isinstance(raw, Sequence)
        or isinstance(raw, str)
        or len(raw) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 16 for v in raw)
    ):
        raise ConfigError(f"quantization_config.weight_block_size is {raw!r}; expected [rows, cols] or null")
    return int(raw[0]), int(raw[1])


def read_scheme(probe: Probe) -> FP8Scheme:
    qc = probe.quantization_config or {}
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedFormatError(f"quantization_config.fmt is {fmt!r}: anyquant reads FP8 e4m3 weights")
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise ConfigError(f"quantization_config.activation_scheme is {act!r}; expected 'dynamic' or 'static'")
    raw_dtype = (probe.config or {}).get("dtype") or (probe.config or {}).get("torch_dtype") or "bfloat16"
    dtype = DTYPES.get(str(raw_dtype), "bfloat16")
    scheme = FP8Scheme(_block(qc), act, dtype)
    t = probe.tensors
    for prefix in sorted(probe.modules_with("weight_scale_inv")):
        w, s = t.get(f"{prefix}.weight"), t[f"{prefix}.weight_scale_inv"]
        if w is None:
            scheme.problems.append(f"{prefix}: weight_scale_inv without weight")
            continue
        if w.dtype != "F8_E4M3" or len(w.shape) != 2:
            scheme.problems.append(f"{prefix}.weight is {w.dtype}{list(w.shape)}; expected F8_E4M3 [out, in]")
            continue
        if s.dtype not in ("F32", "BF16", "F16"):
            scheme.problems.append(f"{prefix}.weight_scale_inv is {s.dtype}; expected F32")
            continue
        out, inp = w.shape
        if scheme.block is None:
            want: tuple[tuple[int, ...], ...] = ((), (1,), (1, 1))
        else:
            want = ((math.ceil(out / scheme.block[0]), math.ceil(inp / scheme.block[1])),)
        if tuple(s.shape) not in want:
            what = f"{scheme.block[0]}x{scheme.block[1]} blocks" if scheme.block else "one scale per tensor"
            scheme.problems.append(
                f"{prefix}.weight_scale_inv is {list(s.shape)}; {what} of [{out}, {inp}] need {list(want[0])}"
            )
            continue
        scheme.modules.append(FP8Module(prefix, out, inp, f"{prefix}.bias" in t))
    stray = [
        n
        for n, ti in t.items()
        if ti.dtype == "F8_E4M3" and n.rpartition(".")[0] not in probe.modules_with("weight_scale_inv")
    ]
    if stray:
        scheme.problems.append(f"{len(stray)} FP8 tensors without a weight_scale_inv (e.g. {stray[0]})")
    if probe.quant_method == "fp8" and not scheme.modules and not scheme.problems:
        scheme.problems.append("the config says fp8, but no tensor is FP8 with a weight_scale_inv")
    return scheme
