"""AWQ quantization through GPTQModel's AWQ (maintained), run in the shared GPTQModel worker."""

from __future__ import annotations

from anyquant.errors import QuantizeError
from anyquant.probe import Probe
from anyquant.protocols import QuantizeSpec
from anyquant_gptq.quantize import GPTQModelQuantizer

__all__ = ["AWQQuantizer"]


class AWQQuantizer(GPTQModelQuantizer):
    method = "awq"
    formats = ("gemm",)
    bits_allowed = (4,)

    def validate(self, probe: Probe, spec: QuantizeSpec) -> None:
        super().validate(probe, spec)
        if spec.options.get("dtype", "float16") not in ("float16", "bfloat16"):
            raise QuantizeError("GPTQModel's AWQ packs in float16/bfloat16 only; pass dtype='float16'")
        version = spec.options.get("version", "gemm")
        if version != "gemm":
            raise QuantizeError(f"AWQ version {version!r}: anyquant writes GEMM (loadable by every AWQ runtime)")

    def job(self, src, dst, spec, calibration_file):  # type: ignore[no-untyped-def]
        job = super().job(src, dst, spec, calibration_file)
        if "zero_point" in spec.options:  # AWQ's name for asymmetric quantization
            job["sym"] = not bool(spec.options["zero_point"])
        return job
