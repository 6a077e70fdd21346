"""anyquant hooks for bitsandbytes: format registration and header-only detection."""

from __future__ import annotations

from collections.abc import Callable

from anyquant.plugin import Claim, FormatSpec, Probe, hookimpl

from .scheme import read_scheme

FORMAT = "bnb"


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name=FORMAT,
            loader="anyquant_bnb.loader:BnbLoader",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description="bitsandbytes 4-bit (nf4/fp4, double quantization) and 8-bit (LLM.int8) checkpoints",
            install_hint="pip install anyquant-bnb",
        )
    )


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    qm = probe.quant_method
    suffixes = probe.suffixes()
    if qm not in (None, "bitsandbytes", "bnb") or (qm is None and not ({"absmax", "SCB"} & set(suffixes))):
        return None
    scheme = read_scheme(probe)
    qc = probe.quantization_config or {}
    evidence = [f"quant_method={qm!r}" if qm else "no quantization_config"]
    if scheme.modules:
        evidence.append(f"{len(scheme.modules)} quantized modules: {', '.join(scheme.kinds())}")
    problems = list(scheme.problems)
    if qm is not None and not scheme.modules and not problems:
        problems.append("the config says bitsandbytes, but no tensor is quantized (no absmax or SCB)")
    bits = {m.bits for m in scheme.modules}
    declared = 4 if qc.get("load_in_4bit") else 8 if qc.get("load_in_8bit") else None
    if declared is not None and bits and bits != {declared}:
        problems.append(f"the config says load_in_{declared}bit, the tensors are {sorted(bits)}-bit")
    variant = "mixed" if len(bits) > 1 else f"{min(bits)}bit" if bits else None
    details = {"modules": len(scheme.modules), "kinds": scheme.kinds(), "problems": problems}
    return Claim(FORMAT, evidence=tuple(evidence + problems[:3]), variant=variant, details=details)
