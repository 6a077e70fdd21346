"""The MLX loader: its tensor source (quantized tables served decoded) and the per-linear factory, on the runtime's
int4 loader base (the backend choice). A 4-bit affine layer offers a fast backend its codes as 4-bit affine blocks,
an MXFP4/NVFP4 one as a 4-bit table, and every layer a ``Decoded`` copy (mlx's own values); the engine decides.
``auto`` counts every layer as ``Decoded`` (the base's count)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

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
from anyquant_runtime.int4.loader import PackedFormatLoader
from anyquant_runtime.layouts import Affine4Blocks, Decoded, Layout, Table4
from anyquant_runtime.tensors import SafetensorsSource

from .scheme import MlxModule, MlxScheme, read_scheme

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["MlxLoader", "MlxSource"]


def expert_views(scheme: MlxScheme) -> dict[str, tuple[MlxModule, int]]:
    """mlx-lm's stacked experts (``P.switch_mlp.gate_proj``, weight ``[E, out, in*b/32]``) as the per-expert linears a
    Hugging Face checkpoint has (``P.experts.<e>.gate_proj``): expert name -> (the stacked module, ``e``)."""
    out = {}
    for m in scheme.modules:
        if m.stacked is None or ".switch_mlp." not in m.name:
            continue
        head, _, leaf = m.name.partition(".switch_mlp.")
        for e in range(m.stacked):
            out[f"{head}.experts.{e}.{leaf}"] = (m, e)
    return out


class MlxSource:
    """The checkpoint's tensors, with every quantized module's ``P.weight`` served decoded (``mx.dequantize``'s
    values) to whoever asks for it by name: the embedding, a tied head, a router that is not an ``nn.Linear``. The
    factory reads the packed tensors with :meth:`raw` instead. Stacked experts are listed as one module per expert
    (:func:`expert_views`, slices of the stack, read once), so the build finds them as in a Hugging Face
    checkpoint."""

    SUFFIXES = ("weight", "scales", "biases")

    def __init__(self, probe: Probe, scheme: MlxScheme) -> None:
        self.inner = SafetensorsSource(probe)
        self.modules = {m.name: m for m in scheme.modules}
        self.experts = expert_views(scheme)
        stacked = {m.name for m, _ in self.experts.values()}
        self._hidden = {f"{n}.{s}" for n in stacked for s in self.SUFFIXES}
        self._virtual = {
            f"{n}.{s}" for n in self.experts for s in self.SUFFIXES if f"{self.experts[n][0].name}.{s}" in probe.tensors
        }
        self._stacks: dict[str, torch.Tensor] = {}

    def keys(self) -> Iterator[str]:
        yield from (k for k in self.inner.keys() if k not in self._hidden)
        yield from sorted(self._virtual)

    def __contains__(self, name: object) -> bool:
        return (name in self.inner and name not in self._hidden) or name in self._virtual

    def raw(self, name: str) -> torch.Tensor:
        if name in self._virtual:
            module, _, suffix = name.rpartition(".")
            stacked, e = self.experts[module]
            key = f"{stacked.name}.{suffix}"
            if key not in self._stacks:
                self._stacks[key] = self.inner.get(key)
            return self._stacks[key][e]
        return self.inner.get(name)

    def get(self, name: str) -> torch.Tensor:
        m = self.modules.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if m is None:
            return self.raw(name)
        from .dequant import dequantize

        st = m.settings
        return dequantize(*self._packed(m), st.bits, st.group_size, st.mode)

    def _packed(self, m: MlxModule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Module ``m``'s packed weight, its scales and (affine mode) its biases, read from the checkpoint."""
        biases = self.inner.get(f"{m.name}.biases") if m.settings.mode == "affine" else None
        return self.inner.get(f"{m.name}.weight"), self.inner.get(f"{m.name}.scales"), biases

    def file_rows(self, name: str) -> Any:
        """A table the build may leave out of memory (a fast backend's embedding and head): a 16-bit one as the file's
        rows, a quantized one kept packed and decoded a few rows at a time (:class:`~anyquant_mlx.dequant.MlxRows`)."""
        if name in self._virtual:
            return None
        m = self.modules.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if m is None:
            return self.inner.file_rows(name)
        if m.stacked is not None:
            return None
        from .dequant import MlxRows

        st = m.settings
        return MlxRows(*self._packed(m), st.bits, st.group_size, st.mode)

    def unused(self) -> list[str]:
        return self.inner.unused()

    def close(self) -> None:
        self._stacks.clear()
        self.inner.close()


class MlxLoader(PackedFormatLoader):
    format = "mlx"
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = (Affine4Blocks, Table4, Decoded)
    serve_hint = "there is no GPU engine for MLX's layout; export it to dense (`anyquant export`)"

    def read_signature(self, probe: Probe) -> MlxScheme:
        return read_scheme(probe)

    def validate(self, probe: Probe, detection: Detection) -> None:
        d = detection.details
        self.raise_detected_error(detection)
        problems = d.get("problems") or []
        if problems:
            raise FormatConflictError(
                f"{probe.root}: the MLX tensors disagree with each other or with config.json: "
                + "; ".join(problems[:3])
            )
        odd = [m.name for m in read_scheme(probe).modules if m.stacked is not None and ".switch_mlp." not in m.name]
        if odd:
            raise UnsupportedFormatError(
                f"{probe.root}: {odd[0]} stacks several linears in one tensor outside mlx-lm's switch_mlp: not read yet"
            )

    def tensor_source(self, probe: Probe, options: LoadOptions) -> MlxSource:
        return MlxSource(probe, read_scheme(probe))

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .qlinear import MlxLinear

        state = self.state(ctx)
        scheme = state.signature if isinstance(state.signature, MlxScheme) else read_scheme(ctx.probe)
        modules: dict[str, MlxModule] = {m.name: m for m in scheme.modules}
        for expert, (stacked, _) in expert_views(scheme).items():
            modules[expert] = MlxModule(expert, stacked.settings, stacked.out_features, stacked.in_features, None)
        mode = "dequantized" if ctx.backend == "dequantized" else "reference"
        src = ctx.source
        if not isinstance(src, MlxSource):
            raise TypeError("the MLX loader builds from its own MlxSource")

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            m = modules.get(name)
            if m is None:
                return None
            if (m.out_features, m.in_features) != (linear.out_features, linear.in_features):
                raise CheckpointError(
                    f"{name}: the MLX weight is [{m.out_features}, {m.in_features}], the model expects "
                    f"[{linear.out_features}, {linear.in_features}]"
                )
            st = m.settings
            layer = MlxLinear(
                src.raw(f"{name}.weight"),
                src.raw(f"{name}.scales"),
                src.raw(f"{name}.biases") if st.mode == "affine" else None,
                src.raw(f"{name}.bias") if f"{name}.bias" in src else None,
                st,
                mode=mode,
                compute_dtype=ctx.dtype,
            )
            return self.fast_convert(ctx, name, layer)

        return factory

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        scheme = read_scheme(probe)
        rows, covered = [], set()
        for m in scheme.modules:
            names = [f"{m.name}.{s}" for s in ("weight", "scales", "biases")]
            nbytes = sum(probe.tensors[n].nbytes for n in names if n in probe.tensors)
            covered.add(m.name)
            st = m.settings
            rows.append(
                ModuleInfo(
                    m.name, f"mlx-{st.mode}", (m.out_features, m.in_features), float(st.bits), st.group_size, nbytes
                )
            )
        return rows + dense_rows(probe, skip=covered)
