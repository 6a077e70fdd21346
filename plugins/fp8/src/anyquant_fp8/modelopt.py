"""NVIDIA ModelOpt's FP8 and NVFP4 checkpoints ("unified HF checkpoints" of ``export_hf_checkpoint``) from their
headers.

ModelOpt writes ``hf_quant_config.json`` (``{"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo",
"kv_cache_quant_algo", "exclude_modules"}}``) and, since 0.29, the same in ``config.json``'s ``quantization_config``
as ``{"quant_method": "modelopt", "quant_algo", "ignore", "kv_cache_scheme", "config_groups", "producer"}``
(``export/convert_hf_config.py``). Per quantized linear (``export/unified_export_hf.py``, ``quant_utils.py``):

- ``FP8``: ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` float32 ``[]`` (``amax / 448``), ``input_scale``
  float32 ``[]`` (the static per-tensor activation scale, ``amax / 448`` of the calibrated input);
- ``FP8_PER_CHANNEL_PER_TOKEN``: ``weight_scale`` float32 ``[out]``; activations quantized per token at run time;
- ``FP8_PB_WO`` (written lowercase, ``fp8_pb_wo``): ``weight_scale`` float32 ``[out/128, 1, in/128, 1]``
  (128x128 blocks), weight only;
- ``NVFP4`` (``group_size: 16``): ``weight`` uint8 ``[out, in/2]`` (two FP4 E2M1 codes a byte, the low nibble the
  even input; bit 3 of a code its sign), ``weight_scale`` float8_e4m3fn ``[out, in/16]``, ``weight_scale_2`` float32
  ``[]``; the weight is ``float32(E2M1[code]) * (float32(weight_scale) * weight_scale_2)``
  (``NVFP4QTensor.dequantize``); ``input_scale`` float32 ``[]`` (``amax / (6 * 448)`` of the calibrated input): the
  inputs are quantized to NVFP4 with the global scale ``1 / input_scale`` (W4A4);
- ``MIXED_PRECISION``: ``quantized_layers`` (``{name: {"quant_algo": "FP8" | "NVFP4", "group_size": 16}}``) says
  each quantized linear's algorithm, stored as above; a linear it does not name is dense;
- the KV cache (``kv_cache_quant_algo: FP8``): ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` float32 ``[]``.

Modules in ``exclude_modules`` (``ignore``) keep dense weights; the names are ModelOpt's prefix wildcards
(``module*``), matched as vLLM's ``ModelOptQuantConfigBase.is_layer_excluded`` does (exact, ``fnmatch``, substring).
Standard library only.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

from anyquant.plugin import ConfigError, Probe, UnsupportedFormatError

__all__ = ["ALGOS", "ModelOptConfig", "is_modelopt", "read_modelopt_config"]

#: ModelOpt's FP8 ``quant_algo`` values anyquant reads -> (variant, weight scale layout, input quantization)
ALGOS: dict[str, tuple[str, str, str | None]] = {
    "FP8": ("modelopt-fp8", "tensor", "static"),
    "FP8_PER_CHANNEL_PER_TOKEN": ("modelopt-fp8-pc-pt", "channel", "token"),
    "FP8_PB_WO": ("modelopt-fp8-pb-wo", "block", None),
    "NVFP4": ("modelopt-nvfp4", "nvfp4", "nvfp4"),
    "MIXED_PRECISION": ("modelopt-mixed", "mixed", "mixed"),
}
#: what a ``MIXED_PRECISION`` checkpoint's ``quantized_layers`` may name per linear
MIXED_ALGOS = ("FP8", "NVFP4")
#: NVFP4's group: one E4M3 ``weight_scale`` per 16 inputs (ModelOpt's ``block_sizes={-1: 16}``; vLLM reads no other)
NVFP4_GROUP = 16
#: ModelOpt's other ``quant_algo`` values (``export/quant_utils.py``: ``process_layer_quant_config``), refused by name
OTHER_ALGOS = {
    "NVFP4_AWQ": "NVFP4 with AWQ pre_quant_scale",
    "W4A16_NVFP4": "NVFP4 weights, 16-bit activations",
    "W4A8_NVFP4_FP8": "NVFP4 weights, FP8 activations",
    "W4A8_MXFP4_FP8": "MXFP4 weights, FP8 activations",
    "MXFP4": "MXFP4",
    "MXFP8": "MXFP8",
    "W4A16_AWQ": "int4 AWQ (uint8-packed)",
    "W4A8_AWQ": "int4 AWQ with FP8 activations",
    "W8A16": "int8 weight-only",
    "W8A8_SQ_PER_CHANNEL": "int8 SmoothQuant",
    "FP8_PB_REAL": "FP8 blocks with real quantization",
}
KV_ALGOS = ("FP8",)


def is_modelopt(probe: Probe) -> bool:
    """The config (``config.json``'s ``quant_method: modelopt``, or a ModelOpt ``hf_quant_config.json``) says ModelOpt."""
    return probe.quant_method is not None and probe.quant_method.startswith("modelopt")


class ModelOptConfig:
    """What ModelOpt's config says: the algorithm, the KV-cache algorithm, the excluded modules and where each was read."""

    def __init__(
        self,
        algo: str,
        kv_algo: str | None,
        exclude: tuple[str, ...],
        source: str,
        producer: str | None,
        group_size: int | None = None,
        layers: Mapping[str, str] | None = None,
    ) -> None:
        self.algo, self.kv_algo, self.exclude, self.source, self.producer = algo, kv_algo, exclude, source, producer
        self.variant, self.scales, self.input_quant = ALGOS[algo]
        #: NVFP4's inputs per E4M3 weight scale (``None`` for the FP8 algorithms)
        self.group_size = group_size
        #: ``MIXED_PRECISION``: each quantized linear's algorithm (``FP8`` or ``NVFP4``) by name
        self.layers: dict[str, str] = dict(layers or {})

    def layer_algo(self, name: str) -> str | None:
        """The algorithm of linear ``name``: the checkpoint's (``MIXED_PRECISION``: its ``quantized_layers`` entry,
        ``None`` where it has none)."""
        return self.layers.get(name) if self.algo == "MIXED_PRECISION" else self.algo

    def excluded(self, name: str) -> bool:
        """``name`` is kept dense: vLLM's ``is_layer_excluded`` (exact name, ``fnmatch`` wildcard, or the legacy
        substring match of exports before ModelOpt 0.39)."""
        for pattern in self.exclude:
            if pattern == name or fnmatch.fnmatchcase(name, pattern) or (pattern and pattern in name):
                return True
        return False


def _string_list(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{what} is {value!r}; expected a list of module names")
    if len(value) > 1 << 16:
        raise ConfigError(f"{what} has {len(value)} entries")
    return tuple(value)


def _kv_from_scheme(scheme: Any) -> str | None:
    """config.json's ``kv_cache_scheme`` (a compressed-tensors-style dict, or a string) as a ``kv_cache_quant_algo``."""
    if scheme is None:
        return None
    if isinstance(scheme, str):
        return scheme.upper()
    if isinstance(scheme, Mapping):
        if scheme.get("type") == "float" and scheme.get("num_bits") == 8:
            return "FP8"
        return f"{scheme.get('type')}{scheme.get('num_bits')}"
    raise ConfigError(f"quantization_config.kv_cache_scheme is {scheme!r}; expected an object")


def _group_from_groups(groups: Any) -> Any:
    """config.json's ``config_groups`` (compressed-tensors-style, as ModelOpt writes them): the weights' group_size of
    the first group that states one, else ``None``."""
    if not isinstance(groups, Mapping):
        return None
    for group in list(groups.values())[:64]:
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if isinstance(weights, Mapping) and weights.get("group_size") is not None:
            return weights.get("group_size")
    return None


def _quantized_layers(raw: Any, where: str) -> dict[str, str]:
    """``MIXED_PRECISION``'s ``quantized_layers``: each linear's ``quant_algo`` (FP8 or NVFP4 with group_size 16);
    another algorithm is an :class:`UnsupportedFormatError` naming it and the layer."""
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(f"{where}: MIXED_PRECISION without quantized_layers (got {type(raw).__name__})")
    if len(raw) > 1 << 20:
        raise ConfigError(f"{where}: quantized_layers has {len(raw)} entries")
    layers: dict[str, str] = {}
    for name, entry in raw.items():
        layer_algo = entry.get("quant_algo") if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or not isinstance(layer_algo, str):
            raise ConfigError(f"{where}: quantized_layers[{name!r}] is {entry!r}; expected {{'quant_algo': ...}}")
        upper = layer_algo.strip().upper()
        if upper not in MIXED_ALGOS:
            known = OTHER_ALGOS.get(upper, "not a ModelOpt algorithm anyquant knows")
            raise UnsupportedFormatError(
                f"{where}: MIXED_PRECISION layer {name} is quant_algo {layer_algo!r} ({known}); anyquant reads "
                f"{' and '.join(MIXED_ALGOS)} layers (serve the others with vLLM or TensorRT-LLM)"
            )
        group = entry.get("group_size")
        if upper == "NVFP4" and group is not None and group != NVFP4_GROUP:
            raise UnsupportedFormatError(
                f"{where}: MIXED_PRECISION layer {name}: NVFP4 with group_size {group!r}; anyquant (as vLLM) reads 16"
            )
        layers[name] = upper
    return layers


def read_modelopt_config(probe: Probe) -> ModelOptConfig:
    """The ModelOpt config of ``probe``: ``config.json``'s ``quantization_config`` when it says ``modelopt``, else
    ``hf_quant_config.json``. An algorithm anyquant does not read is an :class:`UnsupportedFormatError` naming it."""
    qc = probe.quantization_config
    hq = probe.hf_quant_config_file
    if qc is not None and str(qc.get("quant_method", "")).lower().startswith("modelopt"):
        nested = qc.get("quantization")
        if isinstance(nested, Mapping):  # the hf_quant_config.json layout copied into config.json
            raw_algo, raw_kv = nested.get("quant_algo"), nested.get("kv_cache_quant_algo")
            exclude = _string_list(nested.get("exclude_modules"), "quantization.exclude_modules")
            raw_group = nested.get("group_size")
            raw_layers = nested.get("quantized_layers")
        else:
            raw_algo, raw_kv = qc.get("quant_algo"), _kv_from_scheme(qc.get("kv_cache_scheme"))
            exclude = _string_list(qc.get("ignore", qc.get("exclude_modules")), "quantization_config.ignore")
            raw_group = qc.get("group_size", _group_from_groups(qc.get("config_groups")))
            raw_layers = qc.get("quantized_layers")
        source, producer = "config.json quantization_config", qc.get("producer")
    elif hq is not None:
        nested = hq.get("quantization")
        if not isinstance(nested, Mapping):
            raise ConfigError(f"hf_quant_config.json: 'quantization' is {nested!r}; expected an object")
        raw_algo, raw_kv = nested.get("quant_algo"), nested.get("kv_cache_quant_algo")
        exclude = _string_list(nested.get("exclude_modules"), "hf_quant_config.json exclude_modules")
        raw_group = nested.get("group_size")
        raw_layers = nested.get("quantized_layers")
        source, producer = "hf_quant_config.json", hq.get("producer")
    else:
        raise ConfigError(f"{probe.root}: quant_method {probe.quant_method!r} without a ModelOpt quantization config")
    version = producer.get("version") if isinstance(producer, Mapping) else None
    who = f"modelopt {version}" if isinstance(version, str) else "modelopt"
    if not isinstance(raw_algo, str) or not raw_algo:
        raise ConfigError(f"{probe.root}: the ModelOpt config ({source}) has no quant_algo (got {raw_algo!r})")
    algo = raw_algo.strip().upper()
    if algo not in ALGOS:
        known = OTHER_ALGOS.get(algo)
        what = f"ModelOpt {known}" if known else "not a ModelOpt algorithm anyquant knows"
        raise UnsupportedFormatError(
            f"{probe.root}: ModelOpt quant_algo {raw_algo!r} ({what}) is not read by anyquant; it reads "
            f"{', '.join(ALGOS)} (serve the others with vLLM or TensorRT-LLM)"
        )
    kv: str | None = None
    if raw_kv is not None:
        if not isinstance(raw_kv, str):
            raise ConfigError(f"{probe.root}: kv_cache_quant_algo is {raw_kv!r}; expected a string or null")
        kv = raw_kv.strip().upper()
        if kv not in KV_ALGOS:
            raise UnsupportedFormatError(
                f"{probe.root}: ModelOpt kv_cache_quant_algo {raw_kv!r} is not applied by anyquant (it applies an FP8 "
                "KV cache with per-tensor k_scale/v_scale); serve it with vLLM"
            )
    group: int | None = None
    if ALGOS[algo][1] == "nvfp4":
        group = NVFP4_GROUP if raw_group is None else raw_group
        if isinstance(group, bool) or not isinstance(group, int):
            raise ConfigError(f"{probe.root}: the ModelOpt config ({source}) has group_size {raw_group!r}")
        if group != NVFP4_GROUP:
            raise UnsupportedFormatError(
                f"{probe.root}: ModelOpt {algo} with group_size {group}: NVFP4 has one E4M3 scale per "
                f"{NVFP4_GROUP} inputs, and anyquant (as vLLM) reads no other"
            )
    layers: dict[str, str] = {}
    if algo == "MIXED_PRECISION":
        layers = _quantized_layers(raw_layers, f"{probe.root}: the ModelOpt config ({source})")
        if any(a == "NVFP4" for a in layers.values()):
            group = NVFP4_GROUP
    cfg = ModelOptConfig(algo, kv, exclude, source, who, group, layers)
    if hq is not None and source != "hf_quant_config.json":  # both files: they must agree
        other = hq.get("quantization")
        other_algo = other.get("quant_algo") if isinstance(other, Mapping) else None
        if isinstance(other_algo, str) and other_algo.strip().upper() != algo:
            raise ConfigError(
                f"{probe.root}: config.json says quant_algo {raw_algo!r}, hf_quant_config.json says {other_algo!r}"
            )
    return cfg
