"""The GPTQ loader: validation, the per-linear factory, and what GPTQ adds to the int4 backend choice
(its layers described as integer groups from the tensor signature, read once per load, and counted by the CPU
engine)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from anyquant.plugin import (
    CheckpointError,
    Detection,
    LoadOptions,
    ModuleInfo,
    Probe,
    UnsupportedBackendError,
    dense_rows,
)
from anyquant_runtime import LoadContext, require_dtypes
from anyquant_runtime.int4.loader import QUANT_DTYPES, Int4Loader, Int4State
from anyquant_runtime.layouts import Int4Groups

from .signature import GPTQSignature, read_signature

if TYPE_CHECKING:
    from torch import nn

__all__ = ["GPTQLoader"]

log = logging.getLogger(__name__)


class GPTQLoader(Int4Loader):
    format = "gptq"
    kernel_method = "gptq"

    def facts(self, probe: Probe, detection: Detection, options: LoadOptions) -> Int4State:
        """The signature, read once for the load; from it the layers the CPU engine takes (each described as
        integer groups of its bits and group size, :class:`~anyquant_runtime.layouts.Int4Groups`, as
        :class:`~anyquant_gptq.qlinear.GPTQLinear` offers it) and the bytes of every quantized layer in float32."""
        from anyquant_runtime.cpu import layouts_run

        facts = super().facts(probe, detection, options)
        sig = facts.signature = read_signature(probe)
        facts.dense_bytes = sum(m.in_features * m.out_features * 4 for m in sig.modules)
        facts.fast_layers = layouts_run(
            [
                Int4Groups(
                    m.in_features, m.out_features, None, None, None, bits=m.bits, group_size=m.in_features // m.groups
                )
            ]
            for m in sig.modules
        )
        return facts

    def validate(self, probe: Probe, detection: Detection) -> None:
        d = detection.details
        fmt = d.get("checkpoint_format", "gptq")
        if detection.variant in ("marlin", "bitblas"):
            raise UnsupportedBackendError(
                f"{probe.root}: GPTQ in the {detection.variant} layout is packed for CUDA kernels only; "
                "anyquant's CPU backends need the plain GPTQ layout (checkpoint_format gptq or gptq_v2). "
                "Re-export it with GPTQModel in format 'gptq', or load it with gptqmodel on a GPU."
            )
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedBackendError(f"{probe.root}: GPTQ checkpoint_format {fmt!r} is not supported on CPU")
        problems = d.get("problems") or []
        if problems:
            raise CheckpointError(f"{probe.root}: the GPTQ tensors are inconsistent: {'; '.join(problems[:3])}")
        require_dtypes(probe, QUANT_DTYPES, "GPTQ")
        if fmt == "gptq" and d.get("sym") is False:
            quantizers = [q.split(":")[0].lower() for q in d.get("quantizer", [])]
            if "gptqmodel" not in quantizers:
                raise CheckpointError(
                    f"{probe.root}: asymmetric GPTQ in the v1 format (zero-1 stored) decodes differently "
                    "depending on the tool that wrote it, and meta.quantizer does not name gptqmodel "
                    f"(it says {d.get('quantizer')!r}). anyquant refuses to guess; re-save it as gptq_v2."
                )

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .dequant import gptq_zero_label_check
        from .qlinear import GPTQLinear

        state = self.state(ctx)
        kernel_plan = state.kernel_plan
        signature = state.signature if isinstance(state.signature, GPTQSignature) else read_signature(ctx.probe)
        sig = {m.name: m for m in signature.modules}
        d = ctx.detection.details
        declared = d.get("checkpoint_format", "gptq")
        checked: dict[str, str] = {}

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            m = sig.get(name)
            if m is None:
                return None  # dense (lm_head, skipped modules): filled from the checkpoint's .weight
            if (m.in_features, m.out_features) != (linear.in_features, linear.out_features):
                raise CheckpointError(
                    f"{name}: GPTQ tensors are {m.in_features}x{m.out_features}, the model expects "
                    f"{linear.in_features}x{linear.out_features}"
                )
            src = ctx.source
            qzeros = src.get(f"{name}.qzeros")
            fmt = declared
            if d.get("sym", True) is not False and "label" not in checked:
                shown = gptq_zero_label_check(qzeros, m.bits, declared, out_features=m.out_features)
                checked["label"] = shown or declared
                if shown is not None:
                    log.warning(
                        "%s: checkpoint_format says %r but the qzeros show %r; the tensors decide",
                        ctx.probe.root,
                        declared,
                        shown,
                    )
            fmt = checked.get("label", declared)
            bias = src.get(f"{name}.bias") if m.has_bias else None
            if kernel_plan is not None:
                return _gptqmodel_layer(kernel_plan, name, m, src, qzeros, bias, fmt, d)
            layer = GPTQLinear(
                src.get(f"{name}.qweight"),
                qzeros,
                src.get(f"{name}.scales"),
                src.get(f"{name}.g_idx"),
                bias,
                bits=m.bits,
                in_features=m.in_features,
                out_features=m.out_features,
                checkpoint_format=fmt,
                sym=d.get("sym"),
                mode="dequantized" if ctx.backend == "dequantized" else "reference",
                compute_dtype=ctx.dtype,
            )
            return self.fast_convert(ctx, name, layer)

        return factory

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        sig = read_signature(probe)
        rows = []
        covered = set()
        for m in sig.modules:
            names = [f"{m.name}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx", "bias")]
            nbytes = sum(probe.tensors[n].nbytes for n in names if n in probe.tensors)
            covered.add(m.name)
            rows.append(
                ModuleInfo(m.name, "gptq", (m.out_features, m.in_features), float(m.bits), m.group_size, nbytes)
            )
        return rows + dense_rows(probe, skip=covered)


def _gptqmodel_layer(
    kernel_plan: Any, name: str, m: Any, src: Any, qzeros: Any, bias: Any, fmt: str, details: Mapping[str, Any]
) -> nn.Module:
    """One GPTQ layer on a GPTQModel kernel (zeros, sym and desc_act decided by the tensors)."""
    from .dequant import gptq_kernel_tensors

    gs = details.get("group_size")
    t = gptq_kernel_tensors(
        qzeros,
        src.get(f"{name}.g_idx"),
        bits=m.bits,
        in_features=m.in_features,
        out_features=m.out_features,
        groups=m.groups,
        checkpoint_format=fmt,
        sym=details.get("sym"),
        group_size=gs if isinstance(gs, int) else None,
    )
    tensors = {
        "qweight": src.get(f"{name}.qweight"),
        "scales": src.get(f"{name}.scales"),
        "g_idx": t["g_idx"],
        "qzeros_v2": t["qzeros_v2"],
        "qzeros_v1": t["qzeros_v1"],
    }
    layer: nn.Module = kernel_plan.build(
        name,
        tensors,
        bias,
        bits=m.bits,
        group_size=t["group_size"],
        sym=t["sym"],
        desc_act=t["desc_act"],
        in_features=m.in_features,
        out_features=m.out_features,
    )
    return layer
