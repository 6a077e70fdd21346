"""An MLX checkpoint's quantized modules from config.json and the headers (standard library only).

mlx-lm writes each quantized module ``P`` (a linear, the embedding, a head) as ``P.weight`` (uint32 ``[out, in *
bits / 32]``, the values of a row one little-endian bit string), ``P.scales`` (``[out, in / group_size]``) and, in
the ``affine`` mode, ``P.biases``; config.json's ``quantization`` holds the default ``group_size``/``bits``/``mode`` and
an entry per module that differs (mixed recipes), by module path. A module without an entry gets the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from anyquant.plugin import ConfigError, Probe, UnsupportedFormatError

__all__ = ["MODES", "MlxModule", "MlxScheme", "read_scheme"]

#: mode -> (bits, group size, scale dtype) fixed by the mode (``None``: any, from the config)
MODES: Mapping[str, tuple[int | None, int | None, str | None]] = {
    "affine": (None, None, None),
    "mxfp4": (4, 32, "U8"),
    "nvfp4": (4, 16, "U8"),
    "mxfp8": (8, 32, "U8"),
}
BITS = frozenset({2, 3, 4, 5, 6, 8})
GROUPS = frozenset({16, 32, 64, 128})


@dataclass(frozen=True)
class Settings:
    bits: int
    group_size: int
    mode: str


@dataclass(frozen=True)
class MlxModule:
    name: str
    settings: Settings
    out_features: int
    in_features: int
    stacked: int | None  # experts stacked in a leading dimension (mlx-lm's switch_mlp), else None


@dataclass
class MlxScheme:
    default: Settings | None
    modules: list[MlxModule] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def describe(self) -> str:
        kinds = sorted({f"{m.settings.mode} {m.settings.bits}-bit g{m.settings.group_size}" for m in self.modules})
        return ", ".join(kinds)


def _settings(raw: Any, where: str, base: Settings | None) -> Settings:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} is {type(raw).__name__}; expected an object with bits and group_size")
    mode = raw.get("mode", base.mode if base else "affine")
    if mode not in MODES:
        raise UnsupportedFormatError(f"{where}.mode is {mode!r}; mlx-lm writes {', '.join(MODES)}")
    bits, gs = raw.get("bits", base.bits if base else None), raw.get("group_size", base.group_size if base else None)
    if isinstance(bits, bool) or bits not in BITS:
        raise ConfigError(f"{where}.bits is {bits!r}; expected one of {sorted(BITS)}")
    if isinstance(gs, bool) or gs not in GROUPS:
        raise ConfigError(f"{where}.group_size is {gs!r}; expected one of {sorted(GROUPS)}")
    fixed_bits, fixed_gs, _ = MODES[mode]
    if (fixed_bits and bits != fixed_bits) or (fixed_gs and gs != fixed_gs):
        raise ConfigError(f"{where}: mode {mode!r} has {fixed_bits} bits in groups of {fixed_gs}, not {bits}/{gs}")
    return Settings(int(bits), int(gs), str(mode))


def quantization(probe: Probe) -> Mapping[str, Any] | None:
    cfg = probe.config or {}
    q = cfg.get("quantization")
    if q is None:
        qc = cfg.get("quantization_config")
        q = qc if isinstance(qc, Mapping) and "quant_method" not in qc and "bits" in qc else None
    return q if isinstance(q, Mapping) else None


def read_scheme(probe: Probe) -> MlxScheme:
    q = quantization(probe)
    default = _settings(q, "config.json quantization", None) if q is not None and "bits" in q else None
    scheme = MlxScheme(default)
    t = probe.tensors
    for name in sorted(probe.modules_with("scales")):
        w, s, b = t.get(f"{name}.weight"), t[f"{name}.scales"], t.get(f"{name}.biases")
        if w is None or w.dtype != "U32":
            continue  # another format's scales (GPTQ/AWQ have qweight): not MLX's
        entry = q.get(name) if q is not None else None
        if entry is not None:
            settings = _settings(entry, f"config.json quantization[{name!r}]", default)
        elif default is not None:
            settings = default
        else:
            scheme.problems.append(f"{name}: quantized, and config.json has no quantization settings for it")
            continue
        problem = _check(settings, w.shape, s.dtype, s.shape, b)
        if problem:
            scheme.problems.append(f"{name}: {problem}")
            continue
        out, cols = w.shape[-2], w.shape[-1]
        stacked = w.shape[0] if len(w.shape) == 3 else None
        scheme.modules.append(MlxModule(name, settings, out, cols * 32 // settings.bits, stacked))
    return scheme


def _check(st: Settings, wshape: tuple[int, ...], sdtype: str, sshape: tuple[int, ...], b: Any) -> str | None:
    if len(wshape) not in (2, 3) or tuple(sshape[:-1]) != tuple(wshape[:-1]) or len(sshape) != len(wshape):
        return f"weight {list(wshape)} and scales {list(sshape)} do not share their leading dimensions"
    cols, groups = wshape[-1], sshape[-1]
    if cols * 32 % st.bits or cols * 32 // st.bits != groups * st.group_size:
        return (
            f"weight has {cols} uint32 columns ({cols * 32 / st.bits:g} values at {st.bits} bits), scales {groups} "
            f"groups of {st.group_size}: the settings ({st.mode} {st.bits}-bit g{st.group_size}) and shapes disagree"
        )
    want = MODES[st.mode][2]
    if st.mode == "affine":
        if sdtype not in ("F16", "BF16", "F32"):
            return f"affine scales are {sdtype}; expected F16, BF16 or F32"
        if b is None or b.dtype != sdtype or tuple(b.shape) != tuple(sshape):
            return "affine mode needs biases of the scales' dtype and shape"
    elif sdtype != want:
        return f"{st.mode} scales are {sdtype}; expected {want}"
    return None
