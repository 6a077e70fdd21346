"""AWQ quantization: anyquant's own pure-torch AWQ in process (``quantizer_backend="anyquant"``), or
GPTQModel's AWQ (maintained) in the shared GPTQModel worker (``quantizer_backend="gptqmodel"``).

``"auto"`` (the default) picks GPTQModel where a CUDA GPU is visible (its AWQ runs its GPU
kernels) and anyquant's own everywhere else: on 2 CPU cores it quantized SmolLM2-135M several
times faster than GPTQModel's AWQ (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from anyquant.errors import QuantizeError
from anyquant.probe import Probe
from anyquant.protocols import QuantizeSpec
from anyquant.quantization import calibration_texts
from anyquant_gptq.quantize import GPTQModelQuantizer

__all__ = ["QUANTIZER_BACKENDS", "AWQQuantizer"]

QUANTIZER_BACKENDS = ("auto", "anyquant", "gptqmodel")


def _cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class AWQQuantizer(GPTQModelQuantizer):
    method = "awq"
    formats = ("gemm",)
    bits_allowed = (4,)

    def backend(self, spec: QuantizeSpec) -> str:
        """The quantizer that runs: ``quantizer_backend`` resolved (see the module docstring)."""
        chosen = spec.options.get("quantizer_backend", "auto")
        if chosen not in QUANTIZER_BACKENDS:
            raise QuantizeError(f"quantizer_backend={chosen!r} is not one of {QUANTIZER_BACKENDS}")
        if chosen == "auto":
            return "gptqmodel" if _cuda_visible() else "anyquant"
        return str(chosen)

    def validate(self, probe: Probe, spec: QuantizeSpec) -> None:
        super().validate(probe, spec)
        if spec.options.get("dtype", "float16") not in ("float16", "bfloat16"):
            raise QuantizeError("AWQ GEMM stores float16 scales; pass dtype='float16'")
        version = spec.options.get("version", "gemm")
        if version != "gemm":
            raise QuantizeError(f"AWQ version {version!r}: anyquant writes GEMM (loadable by every AWQ runtime)")
        self.backend(spec)

    def job(self, src, dst, spec, calibration_file):  # type: ignore[no-untyped-def]
        job = super().job(src, dst, spec, calibration_file)
        job["sym"] = not self.zero_point(spec)
        return job

    @staticmethod
    def zero_point(spec: QuantizeSpec) -> bool:
        """``zero_point`` (AWQ's name for asymmetric), else ``not sym``; by default True, as in AutoAWQ."""
        if "zero_point" in spec.options:
            return bool(spec.options["zero_point"])
        return True if spec.sym is None else not spec.sym

    def quantize(
        self, src: Path, dst: Path, spec: QuantizeSpec, progress: Callable[[str, float], None] | None = None
    ) -> Path:
        if self.backend(spec) == "gptqmodel":
            return super().quantize(src, dst, spec, progress)
        from .native import AWQOptions, quantize_checkpoint

        texts = calibration_texts(spec)
        if not texts:
            raise QuantizeError("no calibration samples")
        zero_point = self.zero_point(spec)
        opts = AWQOptions(
            bits=int(spec.bits),
            group_size=spec.group_size,
            zero_point=zero_point,
            n_grid=int(spec.options.get("n_grid", 20)),
            duo_scaling=bool(spec.options.get("duo_scaling", True)),
            clip=bool(spec.options.get("apply_clip", True)),
            batch=int(spec.options.get("batch_size", 8)),
        )
        return quantize_checkpoint(
            src, dst / "model", texts, opts=opts, seq_len=spec.calibration_seq_len, progress=progress
        )
