"""anyquant hooks for FP8 (``quant_method: "fp8"``, NVIDIA ModelOpt's FP8 exports: ``quant_method: "modelopt"`` or
a ModelOpt ``hf_quant_config.json``, and transformers' ``quant_method: "fbgemm_fp8"``): format registration and
header-only detection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from anyquant.plugin import Claim, ConfigError, FormatSpec, Probe, UnsupportedFormatError, hookimpl

from .scheme import FP8Scheme, read_scheme

FORMAT = "fp8"


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name=FORMAT,
            loader="anyquant_fp8.loader:FP8Loader",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description=(
                "FP8 e4m3 weights with weight_scale_inv (quant_method fp8: DeepSeek-V3, Qwen3-FP8) or ModelOpt's "
                "weight_scale/input_scale (quant_method modelopt: FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, NVFP4, "
                "MIXED_PRECISION of FP8 and NVFP4) or transformers' fbgemm_fp8 (weight_scale per output channel, "
                "inputs FP8 per row under activation_scale_ub)"
            ),
            install_hint="pip install anyquant-fp8",
        )
    )


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    qm = probe.quant_method
    modelopt = qm is not None and qm.startswith("modelopt")
    if modelopt:
        return _detect_modelopt(probe)
    if qm == "fbgemm_fp8":
        return _detect_fbgemm(probe)
    if qm not in (None, "fp8", "fbgemm_fp8") or (qm is None and not list(probe.modules_with("weight_scale_inv"))):
        return None  # compressed-tensors' FP8 (weight_scale) is its plugin's; other methods are theirs
    try:
        scheme = read_scheme(probe)
    except (ConfigError, UnsupportedFormatError) as e:  # claimed, and malformed: the loader raises it as it is
        return Claim(
            FORMAT,
            evidence=(f"quant_method={qm!r}", f"{type(e).__name__}: {e}"),
            details={"config_error": [type(e).__name__, str(e)], "problems": [str(e)]},
        )
    evidence = [f"quant_method={qm!r}" if qm else "no quantization_config"]
    if scheme.modules:
        evidence.append(
            f"{len(scheme.modules)} modules with F8_E4M3 weight + F32 weight_scale_inv ({scheme.describe()})"
        )
    details = _details(scheme)
    variant = "block" if scheme.block else "tensor"
    return Claim(FORMAT, evidence=tuple(evidence + scheme.problems[:3]), variant=variant, details=details)


def _detect_fbgemm(probe: Probe) -> Claim:
    """transformers' ``fbgemm_fp8`` says so: claimed as ``fbgemm-fp8`` with its evidence (MoE experts, or a malformed
    config, kept as the typed error the load raises)."""
    evidence = ["quant_method='fbgemm_fp8' (transformers FbgemmFp8Config)"]
    try:
        scheme = read_scheme(probe)
    except (ConfigError, UnsupportedFormatError) as e:
        return Claim(
            FORMAT,
            evidence=(*evidence, f"{type(e).__name__}: {e}"),
            variant="fbgemm-fp8",
            details={"config_error": [type(e).__name__, str(e)], "problems": [str(e)]},
        )
    fb = scheme.fbgemm
    assert fb is not None
    evidence.append(scheme.describe())
    if scheme.modules:
        evidence.append(f"{len(scheme.modules)} modules with F8_E4M3 weight [out, in] + F32 weight_scale [out, 1]")
    details = {
        **_details(scheme),
        "activation_scale_ub": fb.activation_scale_ub,
        "modules_to_not_convert": None if fb.modules_to_not_convert is None else list(fb.modules_to_not_convert),
        "input_quant": "fbgemm quantize_fp8_per_row (dynamic per row, scale upper bound)",
    }
    return Claim(FORMAT, evidence=tuple(evidence + scheme.problems[:3]), variant=scheme.variant, details=details)


def _details(scheme: FP8Scheme) -> dict[str, Any]:
    """What detection reports of every FP8 checkpoint's scheme."""
    return {
        "modules": len(scheme.modules),
        "block": list(scheme.block) if scheme.block else None,
        "activation_scheme": scheme.activation_scheme,
        "dtype": scheme.dtype,
        "problems": scheme.problems,
    }


def _detect_modelopt(probe: Probe) -> Claim:
    """ModelOpt's config says so: claimed, its variant named (an algorithm anyquant does not read is kept as the
    typed error the load raises)."""
    qm = probe.quant_method
    try:
        scheme = read_scheme(probe)
    except (ConfigError, UnsupportedFormatError) as e:
        return Claim(
            FORMAT,
            evidence=(f"quant_method={qm!r} (NVIDIA ModelOpt)", f"{type(e).__name__}: {e}"),
            variant="modelopt",
            details={"config_error": [type(e).__name__, str(e)], "problems": [str(e)]},
        )
    m = scheme.modelopt
    assert m is not None
    evidence = [f"quant_method={qm!r}: {scheme.describe()}"]
    if scheme.modules and m.scales == "mixed":
        fp4 = sum(1 for x in scheme.modules if x.algo == "NVFP4")
        evidence.append(
            f"quantized_layers: {fp4} modules with U8 weight (FP4 E2M1 pairs) + F8_E4M3 weight_scale + F32 "
            f"weight_scale_2 + input_scale, {len(scheme.modules) - fp4} with F8_E4M3 weight + F32 weight_scale + "
            "input_scale"
        )
    elif scheme.modules and m.scales == "nvfp4":
        evidence.append(
            f"{len(scheme.modules)} modules with U8 weight (FP4 E2M1 pairs) + F8_E4M3 weight_scale per "
            f"{m.group_size} + F32 weight_scale_2 + input_scale"
        )
    elif scheme.modules:
        inputs = sum(1 for x in scheme.modules if x.has_input_scale)
        evidence.append(
            f"{len(scheme.modules)} modules with F8_E4M3 weight + F32 weight_scale"
            + (f" + input_scale ({inputs})" if inputs else "")
        )
    if m.exclude:
        evidence.append(f"exclude_modules {list(m.exclude)[:4]} kept dense")
    if scheme.kv_scales:
        evidence.append(f"{len(scheme.kv_scales)} attention layers with k_scale/v_scale")
    details = {
        **_details(scheme),
        "producer": m.producer,
        "quant_algo": m.algo,
        "config_source": m.source,
        "exclude_modules": list(m.exclude),
        "kv_cache_quant_algo": m.kv_algo,
        "kv_layers": len(scheme.kv_scales),
        "group_size": m.group_size,
        "quantized_layers": {a: sum(1 for x in scheme.modules if x.algo == a) for a in ("FP8", "NVFP4")}
        if m.algo == "MIXED_PRECISION"
        else None,
    }
    return Claim(FORMAT, evidence=tuple(evidence + scheme.problems[:3]), variant=scheme.variant, details=details)
