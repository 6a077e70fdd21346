"""compressed-tensors' ``quantization_config`` and every quantized module's storage, read from headers only.

The tensors decide what each module is (its :class:`Storage`: packed integers, int8, FP8, NVFP4, MXFP4); the
config's ``config_groups`` say the parameters the tensors cannot (bits, symmetry, strategy, activation quantization)
and are cross-checked against them. Standard library and ``regex`` only: no torch, no compressed-tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from anyquant.plugin import ConfigError, Probe, UnsupportedFormatError

__all__ = [
    "FORMATS",
    "CTConfig",
    "Group",
    "ModuleSpec",
    "QArgs",
    "read_modules",
]

#: compressed-tensors' ``CompressionFormat`` values (0.20): what anyquant decodes, and what it names and refuses
WEIGHT_FORMATS = frozenset(
    {
        "pack-quantized",
        "int-quantized",
        "float-quantized",
        "naive-quantized",
        "nvfp4-pack-quantized",
        "mxfp4-pack-quantized",
    }
)
FORMATS = WEIGHT_FORMATS | {"dense", "mixed-precision"}
REFUSED_FORMATS = {
    "marlin-24": "a GPU-only 2:4 sparse layout (Marlin kernels)",
    "mxfp6-pack-quantized": "MXFP6 weights, not decoded by anyquant yet",
    "mxfp8-quantized": "MXFP8 weights, not decoded by anyquant yet",
    "sparse-bitmask": "a sparsity layout, which compressed-tensors names in sparsity_config.format",
    "sparse-24-bitmask": "a sparsity layout, which compressed-tensors names in sparsity_config.format",
}
STRATEGIES = frozenset({"tensor", "channel", "group", "block", "token", "tensor_group", "attn_head"})
#: regex targets are matched under this time limit each (a pattern from an untrusted config cannot hang a load)
REGEX_SECONDS = 0.05
#: a quantized module of these storages, from its tensors (suffix -> dtype)
_LIMITS = {"groups": 100, "targets": 10_000, "pattern": 1_000}


@dataclass(frozen=True)
class QArgs:
    """One ``QuantizationArgs`` of a config group (``weights`` or ``input_activations``)."""

    num_bits: int
    type: str  # "int" or "float"
    symmetric: bool
    strategy: str
    group_size: int | None
    block_structure: tuple[int, int] | None
    dynamic: bool | str
    actorder: str | None
    #: the dtype the scales are rounded to (``"float8_e4m3fn"`` for NVFP4, ``"uint8"`` for MX), ``None``: the data's
    scale_dtype: str | None = None

    @classmethod
    def parse(cls, raw: Any, where: str) -> QArgs | None:
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} is {type(raw).__name__}; expected an object of quantization arguments")
        bits = raw.get("num_bits", 8)
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ConfigError(f"{where}.num_bits is {bits!r}; expected an integer from 1 to 8")
        kind = raw.get("type", "int")
        if kind not in ("int", "float"):
            raise UnsupportedFormatError(f"{where}.type is {kind!r}: compressed-tensors knows 'int' and 'float'")
        sym = raw.get("symmetric", True)
        if not isinstance(sym, bool):
            raise ConfigError(f"{where}.symmetric is {sym!r}; expected true or false")
        gs = raw.get("group_size")
        if gs is not None and (isinstance(gs, bool) or not isinstance(gs, int) or gs < 1 or gs > 1 << 20):
            raise ConfigError(f"{where}.group_size is {gs!r}; expected a positive integer or null")
        strategy = raw.get("strategy")
        if strategy is None:  # compressed-tensors' own default: group with a group size, else tensor
            strategy = "group" if gs is not None else "tensor"
        if strategy not in STRATEGIES:
            raise UnsupportedFormatError(f"{where}.strategy is {strategy!r}, not one of {sorted(STRATEGIES)}")
        if strategy in ("group", "tensor_group") and gs is None:
            raise ConfigError(f"{where}: strategy {strategy!r} needs a group_size")
        block = raw.get("block_structure")
        if block is not None:
            if (
                not isinstance(block, Sequence)
                or len(block) != 2
                or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 1 << 16 for b in block)
            ):
                raise ConfigError(f"{where}.block_structure is {block!r}; expected [rows, cols] of positive integers")
            block = (int(block[0]), int(block[1]))
        if strategy == "block" and block is None:
            raise ConfigError(f"{where}: strategy 'block' needs a block_structure")
        dynamic = raw.get("dynamic", False)
        if dynamic not in (True, False, "local"):
            raise ConfigError(f"{where}.dynamic is {dynamic!r}; expected true, false or 'local'")
        actorder = raw.get("actorder")
        if actorder is not None and actorder not in ("group", "weight", "static", "dynamic", True, False):
            raise ConfigError(f"{where}.actorder is {actorder!r}")
        scale_dtype = raw.get("scale_dtype")
        if scale_dtype is not None:
            scale_dtype = str(scale_dtype).removeprefix("torch.")
            if scale_dtype not in ("float8_e4m3fn", "uint8", "bfloat16", "float16", "float32"):
                raise UnsupportedFormatError(f"{where}.scale_dtype is {raw.get('scale_dtype')!r}")
        return cls(
            scale_dtype=scale_dtype,
            num_bits=bits,
            type=kind,
            symmetric=sym,
            strategy=strategy,
            group_size=gs,
            block_structure=block,
            dynamic=dynamic,
            actorder=None if actorder in (None, False) else str(actorder),
        )

    def describe(self) -> str:
        what = f"{self.type}{self.num_bits}"
        if self.strategy == "group" or self.strategy == "tensor_group":
            what += f" {self.strategy} {self.group_size}"
        elif self.strategy == "block" and self.block_structure:
            what += f" block {self.block_structure[0]}x{self.block_structure[1]}"
        else:
            what += f" per {self.strategy}"
        return what + ("" if self.symmetric else " asymmetric") + (" dynamic" if self.dynamic else "")


@dataclass(frozen=True)
class Group:
    """One entry of ``config_groups``."""

    name: str
    targets: tuple[str, ...]
    weights: QArgs | None
    input_activations: QArgs | None
    output_activations: QArgs | None
    format: str | None


@dataclass(frozen=True)
class CTConfig:
    """The parsed ``quantization_config`` of a compressed-tensors checkpoint."""

    format: str | None
    groups: tuple[Group, ...]
    ignore: tuple[str, ...]
    kv_cache: QArgs | None
    sparsity: Mapping[str, Any] | None
    transform: Mapping[str, Any] | None
    status: str | None

    @classmethod
    def parse(cls, qc: Mapping[str, Any] | None) -> CTConfig:
        """``qc`` is config.json's ``quantization_config`` (``None``: a checkpoint without one, read from its tensors
        alone: every module then needs storage that says all, which packed integers do not)."""
        if qc is None:
            return cls(None, (), (), None, None, None, None)
        fmt = qc.get("format")
        if fmt is not None:
            _check_format(fmt, "quantization_config.format")
        raw_groups = qc.get("config_groups") or {}
        if not isinstance(raw_groups, Mapping) or len(raw_groups) > _LIMITS["groups"]:
            raise ConfigError(
                f"quantization_config.config_groups must be an object of at most {_LIMITS['groups']} groups"
            )
        groups = []
        for name, g in raw_groups.items():
            where = f"config_groups.{name}"
            if not isinstance(g, Mapping):
                raise ConfigError(f"{where} is {type(g).__name__}; expected an object")
            targets = _strings(g.get("targets") or [], f"{where}.targets")
            gfmt = g.get("format")
            if gfmt is not None:
                _check_format(gfmt, f"{where}.format")
            groups.append(
                Group(
                    name=str(name),
                    targets=targets,
                    weights=QArgs.parse(g.get("weights"), f"{where}.weights"),
                    input_activations=QArgs.parse(g.get("input_activations"), f"{where}.input_activations"),
                    output_activations=QArgs.parse(g.get("output_activations"), f"{where}.output_activations"),
                    format=gfmt,
                )
            )
        sparsity = qc.get("sparsity_config")
        transform = qc.get("transform_config")
        if sparsity is not None and not isinstance(sparsity, Mapping):
            raise ConfigError("quantization_config.sparsity_config must be an object or null")
        if transform is not None and not isinstance(transform, Mapping):
            raise ConfigError("quantization_config.transform_config must be an object or null")
        sparse_format(sparsity)  # a layout anyquant decompresses, or a typed error
        status = qc.get("quantization_status")
        return cls(
            format=fmt,
            groups=tuple(groups),
            ignore=_strings(qc.get("ignore") or [], "quantization_config.ignore"),
            kv_cache=QArgs.parse(qc.get("kv_cache_scheme"), "quantization_config.kv_cache_scheme"),
            sparsity=sparsity or None,
            transform=transform or None,
            status=status if isinstance(status, str) else None,
        )

    def group_for(self, name: str) -> Group | None:
        """The group whose targets match module ``name`` (a ``Linear``), as compressed-tensors matches them: an exact
        name first, then a ``re:`` pattern (``re.match``), then a class name (``Linear``); ``None`` when the module is
        in ``ignore`` or no group targets it."""
        if any(_matches(name, t, linear=False) for t in self.ignore):
            return None
        best: tuple[int, int] | None = None
        found = None
        for i, g in enumerate(self.groups):
            for t in g.targets:
                rank = 0 if t == name else 1 if t.startswith("re:") else 2
                if (best is None or (rank, i) < best) and _matches(name, t, linear=True):
                    best, found = (rank, i), g
        return found


def _check_format(fmt: Any, where: str) -> None:
    if not isinstance(fmt, str):
        raise ConfigError(f"{where} is {fmt!r}; expected a compressed-tensors format name")
    if fmt in REFUSED_FORMATS:
        raise UnsupportedFormatError(f"{where} is {fmt!r}: {REFUSED_FORMATS[fmt]}")
    if fmt not in FORMATS:
        raise UnsupportedFormatError(
            f"{where} is {fmt!r}, a compressed-tensors format anyquant does not know "
            f"(it reads {', '.join(sorted(WEIGHT_FORMATS))})"
        )


#: the sparsity layouts anyquant decompresses (compressed-tensors 0.14's sparse compressors; see sparse.py)
SPARSE_FORMATS = frozenset({"sparse-24-bitmask", "sparse-bitmask"})


def sparse_format(sparsity: Mapping[str, Any] | None) -> str | None:
    """The ``sparsity_config``'s compressed layout (``None``: none, or ``dense``: the weights are stored dense)."""
    if not sparsity:
        return None
    fmt = sparsity.get("format")
    if fmt is not None and not isinstance(fmt, str):
        raise ConfigError(f"sparsity_config.format is {fmt!r}; expected a format name")
    if fmt in (None, "dense"):
        return None
    if fmt in SPARSE_FORMATS:
        return str(fmt)
    if fmt == "marlin-24":
        raise UnsupportedFormatError(
            "sparsity_config.format is 'marlin-24': a GPU-only 2:4 sparse layout (Marlin kernels); serve it with vLLM"
        )
    raise UnsupportedFormatError(
        f"sparsity_config.format is {fmt!r}, a sparse layout anyquant does not know "
        f"(it decompresses {', '.join(sorted(SPARSE_FORMATS))})"
    )


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence) or len(value) > _LIMITS["targets"]:
        raise ConfigError(f"{where} must be a list of at most {_LIMITS['targets']} strings")
    out = []
    for v in value:
        if not isinstance(v, str) or len(v) > _LIMITS["pattern"]:
            raise ConfigError(f"{where} holds {v!r}; expected strings of at most {_LIMITS['pattern']} characters")
        out.append(v)
    return tuple(out)


def _matches(name: str, target: str, *, linear: bool) -> bool:
    if target.startswith("re:"):
        import regex

        try:
            return regex.match(target[3:], name, timeout=REGEX_SECONDS) is not None
        except TimeoutError:
            raise ConfigError(f"the target pattern {target!r} takes too long to match {name!r}") from None
        except regex.error as e:
            raise ConfigError(f"the target pattern {target!r} is not a valid regular expression: {e}") from None
    if target == name:
        return True
    # class-name targets: every module anyquant asks about is a linear (transformers' and vLLM's class names)
    return linear and target in ("Linear", "LinearBase", "torch.nn.Linear", "nn.Linear")


# ----------------------------------------------------------------------------------------- modules from tensors

#: storage kinds, from the tensors: what each stores and how it decodes
STORAGE_FORMAT = {
    "packed-int": "pack-quantized",
    "int8": "int-quantized",  # or naive-quantized
    "fp8": "float-quantized",  # or naive-quantized
    "nvfp4": "nvfp4-pack-quantized",
    "mxfp4": "mxfp4-pack-quantized",
}
_FLOAT_SCALES = frozenset({"F32", "F16", "BF16"})


@dataclass(frozen=True)
class ModuleSpec:
    """One quantized linear: its storage (from the tensors) and its arguments (from the config, checked)."""

    name: str
    storage: str  # a key of STORAGE_FORMAT
    weights: QArgs
    input_activations: QArgs | None
    out_features: int
    #: in_features where the headers fix it (``None``: a packed per-channel/tensor layer, fixed by ``weight_shape``)
    in_features: int | None
    tensors: Mapping[str, str] = field(default_factory=dict)  # suffix -> full tensor name
    group: str | None = None

    @property
    def bits(self) -> int:
        return self.weights.num_bits


def _module_names(probe: Probe) -> list[str]:
    names = set(probe.modules_with("weight_packed")) | set(probe.modules_with("weight_scale"))
    return sorted(names)


def read_modules(probe: Probe, cfg: CTConfig) -> tuple[list[ModuleSpec], list[str]]:
    """Every quantized module of the checkpoint, and the problems found (tensors that disagree with each other or
    with the config: the loader refuses a checkpoint with any)."""
    specs: list[ModuleSpec] = []
    problems: list[str] = []
    for name in _module_names(probe):
        try:
            specs.append(_module(probe, cfg, name))
        except _Problem as p:  # a ConfigError / UnsupportedFormatError of the config propagates as it is
            problems.append(f"{name}: {p}")
    return specs, problems


class _Problem(Exception):
    pass


def _module(probe: Probe, cfg: CTConfig, name: str) -> ModuleSpec:
    t = probe.tensors
    have = {s: f"{name}.{s}" for s in _SUFFIXES if f"{name}.{s}" in t}
    scale = t.get(have.get("weight_scale", ""))
    if scale is None:
        raise _Problem("no weight_scale")
    packed, weight = t.get(have.get("weight_packed", "")), t.get(have.get("weight", ""))
    if packed is not None and weight is not None:
        raise _Problem("both weight and weight_packed")
    stored = packed if packed is not None else weight
    if stored is None:
        # attention's q/k/v scales (kv_cache_scheme) are not linears' weight scales
        raise _Problem("a weight_scale without weight or weight_packed")
    if len(stored.shape) != 2:
        raise _Problem(f"the stored weight is {list(stored.shape)}; expected 2-D")
    out = stored.shape[0]
    if packed is not None and packed.dtype == "I32":
        storage = "packed-int"
    elif packed is not None and packed.dtype == "U8":
        storage = "nvfp4" if scale.dtype == "F8_E4M3" else "mxfp4" if scale.dtype in ("U8", "F8_E8M0") else ""
        if not storage:
            raise _Problem(f"weight_packed U8 with a {scale.dtype} weight_scale (NVFP4 has F8_E4M3, MXFP4 U8)")
    elif packed is not None:
        raise _Problem(f"weight_packed is {packed.dtype}; expected I32 (packed integers) or U8 (FP4)")
    elif weight is not None and weight.dtype == "I8":
        storage = "int8"
    elif weight is not None and weight.dtype == "F8_E4M3":
        storage = "fp8"
    else:
        assert weight is not None
        raise _Problem(f"weight is {weight.dtype} beside a weight_scale; expected I8 or F8_E4M3")
    group = cfg.group_for(name) if cfg.groups else None
    if cfg.groups and group is None:
        raise _Problem(
            "its tensors are quantized, but no config group targets it (or it is in ignore): the config and the "
            "tensors disagree"
        )
    declared = (group.format if group else None) or cfg.format
    if declared not in (None, "mixed-precision") and not _storage_fits(storage, declared):
        raise _Problem(f"the config says {declared!r}, the tensors are {STORAGE_FORMAT[storage]} ({storage})")
    args = group.weights if group else None
    if args is None:
        args = _args_from_tensors(storage, t, have, name)
    _check_args(storage, args, name)
    in_features = _check_shapes(storage, args, t, have, out)
    return ModuleSpec(
        name=name,
        storage=storage,
        weights=args,
        input_activations=group.input_activations if group else None,
        out_features=out,
        in_features=in_features,
        tensors=have,
        group=group.name if group else None,
    )


_SUFFIXES = (
    "weight",
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
    "weight_global_scale",
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "bias",
)


def _storage_fits(storage: str, declared: str) -> bool:
    if declared == "naive-quantized":
        return storage in ("int8", "fp8")
    if declared == "int-quantized":
        return storage == "int8"
    return STORAGE_FORMAT[storage] == declared


def _args_from_tensors(storage: str, t: Mapping[str, Any], have: Mapping[str, str], name: str) -> QArgs:
    if storage in ("nvfp4", "mxfp4"):
        gs = 16 if storage == "nvfp4" else 32
        fp4 = "tensor_group" if storage == "nvfp4" else "group"
        return QArgs(4, "float", True, fp4, gs, None, False, None)
    if storage == "packed-int":
        raise _Problem("packed integers, and no config group says their bits")
    scale = t[have["weight_scale"]]
    w = t[have["weight"]]
    kind = "int" if storage == "int8" else "float"
    shape = tuple(scale.shape)
    if math.prod(shape) == 1:
        strategy = "tensor"
    elif shape == (w.shape[0], 1):
        strategy = "channel"
    else:
        raise _Problem(f"a weight_scale of {list(shape)}, and no config group says its strategy")
    return QArgs(8, kind, "weight_zero_point" not in have, strategy, None, None, False, None)


def _check_args(storage: str, a: QArgs, name: str) -> None:
    if storage == "packed-int" and a.type != "int":
        raise _Problem(f"packed integers, but the config says {a.describe()}")
    if storage == "int8" and (a.type != "int" or a.num_bits > 8):
        raise _Problem(f"int8 weights, but the config says {a.describe()}")
    if storage == "fp8" and (a.type != "float" or a.num_bits != 8):
        raise _Problem(f"FP8 weights, but the config says {a.describe()}")
    if storage in ("nvfp4", "mxfp4") and (a.type != "float" or a.num_bits != 4):
        raise _Problem(f"FP4 weights, but the config says {a.describe()}")
    if a.strategy not in ("tensor", "channel", "group", "block", "tensor_group"):
        raise _Problem(f"weights quantized per {a.strategy!r}, which compressed-tensors never stores")
    if a.strategy == "tensor_group" and storage != "nvfp4":
        raise _Problem("strategy 'tensor_group' outside NVFP4")


def _check_shapes(storage: str, a: QArgs, t: Mapping[str, Any], have: Mapping[str, str], out: int) -> int | None:
    """The in_features the headers fix (``None`` where only ``weight_shape``'s values do), after checking every
    tensor's dtype and shape against each other."""
    scale = t[have["weight_scale"]]
    stored = t[have.get("weight_packed") or have["weight"]]
    cols = stored.shape[1]
    if storage == "packed-int":
        if "weight_shape" not in have:
            raise _Problem("packed integers without weight_shape")
        ws = t[have["weight_shape"]]
        if ws.dtype not in ("I64", "I32") or tuple(ws.shape) != (2,):
            raise _Problem(f"weight_shape is {ws.dtype}{list(ws.shape)}; expected I64[2]")
        in_f: int | None = None
        lo, hi = (cols - 1) * 32 // a.num_bits + 1, cols * 32 // a.num_bits
        if a.strategy == "group":
            assert a.group_size is not None
            in_f = scale.shape[-1] * a.group_size if len(scale.shape) == 2 else None
            if in_f is None or not lo <= in_f <= hi:
                raise _Problem(
                    f"weight_packed has {cols} int32 columns (in_features {lo}..{hi} at {a.num_bits} bits), "
                    f"weight_scale {list(scale.shape)} with group_size {a.group_size} says {in_f}"
                )
    elif storage in ("nvfp4", "mxfp4"):
        in_f = 2 * cols
    else:
        in_f = cols
    if scale.dtype not in _FLOAT_SCALES | ({"F8_E4M3"} if storage == "nvfp4" else set()) | (
        {"U8", "F8_E8M0"} if storage == "mxfp4" else set()
    ):
        raise _Problem(f"weight_scale is {scale.dtype}")
    want = _scale_shape(a, out, in_f)
    if want is not None and tuple(scale.shape) not in want:
        raise _Problem(f"weight_scale is {list(scale.shape)}; {a.describe()} of [{out}, {in_f}] needs {list(want[0])}")
    zp = have.get("weight_zero_point")
    if zp is not None and a.symmetric:
        raise _Problem("a weight_zero_point, but the config says symmetric")
    if zp is None and not a.symmetric and storage == "packed-int" and a.strategy in ("group", "channel"):
        raise _Problem("asymmetric, but no weight_zero_point")
    if "weight_g_idx" in have:
        g = t[have["weight_g_idx"]]
        if g.dtype not in ("I32", "I64") or len(g.shape) != 1 or (in_f is not None and g.shape[0] != in_f):
            raise _Problem(f"weight_g_idx is {g.dtype}{list(g.shape)}")
    if storage == "nvfp4" and "weight_global_scale" not in have:
        raise _Problem("NVFP4 without weight_global_scale")
    return in_f


def _scale_shape(a: QArgs, out: int, in_f: int | None) -> tuple[tuple[int, ...], ...] | None:
    if a.strategy == "tensor":
        return ((1,), (), (1, 1))
    if a.strategy == "channel":
        return ((out, 1),)
    if in_f is None:
        return None
    if a.strategy in ("group", "tensor_group"):
        assert a.group_size is not None
        return ((out, math.ceil(in_f / a.group_size)),)
    assert a.block_structure is not None
    bh, bw = a.block_structure
    return ((math.ceil(out / bh), math.ceil(in_f / bw)),)
