"""The MXFP4 loader: validation, and a tensor source that decodes the packed experts at load.

gpt-oss builds transformers' own ``GptOssForCausalLM``, whose ``GptOssExperts`` holds each layer's experts as fused
3-D parameters with biases (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``); core's build keeps that
module (its form is not the one it splits into per-expert linears) and fills its parameters by name from the tensor
source. :class:`~anyquant_mxfp4.dequant.MXFP4Source` serves those names, decoded from the ``_blocks``/``_scales``
pairs: no linear is replaced (``make_linear`` is ``None``), attention, router, embeddings and head are the checkpoint's
bfloat16 tensors. On ``cpu-fast`` (the default where the compiled 4-bit table kernel is built) :meth:`make_module`
replaces each ``GptOssExperts`` before anything is read by :class:`~anyquant_mxfp4.experts.PackedGptOssExperts`:
the experts stay packed, 4.25 bits a weight, never decoded as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from anyquant.plugin import (
    CPU_FAST_OPTIONS,
    RUNTIME_OPTIONS,
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

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["MXFP4Loader"]

_PACKED = (
    "the experts kept packed (4.25 bits a weight) on the compiled 4-bit table kernel: each weight formed as "
    "transformers decodes it (bit for bit), float32 activations and sums on decode; prompts use the exact weights"
)
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


#: the cpu-fast options this loader reads (the prompt GEMM's dtype, the decode rows, the head)
_FAST_OPTIONS = ("cpu_fast_prefill", "cpu_fast_small_rows", "cpu_fast_head", "cpu_fast_tables")
#: rows up to which an expert runs the decode kernel by default: a prompt's tokens spread over the experts, a few
#: each, and the kernel's cost grows with every row while a GEMM's barely does
EXPERT_SMALL_ROWS = 4


class MXFP4Loader(TransformersLoader):
    format = "mxfp4"
    backend_order = ("cpu-fast", "dequantized", "reference")
    load_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            **RUNTIME_OPTIONS,
            **{k: CPU_FAST_OPTIONS[k] for k in _FAST_OPTIONS},
            "cpu_fast_small_rows": f"rows up to which the experts (default {EXPERT_SMALL_ROWS}) and the head "
            "(default 64) run the decode kernels",
        }
    )

    def backends(self) -> list[BackendInfo]:
        import torch

        from .experts import packed_unsupported

        why = packed_unsupported(torch.bfloat16)
        return [
            BackendInfo("cpu-fast", why is None, reason=why or "", description=_PACKED, devices=("cpu",)),
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

    def prepare(self, ctx: LoadContext) -> None:
        if ctx.backend == "cpu-fast":
            ctx.state["fast_plan"] = _fast_plan(ctx)

    def keep_embedding_dtype(self, ctx: LoadContext) -> bool:
        """cpu-fast's head replaces the 16-bit embedding the build keeps (as every cpu-fast format's)."""
        plan = ctx.state.get("fast_plan")
        return plan is not None and bool(plan.keeps_embedding_dtype())

    def file_tables(self, ctx: LoadContext) -> bool:
        """cpu-fast's head and embedding read their tables from the checkpoint file (``cpu_fast_tables``)."""
        plan = ctx.state.get("fast_plan")
        return plan is not None and ctx.device.type == "cpu" and bool(plan.file_tables())

    def make_module(self, ctx: LoadContext) -> Callable[[str, nn.Module], nn.Module | None] | None:
        """On cpu-fast, each gpt-oss experts module whose two weights are packed becomes a
        :class:`~anyquant_mxfp4.experts.PackedGptOssExperts`, read straight from the ``_blocks``/``_scales``."""
        if ctx.backend != "cpu-fast":
            return None
        import torch

        from .dequant import MXFP4Source
        from .experts import build_packed, packed_unsupported

        source = ctx.source
        scheme = read_scheme(ctx.probe)
        dtype: torch.dtype = getattr(torch, scheme.dtype)
        why = packed_unsupported(dtype)
        if why is not None:
            raise UnsupportedFormatError(f"{ctx.probe.root}: the cpu-fast backend cannot run: {why}")
        assert isinstance(source, MXFP4Source)
        names = {t.name for t in scheme.tensors}
        plan = ctx.state["fast_plan"]
        rows = plan.small_rows if "cpu_fast_small_rows" in ctx.options.extra else EXPERT_SMALL_ROWS

        def factory(name: str, module: nn.Module) -> nn.Module | None:
            gate_up, down = f"{name}.gate_up_proj", f"{name}.down_proj"
            if type(module).__name__ != "GptOssExperts" or gate_up not in names or down not in names:
                return None
            gu, dn = source.packed(gate_up), source.packed(down)
            assert gu is not None and dn is not None
            biases = (source.get(f"{gate_up}_bias"), source.get(f"{down}_bias"))
            return build_packed(
                module, gu, dn, source.raw, biases, dtype, small_rows=rows, prefill_dtype=plan.prefill_dtype
            )

        return factory

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
        if ctx.backend == "cpu-fast":
            loaded.info = {**loaded.info, "cpu_fast": _finish_fast(loaded, ctx)}
        info: dict[str, Any] = {
            "packed_tensors": len(scheme.tensors),
            "decoded_dtype": scheme.dtype,
            "held_dtype": "packed (4.25 bits)" if ctx.backend == "cpu-fast" else str(ctx.dtype).replace("torch.", ""),
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


def _fast_plan(ctx: LoadContext) -> Any:
    """cpu-fast's options, parsed and checked as every cpu-fast loader's are."""
    from anyquant.runtime.fastcpu import FastCPUPlan

    return FastCPUPlan.from_options({k: v for k, v in ctx.options.extra.items() if k in _FAST_OPTIONS})


def _finish_fast(loaded: LoadedModel, ctx: LoadContext) -> dict[str, Any]:
    """The LM head on cpu-fast's decode kernel (the top 64 logits exact) and the embedding as cpu-fast keeps it, both
    from the file's tables where the build left them there, as every cpu-fast format's."""
    plan = ctx.state["fast_plan"]
    plan.converted = sum(len(m.gate_up) + len(m.down) for m in loaded.module.modules() if hasattr(m, "gate_up"))
    plan.finish(loaded.module, ctx.dtype, tables=ctx.file_tables)
    summary: dict[str, Any] = plan.summary()
    return {"experts": "MXFP4 packed, 4-bit table kernel", **summary}
