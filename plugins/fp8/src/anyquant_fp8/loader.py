"""The FP8 loader: validation, the per-linear factory, and its backends (core's int4 loader base gives the backend
choice and cpu-fast's plan). On cpu-fast an FP8 layer runs as its bytes on the compiled kernel's ``fp8_gemv`` where
that is built with its vector path (AVX512F), else as a bfloat16 copy prepacked for oneDNN where the CPU has AMX or
AVX512-BF16, else exact: the layers are described as packed layouts and the engine decides."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

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
from anyquant.runtime.layouts import Decoded, E4M3Groups, Layout

from .scheme import FP8Module, FP8Scheme, read_scheme

if TYPE_CHECKING:
    import torch
    from torch import nn

    from anyquant.plugin import LoadedModel

__all__ = ["FP8Loader"]

#: ``ctx.state`` key of ModelOpt's KV-cache scales (read in prepare, installed in finish)
KV_KEY = "fp8_modelopt_kv"


def _positive_scale(name: str, t: torch.Tensor) -> None:
    """ModelOpt's scales are ``amax / 448`` (it asserts them positive): a NaN, infinite, zero or negative one, or one
    that is not a float, is refused before any forward."""
    if not t.is_floating_point() or not bool(t.isfinite().all()) or not bool((t > 0).all()):
        shown = t.flatten()[:4].tolist() if t.numel() else []
        raise CheckpointError(
            f"{name} is {str(t.dtype).removeprefix('torch.')} {shown}: expected positive finite scales"
        )


class FP8Loader(PackedFormatLoader):
    format = "fp8"
    cpu_fast_description = (
        "FP8 weights kept as their bytes on the compiled kernel's fp8_gemv where it is built (AVX512F; float32 "
        "activations), else decoded once to bfloat16 (transformers' own dequantized weight) and prepacked for oneDNN "
        "(AMX or AVX512-BF16), else exact"
    )
    serve_hint = "with FP8 support serve it with vLLM (`anyquant serve --engine vllm`)"
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = (E4M3Groups, Decoded)

    def read_signature(self, probe: Probe) -> FP8Scheme:
        return read_scheme(probe)

    def fast_layer_count(self, signature: FP8Scheme, probe: Probe) -> int:
        """Each module as :class:`~anyquant_fp8.qlinear.FP8Linear` offers it: its FP8 bytes with a scale per tensor,
        output channel or block, else a bfloat16 copy."""
        import torch

        from anyquant.runtime.fastcpu import layouts_run

        round_to = getattr(torch, signature.dtype)
        per_channel = signature.modelopt is not None and signature.modelopt.scales == "channel"

        def fp8(m: FP8Module) -> E4M3Groups:
            rows, group = signature.block or (1 if per_channel else m.out_features, m.in_features)
            return E4M3Groups(m.in_features, m.out_features, group, None, None, round_to, rows)

        return layouts_run([fp8(m), Decoded(None)] for m in signature.modules)

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

    def prepare(self, ctx: LoadContext) -> None:
        """The backend's plan, and ModelOpt's KV-cache scales (read and checked here)."""
        super().prepare(ctx)
        ctx.state[KV_KEY] = None
        state = self.state(ctx)
        scheme = state.signature if isinstance(state.signature, FP8Scheme) else read_scheme(ctx.probe)
        if not scheme.kv_scales:
            return
        scales = {}
        for attn, (kn, vn) in scheme.kv_scales.items():
            k, v = ctx.source.get(kn), ctx.source.get(vn)
            _positive_scale(kn, k)
            _positive_scale(vn, v)
            scales[attn] = (k, v)
        ctx.state[KV_KEY] = scales

    def finish(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        """cpu-fast's head and record (the base's), and ModelOpt's FP8 KV cache on each attention layer of the native
        decoder (transformers' classes have no place for it: refused, never silently left 16-bit)."""
        from .qlinear import KVQuantFP8

        loaded = super().finish(loaded, ctx)
        scales = ctx.state.get(KV_KEY)
        if not scales:
            return loaded
        done = 0
        for name, module in loaded.module.named_modules():
            if name in scales and hasattr(module, "kv_quant"):
                module.kv_quant = KVQuantFP8(*scales[name])
                done += 1
        if done != len(scales):
            raise UnsupportedFormatError(
                f"{ctx.probe.root}: ModelOpt's FP8 KV cache (k_scale/v_scale) is applied by anyquant's native decoder "
                f"only; this model built {loaded.info.get('runtime')!r} and {done} of {len(scales)} attention layers "
                "took it"
            )
        loaded.info = {**loaded.info, "kv_cache": f"fp8 e4m3, static k_scale/v_scale, {done} layers (ModelOpt)"}
        return loaded

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        import torch

        from .qlinear import FP8Linear

        state = self.state(ctx)
        plan = state.fast_plan
        scheme = state.signature if isinstance(state.signature, FP8Scheme) else read_scheme(ctx.probe)
        modules = {m.name: m for m in scheme.modules}
        round_to = getattr(torch, scheme.dtype)
        mode = "dequantized" if ctx.backend == "dequantized" else "reference"
        modelopt = scheme.modelopt is not None

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
            scale = src.get(f"{name}.{scheme.scale_name}")
            input_scale = None
            if modelopt:
                _positive_scale(f"{name}.{scheme.scale_name}", scale)
                if scheme.block is not None:  # ModelOpt's [out/128, 1, in/128, 1]
                    scale = scale.reshape(scale.shape[0], scale.shape[-2] if scale.dim() == 4 else scale.shape[1])
                if scheme.input_quant == "static":
                    input_scale = src.get(f"{name}.input_scale")
                    _positive_scale(f"{name}.input_scale", input_scale)
            layer = FP8Linear(
                src.get(f"{name}.weight"),
                scale,
                src.get(f"{name}.bias") if m.has_bias else None,
                block=scheme.block,
                round_to=round_to,
                mode=mode,
                compute_dtype=ctx.dtype,
                input_quant=scheme.input_quant,
                input_scale=input_scale,
            )
            return layer if plan is None else plan.convert(name, layer)

        return factory

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        scheme = read_scheme(probe)
        rows, covered = [], set()
        kind = "fp8" if scheme.modelopt is None else scheme.variant
        for m in scheme.modules:
            names = ("weight", scheme.scale_name) + (("input_scale",) if m.has_input_scale else ())
            nbytes = sum(probe.tensors[f"{m.name}.{s}"].nbytes for s in names)
            covered.add(m.name)
            rows.append(ModuleInfo(m.name, kind, (m.out_features, m.in_features), 8.0, -1, nbytes))
        return rows + dense_rows(probe, skip=covered)
