"""anyquant hooks for EXL3 and EXL2: format registration and header-only detection."""

from __future__ import annotations

from collections.abc import Callable

from anyquant import hookimpl
from anyquant.probe import Probe
from anyquant.protocols import Claim, FormatSpec

#: the codebook markers' int32 values (uint32 0xCBAC1FED / 0x83DCD12D viewed as int32).
CODEBOOK_MARKERS = {"mcg": "mcg", "mul1": "mul1"}
EXL2_SUFFIXES = ("q_weight", "q_scale", "q_scale_max", "q_groups")


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name="exl3",
            loader="anyquant_exl3.loader:EXL3Loader",
            quantizer="anyquant_exl3.quantize:EXL3Quantizer",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description="EXL3 (ExLlamaV3, QTIP trellis), 1-8 bpw, mixed per tensor",
            install_hint="pip install anyquant-exl3",
        )
    )
    register(
        FormatSpec(
            name="exl2",
            loader="anyquant_exl3.loader:EXL2Loader",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description="EXL2 (ExLlamaV2): q_weight/q_scale/q_groups/q_invperm",
            install_hint="pip install anyquant-exl3",
        )
    )


def _exl3_claim(probe: Probe) -> Claim | None:
    t = probe.tensors
    ks: dict[float, int] = {}
    codebooks: dict[str, int] = {}
    legacy = 0
    tables = []
    problems = []
    modules = 0
    for prefix in probe.modules_with("trellis"):
        tr = t[f"{prefix}.trellis"]
        if len(tr.shape) == 2:
            tables.append(prefix)
            continue
        has_h = f"{prefix}.suh" in t and f"{prefix}.svh" in t
        has_l = f"{prefix}.su" in t and f"{prefix}.sv" in t
        if len(tr.shape) != 3 or tr.dtype != "I16" or not (has_h or has_l):
            problems.append(f"{prefix}: trellis {tr.dtype}{list(tr.shape)} without suh/svh (or su/sv)")
            continue
        if tr.shape[2] % 8:
            problems.append(f"{prefix}: trellis last dim {tr.shape[2]} is not a multiple of 8")
            continue
        modules += 1
        k = tr.shape[2] / 16
        ks[k] = ks.get(k, 0) + 1
        cb = next((c for c in ("mcg", "mul1") if f"{prefix}.{c}" in t), "3inst")
        codebooks[cb] = codebooks.get(cb, 0) + 1
        legacy += 0 if has_h else 1
    if not modules and not tables:
        return None
    qc = probe.quantization_config or probe.quantization_config_file or {}
    evidence = [
        f"{modules} modules with a 3-D int16 .trellis + suh/svh (K per tensor: "
        + ", ".join(f"{k:g}x{n}" for k, n in sorted(ks.items()))
        + ")",
        f"codebooks from markers: {codebooks}",
    ]
    if tables:
        evidence.append(f"{len(tables)} 2-D trellis tables (quantized embeddings / n-gram tables)")
    if legacy:
        evidence.append(f"{legacy} modules with legacy su/sv sign tensors")
    if probe.quant_method:
        evidence.append(f"config quant_method={probe.quant_method!r}, version={qc.get('version')!r}")
    orig = qc.get("original_quantization_config") if hasattr(qc, "get") else None
    if orig is not None:
        evidence.append(
            f"original_quantization_config ({orig.get('quant_method')!r}) is the source's format, not this one"
        )
    total_w = sum(k * n for k, n in ks.items())
    variant = next(iter(codebooks)) if len(codebooks) == 1 else "mixed"
    details = {
        "k_histogram": {str(k): n for k, n in sorted(ks.items())},
        "codebooks": codebooks,
        "modules": modules,
        "tables": tables,
        "legacy_signs": legacy,
        "bits": qc.get("bits"),
        "head_bits": qc.get("head_bits"),
        "version": qc.get("version"),
        "mean_k_unweighted": round(total_w / modules, 3) if modules else None,
        "problems": problems,
    }
    return Claim("exl3", evidence=tuple(evidence + problems), variant=variant, details=details)


def _exl2_claim(probe: Probe) -> Claim | None:
    t = probe.tensors
    prefixes = [
        p
        for p in probe.modules_with("q_weight")
        if all(f"{p}.{s}" in t for s in EXL2_SUFFIXES) and (f"{p}.q_invperm" in t or f"{p}.q_perm" in t)
    ]
    if not prefixes:
        return None
    evidence = [f"{len(prefixes)} modules with q_weight + q_scale + q_scale_max + q_groups + q_invperm"]
    if any(s.file.startswith("output") for s in probe.safetensors):
        evidence.append("exllamav2's output*.safetensors file naming")
    if probe.quant_method:
        evidence.append(f"config quant_method={probe.quant_method!r}")
    qc = probe.quantization_config or {}
    return Claim(
        "exl2",
        evidence=tuple(evidence),
        details={"modules": len(prefixes), "bits": qc.get("bits"), "head_bits": qc.get("head_bits")},
    )


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    exl3 = _exl3_claim(probe)
    exl2 = _exl2_claim(probe)
    if exl3 and exl2:
        return Claim(
            "exl3",
            evidence=("both EXL3 trellis and EXL2 q_weight tensors in one checkpoint",),
            variant="mixed",
            details={"problems": ["EXL3 and EXL2 tensors mixed in one checkpoint"]},
        )
    return exl3 or exl2
