"""anyquant hooks for GPTQ: format registration and header-only detection."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from anyquant.plugin import Claim, ConfigError, FormatSpec, Probe, hookimpl

from .signature import config_summary, read_signature

FORMAT = "gptq"


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name=FORMAT,
            loader="anyquant_gptq.loader:GPTQLoader",
            quantizer="anyquant_gptq.quantize:GPTQQuantizer",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description="GPTQ (GPTQModel / AutoGPTQ): qweight/qzeros/scales/g_idx",
            install_hint="pip install anyquant-gptq",
        )
    )


def _gptq_config(probe: Probe) -> Any:
    for qc, where in (
        (probe.quantization_config, "config.json quantization_config"),
        (probe.quantize_config_file, "quantize_config.json"),
    ):
        if qc is not None:
            bits = qc.get("bits")
            if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int)):  # compared with shapes' bits
                shown = dict(bits) if isinstance(bits, Mapping) else bits
                raise ConfigError(f"{where}: bits is {shown!r}; expected an integer (2, 3, 4 or 8)")
            return qc
    return None


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    sig = read_signature(probe)
    if not sig.modules and not sig.marlin:
        return None
    cfg = config_summary(_gptq_config(probe))
    declared = cfg.get("checkpoint_format", "gptq")
    evidence = []
    hist = sig.bits_histogram()
    if sig.modules:
        evidence.append(
            f"{len(sig.modules)} modules with qweight [K*b/32, N] + qzeros + scales + g_idx [K] (bits from shapes: {hist})"
        )
    if sig.marlin:
        evidence.append(f"{len(sig.marlin)} Marlin-packed modules (B, s)")
        declared = "marlin"
    if probe.quant_method:
        evidence.append(f"config quant_method={probe.quant_method!r}, checkpoint_format={declared!r}")
    elif probe.quantize_config_file is not None:
        evidence.append("quantize_config.json (AutoGPTQ style, no quant_method)")
    variant = {"gptq": "v1", "gptq_v2": "v2", "gptq_p": "planar"}.get(declared, declared)
    problems = list(sig.problems) + cfg.pop("config_problems", [])
    shape_bits = set(hist)
    if "bits" in cfg and not cfg.get("dynamic") and shape_bits and shape_bits != {cfg["bits"]}:
        problems.append(f"config says bits={cfg['bits']}, tensor shapes say {sorted(shape_bits)}")
    gs = cfg.get("group_size")
    if isinstance(gs, int) and gs > 0 and not cfg.get("dynamic"):
        bad = [m.name for m in sig.modules if m.in_features % gs == 0 and m.groups != m.in_features // gs]
        if bad:
            problems.append(f"config says group_size={gs}, but {len(bad)} module(s) have other group counts ({bad[0]})")
    details = {
        **cfg,
        "modules": len(sig.modules),
        "bits_from_shapes": sorted(shape_bits),
        "problems": problems,
    }
    return Claim(FORMAT, confidence=1.0, evidence=tuple(evidence + problems), variant=variant, details=details)
