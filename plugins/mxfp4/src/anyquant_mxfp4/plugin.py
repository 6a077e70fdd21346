"""anyquant hooks for MXFP4 (``quant_method: "mxfp4"``, gpt-oss): format registration and header-only detection."""

from __future__ import annotations

from collections.abc import Callable

from anyquant.plugin import Claim, ConfigError, FormatSpec, Probe, hookimpl

from .scheme import looks_mxfp4, read_scheme

FORMAT = "mxfp4"


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name=FORMAT,
            loader="anyquant_mxfp4.loader:MXFP4Loader",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description="MXFP4 experts (quant_method mxfp4: gpt-oss's E2M1 codes with E8M0 scales per 32 values)",
            install_hint="pip install anyquant-mxfp4",
        )
    )


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    qm = probe.quant_method
    if qm != "mxfp4" and (qm is not None or not looks_mxfp4(probe)):
        return None
    evidence = [f"quant_method={qm!r}" if qm else "no quantization_config"]
    try:
        scheme = read_scheme(probe)
    except ConfigError as e:  # claimed, and malformed: the loader raises it as it is
        return Claim(
            FORMAT,
            evidence=(*evidence, f"{type(e).__name__}: {e}"),
            details={"config_error": [type(e).__name__, str(e)], "problems": [str(e)]},
        )
    if scheme.tensors:
        evidence.append(scheme.describe())
    details = {
        "tensors": len(scheme.tensors),
        "experts": sorted({t.experts for t in scheme.tensors}),
        "dtype": scheme.dtype,
        "modules_to_not_convert": list(scheme.modules_to_not_convert),
        "problems": scheme.problems,
        "unsupported": scheme.unsupported,
    }
    issues = scheme.problems + scheme.unsupported
    return Claim(FORMAT, evidence=tuple(evidence + issues[:3]), variant="experts", details=details)
