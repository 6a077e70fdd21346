"""The AWQ loader: GEMM and GEMV layouts on CPU, scaled activations applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from anyquant.plugin import (
    CheckpointError,
    ConfigError,
    Detection,
    ModuleInfo,
    Probe,
    UnsupportedBackendError,
    dense_rows,
)
from anyquant_runtime import LoadContext, require_dtypes
from anyquant_runtime.int4.loader import QUANT_DTYPES, Int4Loader

from .plugin import _layout

if TYPE_CHECKING:
    from torch import nn

    from anyquant.plugin import LoadedModel

__all__ = ["AWQLoader"]


def _modules(probe: Probe, bits: int) -> dict[str, dict[str, Any]]:
    t = probe.tensors
    out: dict[str, dict[str, Any]] = {}
    for prefix in probe.modules_with("qweight"):
        layout = _layout(probe, prefix, bits)
        if layout is None:
            continue
        qw, sc = t[f"{prefix}.qweight"], t[f"{prefix}.scales"]
        k: int | None
        n: int | None
        groups: int | None
        if layout == "gemm":
            k, n, groups = qw.shape[0], sc.shape[1], sc.shape[0]
        elif layout == "gemv":
            n, k = qw.shape[0], qw.shape[1] * 32 // bits
            groups = None
        else:
            k = n = groups = None
        names = [f"{prefix}.{s}" for s in ("qweight", "qzeros", "scales", "bias")]
        out[prefix] = {
            "layout": layout,
            "in": k,
            "out": n,
            "groups": groups,
            "bias": f"{prefix}.bias" in t,
            "nbytes": sum(t[x].nbytes for x in names if x in t),
        }
    return out


class AWQLoader(Int4Loader):
    """AWQ's GEMM and GEMV layouts. Its backend choice counts no layers (every AWQ layer is 4-bit with
    a group size torch's int4 kernel takes, and auto never picks ``reference``); GPTQModel's kernels run
    the GEMM layout only."""

    format = "awq"
    kernel_method = "awq"
    gptqmodel_layouts = frozenset({"gemm"})

    def _bits_group(self, detection: Detection) -> tuple[int, int]:
        d = detection.details
        bits, group = d.get("bits", 4), d.get("group_size", 128)
        for key, value in (("bits", bits), ("group_size", group)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"AWQ quantization_config {key}={value!r}: expected an integer")
        if group == 0 or group < -1:
            raise ConfigError(f"AWQ quantization_config group_size={group}: expected -1 (one group) or a positive size")
        return bits, group

    def validate(self, probe: Probe, detection: Detection) -> None:
        problems = detection.details.get("problems") or []
        if problems:
            raise CheckpointError(f"{probe.root}: the AWQ tensors are inconsistent: {'; '.join(problems[:3])}")
        require_dtypes(probe, QUANT_DTYPES, "AWQ")
        if detection.variant not in ("gemm", "gemv"):
            raise UnsupportedBackendError(
                f"{probe.root}: AWQ layout {detection.variant!r} is not loadable on CPU by anyquant "
                "(GEMM and GEMV are); re-export it as GEMM"
            )
        bits, group = self._bits_group(detection)
        if bits != 4:
            raise CheckpointError(f"{probe.root}: AWQ with bits={bits}: only 4-bit AWQ layouts exist")
        for name, m in _modules(probe, bits).items():
            if m["layout"] == "gemm" and (1 if group == -1 else m["in"] // group) != m["groups"]:
                raise CheckpointError(f"{name}: {m['groups']} scale groups do not match group_size={group}")

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .qlinear import AWQLinear

        bits, group = self._bits_group(ctx.detection)
        modules = _modules(ctx.probe, bits)
        src = ctx.source
        state = self.state(ctx)
        kernel_plan = state.kernel_plan

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            m = modules.get(name)
            if m is None:
                return None
            if (m["in"], m["out"]) != (linear.in_features, linear.out_features):
                raise CheckpointError(
                    f"{name}: AWQ tensors are {m['in']}x{m['out']}, the model expects "
                    f"{linear.in_features}x{linear.out_features}"
                )
            if kernel_plan is not None:
                return _gptqmodel_layer(kernel_plan, name, m, src, bits, group)
            layer = AWQLinear(
                src.get(f"{name}.qweight"),
                src.get(f"{name}.qzeros") if f"{name}.qzeros" in src else None,
                src.get(f"{name}.scales"),
                src.get(f"{name}.bias") if m["bias"] else None,
                layout=m["layout"],
                bits=bits,
                group_size=group,
                in_features=m["in"],
                out_features=m["out"],
                mode="dequantized" if ctx.backend == "dequantized" else "reference",
                compute_dtype=ctx.dtype,
            )
            return self.fast_convert(ctx, name, layer)

        return factory

    def finish(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        """AutoAWQ's scaled activations, then the int4 base's finish (before the fast backend's head)."""
        _apply_act_scales(loaded.module, ctx.probe)
        return super().finish(loaded, ctx)

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        bits, group = self._bits_group(detection)
        modules = _modules(probe, bits)
        rows = [
            ModuleInfo(name, "awq", (m["out"], m["in"]), float(bits), group, m["nbytes"], extra={"layout": m["layout"]})
            for name, m in modules.items()
        ]
        return rows + dense_rows(probe, skip=set(modules))


def _gptqmodel_layer(kernel_plan: Any, name: str, m: dict[str, Any], src: Any, bits: int, group: int) -> nn.Module:
    """One AWQ GEMM layer on a GPTQModel kernel: GPTQModel's AWQ kernels take the GEMM tensors as
    stored (interleaved nibbles, true zero points); ``sym`` says whether every zero is ``2**(b-1)``."""
    from .dequant import unpack_awq_gemm_cols

    if m["layout"] != "gemm":
        raise UnsupportedBackendError(f"{name}: the gptqmodel backend runs AWQ GEMM layers, this one is {m['layout']}")
    k, n = m["in"], m["out"]
    qzeros = src.get(f"{name}.qzeros")
    tensors = {"qweight": src.get(f"{name}.qweight"), "qzeros": qzeros, "scales": src.get(f"{name}.scales")}
    layer: nn.Module = kernel_plan.build(
        name,
        tensors,
        src.get(f"{name}.bias") if m["bias"] else None,
        bits=bits,
        group_size=-1 if group in (-1, 0) or group >= k else group,
        sym=bool((unpack_awq_gemm_cols(qzeros) == 1 << (bits - 1)).all()),
        desc_act=False,
        in_features=k,
        out_features=n,
    )
    return layer


def _apply_act_scales(model: Any, probe: Probe) -> None:
    """AutoAWQ's ScaledActivation: ``act(x) / scales`` for ``P.act.scales`` tensors (GELU models)."""
    prefixes = [p for p in probe.modules_with("scales") if p.endswith(".act")]
    if not prefixes:
        return
    from safetensors import safe_open

    from .qlinear import ScaledActivation

    modules = dict(model.named_modules())
    for prefix in prefixes:
        act = modules.get(prefix)
        if act is None:
            raise CheckpointError(
                f"{prefix}.scales scales an activation module the transformers model does not have ({prefix})"
            )
        info = probe.tensors[f"{prefix}.scales"]
        with safe_open(str(probe.root / info.file), framework="pt") as fh:
            scales = fh.get_tensor(f"{prefix}.scales").float()
        parent, _, child = prefix.rpartition(".")
        setattr(modules[parent] if parent else model, child, ScaledActivation(act, scales))
