"""The MXFP4 loader: validation, and a tensor source that decodes the packed experts at load.

gpt-oss builds transformers' own ``GptOssForCausalLM``, whose ``GptOssExperts`` holds each layer's experts as fused
3-D parameters with biases (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``); core's build keeps that
module (its form is not the one it splits into per-expert linears) and fills its parameters by name from the tensor
source. :class:`~anyquant_mxfp4.dequant.MXFP4Source` serves those names, decoded from the ``_blocks``/``_scales``
pairs: no linear is replaced (``make_linear`` is ``None``), attention, router, embeddings and head are the checkpoint's
bfloat16 tensors. Where the chosen backend has an engine plan (core's :class:`~anyquant_runtime.int4.loader.PackedFormatLoader`
makes it), :meth:`make_module` replaces each ``GptOssExperts`` before anything is read by a
:class:`~anyquant_mxfp4.experts.PackedGptOssExperts` of per-expert :class:`~anyquant_mxfp4.experts.MXFP4Linear`
layers, each handed to the plan: the experts stay packed, 4.25 bits a weight, never decoded as a whole. The loader
describes their layout (a 4-bit table, :func:`~anyquant_mxfp4.experts.table4_layout`); it holds no kernel knowledge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from anyquant.plugin import (
    BackendInfo,
    CheckpointError,
    Detection,
    FormatConflictError,
    LoadedModel,
    LoadOptions,
    ModuleInfo,
    Probe,
    UnsupportedFormatError,
    dense_rows,
    tensors_by_module,
)
from anyquant_runtime import RUNTIME_OPTIONS, LoadContext
from anyquant_runtime.int4.loader import PackedFormatLoader
from anyquant_runtime.layouts import Layout, Table4
from anyquant_runtime.tensors import TensorSource

from .scheme import BLOCK, MXFP4Scheme, read_scheme

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["MXFP4Loader"]

_EXACT = (
    "the experts decoded once at load to transformers' own dequantized values (Mxfp4Config(dequantize=True)), held in "
    "the compute dtype: 2 bytes a weight in bfloat16, 4 in float32"
)


class MXFP4Loader(PackedFormatLoader):
    format = "mxfp4"
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = (Table4,)
    format_options: ClassVar[Mapping[str, str]] = RUNTIME_OPTIONS

    def own_backends(self) -> list[BackendInfo]:
        exact = {
            "dequantized": _EXACT,
            "reference": "for now the same as 'dequantized' (" + _EXACT.split(" (", 1)[0] + "); no packed kernel",
        }
        return [replace(b, description=exact.get(b.name, b.description)) for b in super().own_backends()]

    def read_signature(self, probe: Probe) -> MXFP4Scheme:
        return read_scheme(probe)

    def fast_layer_count(self, signature: Any, probe: Probe) -> int:
        """Each expert's two weights, described from the headers as the engine's 4-bit table layout."""
        import torch

        from anyquant_runtime.cpu import layouts_run

        from .experts import table4_layout

        dtype = getattr(torch, signature.dtype)
        return sum(
            t.experts * layouts_run([[table4_layout(t.in_features, t.out_features, dtype)]]) for t in signature.tensors
        )

    def validate(self, probe: Probe, detection: Detection) -> None:
        self.raise_detected_error(detection)
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
        from anyquant_runtime.tensors import SafetensorsSource

        from .dequant import MXFP4Source

        return MXFP4Source(SafetensorsSource(probe), read_scheme(probe))

    def make_module(self, ctx: LoadContext) -> Callable[[str, nn.Module], nn.Module | None] | None:
        """Where this load has an engine plan, each gpt-oss experts module whose two weights are packed becomes a
        :class:`~anyquant_mxfp4.experts.PackedGptOssExperts` of per-expert linears the plan converts, read straight
        from the ``_blocks``/``_scales``."""
        plan = self.fast_plan(ctx)
        if plan is None:
            return None
        import torch

        from .dequant import MXFP4Source
        from .experts import build_packed

        source = ctx.source
        scheme = read_scheme(ctx.probe)
        dtype: torch.dtype = getattr(torch, scheme.dtype)
        assert isinstance(source, MXFP4Source)
        names = {t.name for t in scheme.tensors}

        def convert(name: str, layer: Any) -> nn.Module:
            return plan.convert(name, layer, expert=True)  # type: ignore[no-any-return]

        def factory(name: str, module: nn.Module) -> nn.Module | None:
            gate_up, down = f"{name}.gate_up_proj", f"{name}.down_proj"
            if type(module).__name__ != "GptOssExperts" or gate_up not in names or down not in names:
                return None
            gu, dn = source.packed(gate_up), source.packed(down)
            assert gu is not None and dn is not None
            biases = (source.get(f"{gate_up}_bias"), source.get(f"{down}_bias"))
            return build_packed(module, gu, dn, source.raw, biases, dtype, convert)

        return factory

    def finish(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        from .dequant import MXFP4Source
        from .experts import MXFP4Linear, PackedGptOssExperts

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
        loaded = super().finish(loaded, ctx)
        linears = [
            m for e in loaded.module.modules() if isinstance(e, PackedGptOssExperts) for m in (*e.gate_up, *e.down)
        ]
        packed = bool(linears) and not any(isinstance(m, MXFP4Linear) for m in linears)
        info: dict[str, Any] = {
            "packed_tensors": len(scheme.tensors),
            "decoded_dtype": scheme.dtype,
            "held_dtype": "packed (4.25 bits)" if packed else str(ctx.dtype).replace("torch.", ""),
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
