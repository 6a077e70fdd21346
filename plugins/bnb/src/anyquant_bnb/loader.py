"""The bitsandbytes loader: validation and the per-linear factory; the runtime's int4 loader base gives the backend
choice. An nf4/fp4 layer offers a fast backend its codes as a 4-bit table layout (``Table4``), and it and every
LLM.int8 layer a ``Decoded`` copy; the engine decides which runs (:mod:`anyquant_runtime.layouts`). ``auto`` counts
every layer as ``Decoded`` (the signature holds no widths to describe the table layout by)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from anyquant.plugin import CheckpointError, Detection, FormatConflictError, ModuleInfo, Probe, dense_rows
from anyquant_runtime import LoadContext
from anyquant_runtime.int4.loader import PackedFormatLoader
from anyquant_runtime.layouts import Decoded, Layout, Table4

from .scheme import BnbScheme, read_scheme

if TYPE_CHECKING:
    from torch import nn

__all__ = ["BnbLoader"]


class BnbLoader(PackedFormatLoader):
    format = "bnb"
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = (Table4, Decoded)
    serve_hint = "load it with transformers + bitsandbytes, or serve it with vLLM"

    def read_signature(self, probe: Probe) -> BnbScheme:
        return read_scheme(probe)

    def validate(self, probe: Probe, detection: Detection) -> None:
        problems = detection.details.get("problems") or []
        if problems:
            raise FormatConflictError(
                f"{probe.root}: the bitsandbytes tensors disagree with each other or with the config: "
                + "; ".join(problems[:3])
            )

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .qlinear import Bnb4bitLinear, Bnb8bitLinear, parse_quant_state

        state = self.state(ctx)
        scheme = state.signature if isinstance(state.signature, BnbScheme) else read_scheme(ctx.probe)
        modules = {m.name: m for m in scheme.modules}
        mode = "dequantized" if ctx.backend == "dequantized" else "reference"

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            m = modules.get(name)
            if m is None:
                return None
            src = ctx.source
            bias = src.get(f"{name}.bias") if m.has_bias else None
            shape = (linear.out_features, linear.in_features)
            layer: Bnb4bitLinear | Bnb8bitLinear
            if m.bits == 4:
                assert m.state_tensor is not None and m.quant_type is not None
                qs = parse_quant_state(name, src.get(m.state_tensor), m.quant_type, shape)
                w = f"{name}.weight"
                tensors = {
                    "weight": src.get(w),
                    "absmax": src.get(f"{w}.absmax"),
                    "quant_map": src.get(f"{w}.quant_map"),
                }
                if m.nested:
                    tensors["nested_absmax"] = src.get(f"{w}.nested_absmax")
                    tensors["nested_quant_map"] = src.get(f"{w}.nested_quant_map")
                layer = Bnb4bitLinear(
                    name,
                    tensors,
                    qs,
                    bias,
                    in_features=shape[1],
                    out_features=shape[0],
                    mode=mode,
                    compute_dtype=ctx.dtype,
                )
            else:
                cb = src.get(f"{name}.weight")
                if tuple(cb.shape) != shape:
                    raise CheckpointError(
                        f"{name}: the int8 weight is {list(cb.shape)}, the model expects {list(shape)}"
                    )
                if f"{name}.weight_format" in src:
                    fmt = src.get(f"{name}.weight_format")
                    if fmt.numel() != 1 or int(fmt.reshape(-1)[0]) != 0:
                        raise CheckpointError(f"{name}: weight_format {fmt.tolist()} is not 0 (row-major)")
                layer = Bnb8bitLinear(cb, src.get(f"{name}.SCB"), bias, mode=mode, compute_dtype=ctx.dtype)
            return self.fast_convert(ctx, name, layer)

        return factory

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        scheme = read_scheme(probe)
        rows, covered = [], set()
        for m in scheme.modules:
            names = [n for n in probe.tensors if n == m.name or n.startswith(f"{m.name}.")]
            nbytes = sum(probe.tensors[n].nbytes for n in names)
            covered.add(m.name)
            kind = f"bnb-{m.quant_type}" if m.bits == 4 else "bnb-int8"
            rows.append(ModuleInfo(m.name, kind, (0, 0), float(m.bits), 64 if m.bits == 4 else -1, nbytes))
        return rows + dense_rows(probe, skip=covered)
