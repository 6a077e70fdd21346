"""anyquant hooks for AWQ: format registration and header-only detection."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from anyquant.plugin import CheckpointError, Claim, ConfigError, FormatSpec, Probe, hookimpl

FORMAT = "awq"


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name=FORMAT,
            loader="anyquant_awq.loader:AWQLoader",
            quantizer="anyquant_awq.quantize:AWQQuantizer",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description="AWQ (AutoAWQ / GPTQModel): GEMM, GEMV, GEMV_FAST layouts",
            install_hint="pip install anyquant-awq",
        )
    )


def _layout(probe: Probe, prefix: str, bits: int) -> str | None:
    t = probe.tensors
    qw, qz, sc = (t.get(f"{prefix}.{s}") for s in ("qweight", "qzeros", "scales"))
    if qw is None or qz is None or sc is None or len(qw.shape) != 2 or len(sc.shape) != 2:
        return None
    if len(qz.shape) != 2:  # qweight and scales are AWQ's: a malformed AWQ checkpoint, not another format
        raise CheckpointError(f"{qz.file}: {qz.name} has shape {list(qz.shape)}; AWQ qzeros are 2-D")
    pf = 32 // bits
    if qw.dtype == "I16" and qz.dtype == "F16":
        return "gemv_fast"
    if qw.dtype != "I32":
        return None
    _k, packed_n = qw.shape
    if sc.shape[1] == packed_n * pf and qz.shape[1] * pf == sc.shape[1]:
        return "gemm"  # qweight [K, N/8], scales [G, N], qzeros [G, N/8]
    n, _packed_k = qw.shape
    if sc.shape[0] == n:
        return "gemv"  # qweight [N, K/8], scales [N, padded groups]
    return None


def config_summary(qc: Any) -> dict[str, Any]:
    if qc is None:
        return {}
    out: dict[str, Any] = {}
    bits = qc.get("bits", qc.get("w_bit"))
    if bits is not None:
        out["bits"] = bits
    gs = qc.get("group_size", qc.get("q_group_size"))
    if gs is not None:
        out["group_size"] = gs
    if "zero_point" in qc:
        out["zero_point"] = qc["zero_point"]
    elif "sym" in qc:
        out["zero_point"] = not qc["sym"]
    version = qc.get("version", qc.get("format"))
    if isinstance(version, str):
        out["version"] = version.lower()
    mtnc = qc.get("modules_to_not_convert")
    if mtnc is not None and (not isinstance(mtnc, (list, tuple)) or not all(isinstance(m, str) for m in mtnc)):
        shown = dict(mtnc) if isinstance(mtnc, Mapping) else mtnc
        raise ConfigError(
            f"config.json: quantization_config.modules_to_not_convert is {shown!r}; expected a list of module names"
        )
    if mtnc:
        out["modules_to_not_convert"] = list(mtnc)
    return out


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    t = probe.tensors
    cfg = config_summary(probe.quantization_config)
    bits = cfg.get("bits", 4) if isinstance(cfg.get("bits", 4), int) and cfg.get("bits", 4) in (2, 3, 4, 8) else 4
    layouts: dict[str, int] = {}
    for prefix in probe.modules_with("qweight"):
        if f"{prefix}.g_idx" in t:
            return None  # a GPTQ layout: not ours
        layout = _layout(probe, prefix, bits)
        if layout is not None:
            layouts[layout] = layouts.get(layout, 0) + 1
    if not layouts:
        return None
    act_scales = sum(1 for _ in probe.modules_with("scales") if _.endswith(".act"))
    evidence = [
        f"{n} modules in the AWQ {lay.upper()} layout (qweight + qzeros + scales, no g_idx)"
        for lay, n in layouts.items()
    ]
    if act_scales:
        evidence.append(f"{act_scales} *.act.scales tensors (scaled activations)")
    if probe.quant_method:
        evidence.append(f"config quant_method={probe.quant_method!r}, version={cfg.get('version')!r}")
    problems = []
    if len(layouts) > 1:
        problems.append(f"mixed AWQ layouts {sorted(layouts)}")
    declared = cfg.get("version")
    variant = next(iter(layouts)) if len(layouts) == 1 else "mixed"
    if declared in ("gemm", "gemv", "gemv_fast") and declared != variant:
        problems.append(f"config says version={declared!r}, tensors are {variant}")
    details = {**cfg, "layouts": layouts, "act_scales": act_scales, "problems": problems}
    return Claim(FORMAT, evidence=tuple(evidence + problems), variant=variant, details=details)
