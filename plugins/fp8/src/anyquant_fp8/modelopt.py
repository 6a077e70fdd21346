"""NVIDIA ModelOpt's FP8 checkpoints ("unified HF checkpoints" of ``export_hf_checkpoint``) from their headers.

ModelOpt writes ``hf_quant_config.json`` (``{"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo",
"kv_cache_quant_algo", "exclude_modules"}}``) and, since 0.29, the same in ``config.json``'s ``quantization_config``
as ``{"quant_method": "modelopt", "quant_algo", "ignore", "kv_cache_scheme", "config_groups", "producer"}``
(``export/convert_hf_config.py``). Per quantized linear (``export/unified_export_hf.py``, ``quant_utils.py``):

- ``FP8``: ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` float32 ``[]`` (``amax / 448``), ``input_scale``
  float32 ``[]`` (the static per-tensor activation scale, ``amax / 448`` of the calibrated input);
- ``FP8_PER_CHANNEL_PER_TOKEN``: ``weight_scale`` float32 ``[out]``; activations quantized per token at run time;
- ``FP8_PB_WO`` (written lowercase, ``fp8_pb_wo``): ``weight_scale`` float32 ``[out/128, 1, in/128, 1]``
  (128x128 blocks), weight only;
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
}
#: ModelOpt's other ``quant_algo`` values (``export/quant_utils.py``: ``process_layer_quant_config``), refused by name
OTHER_ALGOS = {
    "NVFP4": "NVFP4 (uint8-packed E2M1 weights, F8_E4M3 weight_scale per 16, F32 weight_scale_2)",
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
    "MIXED_PRECISION": "per-layer mixed precision (quantized_layers)",
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
    ) -> None:
        self.algo, self.kv_algo, self.exclude, self.source, self.producer = algo, kv_algo, exclude, source, producer
        self.variant, self.scales, self.input_quant = ALGOS[algo]

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
        else:
            raw_algo, raw_kv = qc.get("quant_algo"), _kv_from_scheme(qc.get("kv_cache_scheme"))
            exclude = _string_list(qc.get("ignore", qc.get("exclude_modules")), "quantization_config.ignore")
        source, producer = "config.json quantization_config", qc.get("producer")
    elif hq is not None:
        nested = hq.get("quantization")
        if not isinstance(nested, Mapping):
            raise ConfigError(f"hf_quant_config.json: 'quantization' is {nested!r}; expected an object")
        raw_algo, raw_kv = nested.get("quant_algo"), nested.get("kv_cache_quant_algo")
        exclude = _string_list(nested.get("exclude_modules"), "hf_quant_config.json exclude_modules")
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
    cfg = ModelOptConfig(algo, kv, exclude, source, who)
    if hq is not None and source != "hf_quant_config.json":  # both files: they must agree
        other = hq.get("quantization")
        other_algo = other.get("quant_algo") if isinstance(other, Mapping) else None
        if isinstance(other_algo, str) and other_algo.strip().upper() != algo:
            raise ConfigError(
                f"{probe.root}: config.json says quant_algo {raw_algo!r}, hf_quant_config.json says {other_algo!r}"
            )
    return cfg
