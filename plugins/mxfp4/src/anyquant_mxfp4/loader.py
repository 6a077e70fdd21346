"""The MXFP4 loader: validation, and a tensor source that decodes the packed experts at load.

gpt-oss builds transformers' own ``GptOssForCausalLM``, whose ``GptOssExperts`` holds each layer's experts as fused
3-D parameters with biases (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``); core's build keeps that
module (its form is not the one it splits into per-expert linears) and fills its parameters by name from the tensor
source. :class:`~anyquant_mxfp4.dequant.MXFP4Source` serves those names, decoded from the ``_blocks``/``_scales``
pairs: no linear is replaced (``make_linear`` is ``None``), attention, router, embeddings and head are the checkpoint's
bfloat16 tensors.
"""

from __future__ import annotations

from typing import Any

from anyquant.plugin import (
    BackendInfo,
    CheckpointError,
    ConfigError,
    Detection,
    FormatConflictError,
    LoadContext,
    LoadedModel,
    LoadOptions,
    ModuleInfo,
    Probe,
    TransformersLoader,
    UnsupportedFormatError,
    dense_rows,
    tensors_by_module,
)
from anyquant.runtime.tensors import TensorSource

from .scheme import BLOCK, read_scheme

__all__ = ["MXFP4Loader"]

_EXACT = (
    "the experts decoded once at load to transformers' own dequantized values (Mxfp4Config(dequantize=True)), held in "
    "the compute dtype: 2 bytes a weight in bfloat16, 4 in float32"
)


def raise_config_error(detection: Detection) -> None:
    """The typed error detection kept for a claimed checkpoint whose config is malformed."""
    kept = detection.details.get("config_error")
    if kept:
        kind, message = kept
        raise (UnsupportedFormatError if kind == "UnsupportedFormatError" else ConfigError)(message)


class MXFP4Loader(TransformersLoader):
    format = "mxfp4"
    backend_order = ("dequantized", "reference")

    def backends(self) -> list[BackendInfo]:
        return [
            BackendInfo("dequantized", True, description=_EXACT),
            BackendInfo(
                "reference",
                True,
                description="for now the same as 'dequantized' (" + _EXACT.split(" (", 1)[0] + "); no packed kernel",
            ),
        ]

    def validate(self, probe: Probe, detection: Detection) -> None:
        raise_config_error(detection)
        problems = detection.details.get("problems") or []
        if problems:
            raise FormatConflictError(
                f"{probe.root}: the MXFP4 tensors disagree with each other or with the config: "
                + "; ".join(problems[:3])
            )
        unsupported = detection.details.get("unsupported") or []
        if unsupported:
            raise UnsupportedFormatError(f"{probe.root}: " + "; ".join(unsupported[:3]))

    def tensor_source(self, probe: Probe, options: LoadOptions) -> TensorSource:
        from anyquant.runtime.tensors import SafetensorsSource

        from .dequant import MXFP4Source

        return MXFP4Source(SafetensorsSource(probe), read_scheme(probe))

    def finish(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        from .dequant import MXFP4Source

        scheme = read_scheme(ctx.probe)
        source = ctx.source
        if isinstance(source, MXFP4Source):
            left = sorted(set(source.unused()) & {t.name for t in scheme.tensors})
            if left:  # decoded weights no parameter took: the model would run without those experts
                raise CheckpointError(
                    f"{ctx.probe.root}: the model ({(ctx.probe.config or {}).get('model_type')}) has no parameter "
                    f"for the MXFP4 weight(s) {', '.join(left[:3])}: anyquant reads gpt-oss's packed experts "
                    "(GptOssExperts' gate_up_proj / down_proj)"
                )
        info: dict[str, Any] = {
            "packed_tensors": len(scheme.tensors),
            "decoded_dtype": scheme.dtype,
            "held_dtype": str(ctx.dtype).replace("torch.", ""),
        }
        loaded.info = {**loaded.info, "mxfp4": info}
        return loaded

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        scheme = read_scheme(probe)
        groups = tensors_by_module(probe)
        rows = []
        for t in scheme.tensors:
            nbytes = probe.tensors[t.blocks].nbytes + probe.tensors[t.scales].nbytes
            rows.append(ModuleInfo(t.name, "mxfp4", (t.experts, t.out_features, t.in_features), 4.25, BLOCK, nbytes))
            module = t.name.rpartition(".")[0]  # its biases stay a dense row of the experts module
            groups[module] = [x for x in groups.get(module, []) if x.name not in (t.blocks, t.scales)]
        return rows + dense_rows(probe, groups={k: v for k, v in groups.items() if v})
