"""The FP8 loader: validation, the per-linear factory, and its backends (core's int4 loader base gives the backend
choice and cpu-fast's plan; FP8 layers run there as bfloat16 weights prepacked for oneDNN)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from anyquant.int4.loader import Int4State, PackedFormatLoader
from anyquant.plugin import (
    CheckpointError,
    Detection,
    FormatConflictError,
    LoadContext,
    LoadOptions,
    ModuleInfo,
    Probe,
    UnsupportedFormatError,
    dense_rows,
)

from .scheme import FP8Scheme, read_scheme

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FP8Loader"]


class FP8Loader(PackedFormatLoader):
    format = "fp8"
    cpu_fast_description = (
        "FP8 weights kept as their bytes on the compiled kernel's fp8_gemv (AVX512F; float32 activations), else "
        "decoded once to bfloat16 (transformers' own dequantized weight) and prepacked for oneDNN"
    )
    serve_hint = "with FP8 support serve it with vLLM (`anyquant serve --engine vllm`)"

    def read_signature(self, probe: Probe) -> FP8Scheme:
        return read_scheme(probe)

    def cpu_fast_available(self) -> tuple[bool, str]:
        from anyquant.runtime.fastcpu import bf16_head_status
        from anyquant.runtime.kernels.lut import fp8_kernel_runs

        return (True, "") if fp8_kernel_runs() else bf16_head_status()

    def fast_layer_count(self, signature: FP8Scheme) -> int:
        return len(signature.modules) if self.cpu_fast_available()[0] else 0

    def facts(self, probe: Probe, detection: Detection, options: LoadOptions) -> Int4State:
        facts = super().facts(probe, detection, options)
        facts.dense_bytes = sum(m.in_features * m.out_features * 4 for m in facts.signature.modules)
        return facts

    def validate(self, probe: Probe, detection: Detection) -> None:
        if probe.quant_method == "fbgemm_fp8":
            raise UnsupportedFormatError(
                f"{probe.root}: fbgemm_fp8 (per-channel weight_scale, fbgemm's CUDA kernels) is not read by anyquant "
                "yet; serve it with vLLM"
            )
        self.raise_detected_error(detection)
        problems = detection.details.get("problems") or []
        if problems:
            raise FormatConflictError(
                f"{probe.root}: the FP8 tensors disagree with each other or with the config: " + "; ".join(problems[:3])
            )

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        import torch

        from .qlinear import FP8Linear

        state = self.state(ctx)
        plan = state.fast_plan
        scheme = state.signature if isinstance(state.signature, FP8Scheme) else read_scheme(ctx.probe)
        modules = {m.name: m for m in scheme.modules}
        round_to = getattr(torch, scheme.dtype)
        mode = "dequantized" if ctx.backend == "dequantized" else "reference"

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            m = modules.get(name)
            if m is None:
                return None
            if (m.out_features, m.in_features) != (linear.out_features, linear.in_features):
                raise CheckpointError(
                    f"{name}: the FP8 weight is [{m.out_features}, {m.in_features}], the model expects "
                    f"[{linear.out_features}, {linear.in_features}]"
                )
            src = ctx.source
            layer = FP8Linear(
                src.get(f"{name}.weight"),
                src.get(f"{name}.weight_scale_inv"),
                src.get(f"{name}.bias") if m.has_bias else None,
                block=scheme.block,
                round_to=round_to,
                mode=mode,
                compute_dtype=ctx.dtype,
            )
            return layer if plan is None else plan.convert(name, layer)

        return factory

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        scheme = read_scheme(probe)
        rows, covered = [], set()
        for m in scheme.modules:
            nbytes = sum(probe.tensors[f"{m.name}.{s}"].nbytes for s in ("weight", "weight_scale_inv"))
            covered.add(m.name)
            rows.append(ModuleInfo(m.name, "fp8", (m.out_features, m.in_features), 8.0, -1, nbytes))
        return rows + dense_rows(probe, skip=covered)
