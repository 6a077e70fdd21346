"""The MXFP4 checkpoint's layout from its headers: which tensors are packed, their shapes, and what disagrees.

gpt-oss's format (``quant_method: "mxfp4"``, transformers' ``integrations/mxfp4.py``): each packed weight ``W`` of
the experts module is stored as two tensors, ``W_blocks`` U8 ``[E, out, in/32, 16]`` (32 E2M1 codes per block, two a
byte: the low nibble is the even element) and ``W_scales`` U8 ``[E, out, in/32]`` (one E8M0 exponent per block,
``2**(s - 127)``); ``W_bias`` stays 16-bit. The model's parameter ``W`` is the transposed ``[E, in, out]``
(``GptOssExperts``: ``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``). Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from anyquant.plugin import ConfigError, Probe

__all__ = ["BLOCK", "MXFP4Scheme", "MXFP4Tensor", "looks_mxfp4", "read_scheme"]

#: elements per block (one scale each), and bytes per block (two codes a byte)
BLOCK = 32
BLOCK_BYTES = BLOCK // 2
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
#: the dtypes of the scale exponents (gpt-oss writes U8; F8_E8M0 is the same byte, typed)
SCALE_DTYPES = ("U8", "F8_E8M0")
#: config.json dtype -> the dtype transformers decodes into (the model's parameter dtype)
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


@dataclass(frozen=True)
class MXFP4Tensor:
    """One packed weight: the model's parameter ``name`` ``[experts, in_features, out_features]``, stored as
    ``blocks`` ``[experts, out_features, in_features / 32, 16]`` and ``scales`` ``[experts, out_features,
    in_features / 32]``."""

    name: str
    blocks: str
    scales: str
    experts: int
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """The decoded parameter's shape (transformers' module layout)."""
        return self.experts, self.in_features, self.out_features


@dataclass
class MXFP4Scheme:
    #: the dtype transformers decodes into (config.json ``dtype``/``torch_dtype``; bfloat16 by default)
    dtype: str
    modules_to_not_convert: tuple[str, ...] = ()
    tensors: list[MXFP4Tensor] = field(default_factory=list)
    #: tensors that disagree with each other or with the config (a FormatConflictError at load)
    problems: list[str] = field(default_factory=list)
    #: packed tensors of a layout anyquant does not read (an UnsupportedFormatError at load)
    unsupported: list[str] = field(default_factory=list)

    def describe(self) -> str:
        experts = sorted({t.experts for t in self.tensors})
        return f"{len(self.tensors)} packed expert weights ({'/'.join(map(str, experts))} experts), 32-element blocks"


def _pairs(probe: Probe) -> list[tuple[str, str, str]]:
    """``(base, blocks, scales)`` names for every ``<base>_blocks`` tensor (``scales`` may be absent)."""
    out = []
    for suffix in sorted(probe.suffixes()):
        if not suffix.endswith(BLOCKS_SUFFIX) or suffix == BLOCKS_SUFFIX:
            continue
        leaf = suffix.removesuffix(BLOCKS_SUFFIX)
        for prefix in sorted(probe.modules_with(suffix)):
            base = f"{prefix}.{leaf}"
            out.append((base, base + BLOCKS_SUFFIX, base + SCALES_SUFFIX))
    return out


def looks_mxfp4(probe: Probe) -> bool:
    """A checkpoint without a quant_method is MXFP4's when some ``<W>_blocks`` U8 has a ``<W>_scales`` U8 beside it."""
    t = probe.tensors
    return any(t[b].dtype == "U8" and s in t and t[s].dtype in SCALE_DTYPES for _, b, s in _pairs(probe))


def _not_converted(qc: Mapping[str, Any]) -> tuple[str, ...]:
    raw = qc.get("modules_to_not_convert")
    if raw is None:
        return ()
    if not isinstance(raw, Sequence) or isinstance(raw, str) or not all(isinstance(v, str) for v in raw):
        raise ConfigError(
            f"config.json: quantization_config.modules_to_not_convert is {raw!r}; expected a list of module names"
        )
    return tuple(raw)


def read_scheme(probe: Probe) -> MXFP4Scheme:
    """The packed tensors and every disagreement among them; a malformed config field is a :class:`ConfigError`."""
    qc = probe.quantization_config or {}
    not_converted = _not_converted(qc)
    raw_dtype = (probe.config or {}).get("dtype") or (probe.config or {}).get("torch_dtype") or "bfloat16"
    scheme = MXFP4Scheme(DTYPES.get(str(raw_dtype), "bfloat16"), not_converted)
    t = probe.tensors
    paired: set[str] = set()
    for base, b_name, s_name in _pairs(probe):
        blocks, scales = t[b_name], t.get(s_name)
        if scales is None:
            scheme.problems.append(f"{b_name} has no {s_name.rpartition('.')[2]} beside it")
            continue
        paired.add(s_name)
        shape = tuple(blocks.shape)
        if blocks.dtype != "U8":
            scheme.problems.append(f"{b_name} is {blocks.dtype}; expected U8 (two E2M1 codes a byte)")
            continue
        if scales.dtype not in SCALE_DTYPES:
            scheme.problems.append(f"{s_name} is {scales.dtype}; expected U8 (E8M0 exponents)")
            continue
        if len(shape) < 3 or shape[-1] != BLOCK_BYTES or 0 in shape:
            scheme.problems.append(
                f"{b_name} is {list(shape)}; expected [..., out, in/{BLOCK}, {BLOCK_BYTES}] ({BLOCK}-element blocks)"
            )
            continue
        if tuple(scales.shape) != shape[:-1]:
            scheme.problems.append(
                f"{s_name} is {list(scales.shape)}; {b_name} {list(shape)} needs one scale per block: {list(shape[:-1])}"
            )
            continue
        if len(shape) != 4:
            scheme.unsupported.append(
                f"{b_name} is {list(shape)}: anyquant reads MXFP4 expert stacks [experts, out, in/{BLOCK}, "
                f"{BLOCK_BYTES}] (gpt-oss)"
            )
            continue
        scheme.tensors.append(MXFP4Tensor(base, b_name, s_name, shape[0], shape[1], shape[2] * BLOCK))
    stray = sorted(
        n for n, ti in t.items() if n.endswith(SCALES_SUFFIX) and ti.dtype in SCALE_DTYPES and n not in paired
    )
    if stray:
        scheme.problems.append(f"{len(stray)} {SCALES_SUFFIX} tensors without their {BLOCKS_SUFFIX} (e.g. {stray[0]})")
    if probe.quant_method == "mxfp4" and not scheme.tensors and not scheme.problems and not scheme.unsupported:
        scheme.problems.append("the config says mxfp4, but no tensor is a U8 *_blocks with its *_scales")
    return scheme
