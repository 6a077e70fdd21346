"""The FP8 loader (and ModelOpt's NVFP4): validation and the per-linear factory; the runtime's int4 loader base gives
the backend choice. An FP8 layer offers a fast backend its bytes as E4M3 groups, else a ``Decoded`` copy; an NVFP4
layer its codes as a 4-bit table behind its NVFP4 input quantization: the layers are described as packed layouts and
the engine decides."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from anyquant.plugin import (
    CheckpointError,
    Detection,
    FormatConflictError,
    LoadOptions,
    ModuleInfo,
    Probe,
    UnsupportedFormatError,
    dense_rows,
)
from anyquant_runtime import LoadContext
from anyquant_runtime.int4.loader import Int4State, PackedFormatLoader
from anyquant_runtime.layouts import Decoded, E4M3Groups, Layout, Table4

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


def _is_nvfp4(scheme: FP8Scheme, m: FP8Module) -> bool:
    """Module ``m`` is ModelOpt NVFP4 (the checkpoint's algorithm, or its ``MIXED_PRECISION`` entry)."""
    return m.algo == "NVFP4" or (scheme.modelopt is not None and scheme.modelopt.scales == "nvfp4")


class FP8Loader(PackedFormatLoader):
    format = "fp8"
    serve_hint = "with FP8 support serve it with vLLM (`anyquant serve --engine vllm`)"
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = (E4M3Groups, Table4, Decoded)

    def read_signature(self, probe: Probe) -> FP8Scheme:
        return read_scheme(probe)

    def fast_layer_count(self, signature: FP8Scheme, probe: Probe) -> int:
        """Each module as :class:`~anyquant_fp8.qlinear.FP8Linear` offers it: its FP8 bytes with a scale per tensor,
        output channel or block, else a bfloat16 copy; an NVFP4 module as
        :class:`~anyquant_fp8.qlinear.NVFP4Linear` offers it (its codes into the E2M1 table)."""
        import torch

        from anyquant_runtime.cpu import layouts_run

        round_to = getattr(torch, signature.dtype)
        per_channel = signature.fbgemm is not None or (
            signature.modelopt is not None and signature.modelopt.scales == "channel"
        )
        fp4_group = (signature.modelopt.group_size if signature.modelopt is not None else None) or 16

        def fp8(m: FP8Module) -> E4M3Groups:
            rows, group = signature.block or (1 if per_channel else m.out_features, m.in_features)
            return E4M3Groups(m.in_features, m.out_features, group, None, None, round_to, rows)

        def nvfp4(m: FP8Module) -> Table4:  # ModelOpt NVFP4 (or a MIXED_PRECISION layer of it): float32 group scales
            return Table4(m.in_features, m.out_features, fp4_group, None, None, None, torch.float32)

        return layouts_run(
            [nvfp4(m)] if _is_nvfp4(signature, m) else [fp8(m), Decoded(None)] for m in signature.modules
        )

    def facts(self, probe: Probe, detection: Detection, options: LoadOptions) -> Int4State:
        facts = super().facts(probe, detection, options)
        facts.dense_bytes = sum(m.in_features * m.out_features * 4 for m in facts.signature.modules)
        return facts

    def validate(self, probe: Probe, detection: Detection) -> None:
        self.raise_detected_error(detection)
        problems = detection.details.get("problems") or []
        if problems:
            raise FormatConflictError(
                f"{probe.root}: the FP8 tensors disagree with each other or with the config: " + "; ".join(problems[:3])
            )

    def prepare(self, ctx: LoadContext) -> None:
        """ModelOpt's KV-cache scales (read and checked here)."""
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
        """ModelOpt's FP8 KV cache on each attention layer of the native
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

        from .qlinear import FP8Linear, NVFP4Linear

        state = self.state(ctx)
        scheme = state.signature if isinstance(state.signature, FP8Scheme) else read_scheme(ctx.probe)
        modules = {m.name: m for m in scheme.modules}
        round_to = getattr(torch, scheme.dtype)
        mode = "dequantized" if ctx.backend == "dequantized" else "reference"
        modelopt = scheme.modelopt is not None
        group = (scheme.modelopt.group_size if scheme.modelopt is not None else None) or 16
        fbgemm = scheme.fbgemm
        # transformers fills every FbgemmFp8Linear's input_scale_ub (a float32 buffer) with activation_scale_ub
        scale_ub = None if fbgemm is None else torch.tensor(fbgemm.activation_scale_ub, dtype=torch.float32)

        def _nvfp4_linear(name: str, m: FP8Module) -> nn.Module:
            """ModelOpt's NVFP4: the scales checked (E4M3 group scales finite and not negative; the global
            ``weight_scale_2`` and ``input_scale`` positive and finite) before the layer is built."""
            src = ctx.source
            scale = src.get(f"{name}.weight_scale")
            if scale.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{name}.weight_scale is {scale.dtype}; ModelOpt NVFP4 stores float8_e4m3fn")
            wide = scale.to(torch.float32)
            if not bool(wide.isfinite().all()) or bool((wide < 0).any()):
                bad = wide[~wide.isfinite() | (wide < 0)].flatten()[:4].tolist()
                raise CheckpointError(f"{name}.weight_scale holds {bad}: expected finite, non-negative E4M3 scales")
            scale_2, input_scale = src.get(f"{name}.weight_scale_2"), src.get(f"{name}.input_scale")
            _positive_scale(f"{name}.weight_scale_2", scale_2)
            _positive_scale(f"{name}.input_scale", input_scale)
            layer = NVFP4Linear(
                src.get(f"{name}.weight"),
                scale,
                scale_2,
                input_scale,
                src.get(f"{name}.bias") if m.has_bias else None,
                group=group,
                mode=mode,
                compute_dtype=ctx.dtype,
            )
            return self.fast_convert(ctx, name, layer)

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
            if _is_nvfp4(scheme, m):
                return _nvfp4_linear(name, m)
            scale = src.get(f"{name}.{scheme.scale_name}")
            input_scale = None
            input_quant = "static" if m.algo == "FP8" else scheme.input_quant  # MIXED_PRECISION's FP8 layers
            if fbgemm is not None:  # FbgemmFp8Linear: float32 [out, 1], fbgemm's scales are at least 1 / (448 * 512)
                _positive_scale(f"{name}.weight_scale", scale)
                if scale.dtype != torch.float32 or tuple(scale.shape) != (m.out_features, 1):
                    raise CheckpointError(
                        f"{name}.weight_scale is {str(scale.dtype).removeprefix('torch.')}{list(scale.shape)}; "
                        f"fbgemm_fp8 stores float32 [{m.out_features}, 1]"
                    )
            if modelopt:
                _positive_scale(f"{name}.{scheme.scale_name}", scale)
                if scheme.block is not None:  # ModelOpt's [out/128, 1, in/128, 1]
                    scale = scale.reshape(scale.shape[0], scale.shape[-2] if scale.dim() == 4 else scale.shape[1])
                if input_quant == "static":
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
                input_quant=input_quant,
                input_scale=input_scale,
                scale_ub=scale_ub,
            )
            return self.fast_convert(ctx, name, layer)

        return factory

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        scheme = read_scheme(probe)
        rows, covered = [], set()
        kind = "fp8" if scheme.modelopt is None and scheme.fbgemm is None else scheme.variant
        for m in scheme.modules:
            nvfp4 = _is_nvfp4(scheme, m)
            names = ("weight", scheme.scale_name) + (("input_scale",) if m.has_input_scale else ())
            names += ("weight_scale_2",) if nvfp4 else ()
            nbytes = sum(probe.tensors[f"{m.name}.{s}"].nbytes for s in names)
            covered.add(m.name)
            bits, group = (4.0, 16) if nvfp4 else (8.0, -1)
            row_kind = {"NVFP4": "modelopt-nvfp4", "FP8": "modelopt-fp8"}.get(m.algo or "", kind)
            rows.append(ModuleInfo(m.name, row_kind, (m.out_features, m.in_features), bits, group, nbytes))
        return rows + dense_rows(probe, skip=covered)
