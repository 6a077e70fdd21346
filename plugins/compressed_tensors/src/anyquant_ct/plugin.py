"""anyquant hooks for compressed-tensors: format registration and header-only detection."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from anyquant.plugin import Claim, ConfigError, FormatSpec, Probe, UnsupportedFormatError, hookimpl

from .scheme import STORAGE_FORMAT, CTConfig, read_modules
from .sparse import read_sparse, sparse_format, sparse_view

FORMAT = "compressed-tensors"
QUANT_METHODS = ("compressed-tensors", "compressed_tensors")


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name=FORMAT,
            loader="anyquant_ct.loader:CTLoader",
            quantizer="anyquant_ct.quantize:CTQuantizer",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description=(
                "compressed-tensors (llm-compressor, vLLM): pack-quantized, int/float-quantized, NVFP4, MXFP4; "
                "sparse-24-bitmask and sparse-bitmask decompressed to dense"
            ),
            install_hint="pip install anyquant-compressed-tensors",
        )
    )


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    qm = probe.quant_method
    says = qm in QUANT_METHODS
    if not says and qm is not None:
        return None  # another method's config (fp8, bitsandbytes, ...): its plugin decides
    if not says and not list(probe.modules_with("weight_packed")):
        return (
            None  # without the config, only packed weights are this format's alone (FP8/int8 + weight_scale: ambiguous)
        )
    try:
        cfg = CTConfig.parse(probe.quantization_config if says else None)
        sparse, problems = read_sparse(probe, cfg.sparsity)
        specs, quant_problems = read_modules(sparse_view(probe, sparse), cfg)
        problems += quant_problems
    except (ConfigError, UnsupportedFormatError) as e:  # claimed, and malformed: the loader raises it as it is
        return Claim(
            FORMAT,
            evidence=(f"quant_method={qm!r}", f"{type(e).__name__}: {e}"),
            details={"config_error": [type(e).__name__, str(e)], "problems": [str(e)]},
        )
    kinds = Counter(s.storage for s in specs)
    evidence = [f"quant_method={qm!r}, format={cfg.format!r}"] if says else ["no quantization_config"]
    evidence.append(
        f"{len(specs)} quantized modules: "
        + ", ".join(f"{n} {STORAGE_FORMAT[k]} ({k})" for k, n in sorted(kinds.items()))
    )
    formats = sorted({STORAGE_FORMAT[k] for k in kinds})
    if cfg.format in ("naive-quantized", "int-quantized") and kinds and set(kinds) <= {"int8", "fp8"}:
        formats = [cfg.format]  # the same storage under another name: the config's
    sparsity = sparse_format(cfg.sparsity)
    if sparse:
        layouts = Counter(s.layout for s in sparse.values())
        evidence.append(
            f"{len(sparse)} modules stored sparse ({', '.join(f'{n} {k}' for k, n in sorted(layouts.items()))}), "
            "decompressed to dense weights on load"
        )
    variant = formats[0] if len(formats) == 1 else "mixed-precision" if formats else sparsity or cfg.format
    act_order = sum(1 for s in specs if "weight_g_idx" in s.tensors)
    if act_order:
        evidence.append(f"{act_order} modules with a weight_g_idx (act-order: GPTQ's column groups)")
    acts = sorted({s.input_activations.describe() for s in specs if s.input_activations is not None})
    if acts:
        evidence.append(f"input activations quantized: {', '.join(acts)}")
    if cfg.kv_cache is not None:
        evidence.append(f"KV cache scheme {cfg.kv_cache.describe()} (k_scale/v_scale)")
    details = {
        "format": cfg.format,
        "formats": formats,
        "modules": len(specs),
        "groups": [g.name for g in cfg.groups],
        "ignore": list(cfg.ignore),
        "weights": sorted({s.weights.describe() for s in specs}),
        "input_activations": acts,
        "act_order_modules": act_order,  # modules with a weight_g_idx
        "kv_cache_scheme": cfg.kv_cache.describe() if cfg.kv_cache else None,
        "sparsity": sparsity,  # the sparsity_config's compressed layout (None: none, or stored dense)
        "sparse_modules": len(sparse),
        "transform": bool(cfg.transform),
        "problems": problems,
    }
    if says and not specs and not sparse and not problems:
        evidence.append("no quantized tensors")
    return Claim(FORMAT, confidence=1.0, evidence=tuple(evidence + problems[:3]), variant=variant, details=details)
