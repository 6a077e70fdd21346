"""anyquant hooks for MLX checkpoints: format registration and header-only detection."""

from __future__ import annotations

from collections.abc import Callable

from anyquant.plugin import Claim, ConfigError, FormatSpec, Probe, UnsupportedFormatError, hookimpl

from .scheme import quantization, read_scheme

FORMAT = "mlx"


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name=FORMAT,
            loader="anyquant_mlx.loader:MlxLoader",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description="MLX (mlx-lm convert -q): uint32-packed weights with scales/biases, mxfp4/nvfp4/mxfp8",
            install_hint="pip install anyquant-mlx",
        )
    )


def _looks_mlx(probe: Probe) -> bool:
    if probe.quant_method is not None:
        return False  # a quant_method names another format (mlx-lm writes none)
    if quantization(probe) is not None:
        return True
    t = probe.tensors
    return any((w := t.get(f"{name}.weight")) is not None and w.dtype == "U32" for name in probe.modules_with("scales"))


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    if not _looks_mlx(probe):
        return None
    try:
        scheme = read_scheme(probe)
    except (ConfigError, UnsupportedFormatError) as e:  # claimed, and malformed: the loader raises it as it is
        return Claim(
            FORMAT,
            evidence=("config.json quantization", f"{type(e).__name__}: {e}"),
            details={"config_error": [type(e).__name__, str(e)], "problems": [str(e)]},
        )
    problems = list(scheme.problems)
    if not scheme.modules and not problems:
        problems.append("config.json has mlx-lm's quantization, but no tensor is quantized (uint32 weight + scales)")
    evidence = ["config.json quantization" if quantization(probe) is not None else "no quantization settings"]
    if scheme.modules:
        evidence.append(f"{len(scheme.modules)} uint32-packed modules with scales ({scheme.describe()})")
    d = scheme.default
    details = {
        "modules": len(scheme.modules),
        "default": None if d is None else {"bits": d.bits, "group_size": d.group_size, "mode": d.mode},
        "kinds": scheme.describe(),
        "problems": problems,
    }
    variant = d.mode if d is not None else None
    return Claim(FORMAT, evidence=tuple(evidence + problems[:3]), variant=variant, details=details)
