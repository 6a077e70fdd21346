"""anyquant hooks for FP8 (``quant_method: "fp8"``): format registration and header-only detection."""

from __future__ import annotations

from collections.abc import Callable

from anyquant.plugin import Claim, ConfigError, FormatSpec, Probe, UnsupportedFormatError, hookimpl

from .scheme import read_scheme

FORMAT = "fp8"


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name=FORMAT,
            loader="anyquant_fp8.loader:FP8Loader",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description="FP8 e4m3 weights with weight_scale_inv (quant_method fp8: DeepSeek-V3, Qwen3-FP8)",
            install_hint="pip install anyquant-fp8",
        )
    )


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    qm = probe.quant_method
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
    details = {
        "modules": len(scheme.modules),
        "block": list(scheme.block) if scheme.block else None,
        "activation_scheme": scheme.activation_scheme,
        "dtype": scheme.dtype,
        "problems": scheme.problems,
    }
    variant = "block" if scheme.block else "tensor"
    return Claim(FORMAT, evidence=tuple(evidence + scheme.problems[:3]), variant=variant, details=details)
