"""The EXL3 loader (pure-torch reference decoder on any device) and the linear factory it shares with EXL2's
(:mod:`anyquant_exl3.exl2.loader`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from anyquant.plugin import (
    BackendInfo,
    CheckpointError,
    Detection,
    LoadOptions,
    ModuleInfo,
    Probe,
    UnsupportedFormatError,
    dense_rows,
)
from anyquant_runtime import (
    FLOAT_SCALE_DTYPES,
    RUNTIME_OPTIONS,
    LoadContext,
    TransformersLoader,
    require_dtypes,
)
from anyquant_runtime.layouts import Decoded, Int8Blocks, Layout
from anyquant_runtime.tensors import SafetensorsSource

from .options import EXLLAMAV3_OPTIONS
from .plugin import RING_GROUP, RingTableInfo, ring_tables

if TYPE_CHECKING:
    import torch
    from torch import nn

    from anyquant.plugin import LoadedModel
    from anyquant_runtime.parts import PartsPlan
    from anyquant_runtime.qlinear import QuantLinearBase

    from .ring import RingTable

__all__ = [
    "EXLLAMAV3_OPTIONS",
    "EXL3Loader",
    "PartsLinears",
    "stored_parts",
]

log = logging.getLogger(__name__)

#: the locked codebook multipliers (uint32 viewed as int32 in the marker tensors).
LOCKED_MARKERS = {"mcg": -877912083, "mul1": -2082680531}


def _exllamav3_backend() -> BackendInfo:
    """Cheap availability check (never imports exllamav3: its import JIT-compiles a CUDA extension)."""
    from dataclasses import replace

    from .exllamav3_kernels import backend_info

    return replace(backend_info(), devices=("cuda",))


def _modules(probe: Probe) -> dict[str, dict[str, Any]]:
    t = probe.tensors
    out = {}
    for prefix in probe.modules_with("trellis"):
        tr = t[f"{prefix}.trellis"]
        if len(tr.shape) != 3:
            continue
        codebook = next((c for c in ("mcg", "mul1") if f"{prefix}.{c}" in t), "3inst")
        out[prefix] = {
            "k": tr.shape[2] / 16,
            "in_pad": tr.shape[0] * 16,
            "out_pad": tr.shape[1] * 16,
            "codebook": codebook,
            "legacy": f"{prefix}.suh" not in t,
            "bias": f"{prefix}.bias" in t,
            "nbytes": sum(
                t[f"{prefix}.{s}"].nbytes
                for s in ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")
                if f"{prefix}.{s}" in t
            ),
        }
    return out


def stored_parts(name: str, linear: nn.Linear, stored: Mapping[str, Any], probe: Probe) -> PartsPlan | None:
    """How the checkpoint stores the model's linear ``name`` when not under its own name (``None``: it does not):

    - a fused projection (``qkv_proj``, ``gate_up_proj``) stored split, as exllamav3 and exllamav2 write
      Phi-3 (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj`` beside it; sizes from config.json);
    - ``<name>.slice.0``, ``.slice.1``, ...: exllamav3's slices of a very wide MLP (``modules/mlp.py``: ``n``
      slices of ``I // n // 128 * 128``, the last taking the rest; ``down_proj`` slices split its input,
      the others their output).
    """
    from anyquant_runtime.parts import PartsPlan, split_parts

    plan = split_parts(name, linear, stored.__contains__, probe.config or {})
    if plan is not None:
        return plan
    slices: list[str] = []
    while f"{name}.slice.{len(slices)}" in stored:
        slices.append(f"{name}.slice.{len(slices)}")
    if not slices:
        return None
    first = stored[slices[0]]
    split_input = first["in_pad"] < linear.in_features  # down_proj: each slice reads a chunk of the input
    whole = linear.in_features if split_input else linear.out_features
    size = whole // len(slices) // 128 * 128
    sizes = [size] * len(slices)
    sizes[-1] += whole - sum(sizes)
    if size < 1:
        raise CheckpointError(f"{name}: {len(slices)} slices cannot split {whole} features")
    if split_input:
        return PartsPlan(tuple((n, k, linear.out_features) for n, k in zip(slices, sizes, strict=True)), True)
    return PartsPlan(tuple((n, linear.in_features, k) for n, k in zip(slices, sizes, strict=True)), False)


def _logical_shapes(probe: Probe) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of a Llama-style decoder's projections by their last name, from config.json: the trellis
    holds each padded to multiples of 128 (SmolLM2's k_proj, 64 x 576, is stored as 128 x 640), and inspect
    reports the logical shape, as ModuleInfo documents and every other format does. Empty without a usable
    config."""
    from anyquant.plugin import SizingError, model_shape

    try:
        m = model_shape(probe.config or {})
    except (SizingError, KeyError, TypeError, ValueError, AssertionError):
        return {}
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {
        "q_proj": (q, m.hidden),
        "k_proj": (kv, m.hidden),
        "v_proj": (kv, m.hidden),
        "o_proj": (m.hidden, q),
        "gate_proj": (m.intermediate, m.hidden),
        "up_proj": (m.intermediate, m.hidden),
        "down_proj": (m.hidden, m.intermediate),
        "lm_head": (m.vocab, m.hidden),
    }


def _hidden_size(probe: Probe) -> int | None:
    value = (probe.config or {}).get("hidden_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class EXL3Source(SafetensorsSource):
    """The checkpoint's tensors, plus ``<key>.weight`` for each ring-coded token embedding ``<key>``
    (exllamav3 1.6 ``--embed_bits``): decoded whole (fp16) when asked for, or, for a name in
    ``placeholders`` (name -> dtype), a zero-stride stand-in of the table's shape that holds no memory,
    which :meth:`EXL3Loader.load` replaces with an :class:`~anyquant_exl3.qlinear.EXL3TableEmbedding`."""

    def __init__(self, probe: Probe, tables: dict[str, RingTableInfo]) -> None:
        super().__init__(probe)
        self.hidden = _hidden_size(probe) or 0
        self.tables = {f"{key}.weight": info for key, info in tables.items() if info.signs is not None}
        self.placeholders: dict[str, torch.dtype] = {}
        for info in self.tables.values():
            if not 0 < self.hidden <= info.groups * RING_GROUP:
                raise CheckpointError(
                    f"{info.key}: a ring-coded table of {info.groups} x {RING_GROUP} columns cannot hold config.json's "
                    f"hidden_size {_hidden_size(probe)!r}"
                )

    def keys(self) -> Any:
        yield from super().keys()
        yield from self.tables

    def __contains__(self, name: object) -> bool:
        return name in self.tables or super().__contains__(name)

    def get(self, name: str) -> torch.Tensor:
        info = self.tables.get(name)
        if info is None:
            return super().get(name)
        if name in self.placeholders:
            import torch

            self.used.update((*info.shards, str(info.signs)))  # read by EXL3Loader.load after the build
            return torch.zeros(1, dtype=self.placeholders[name]).expand(info.rows, self.hidden)
        return self.table(name).decode()

    def table(self, name: str) -> RingTable:
        """The packed table behind ``name`` (its row shards joined), marked used."""
        import torch

        from .ring import RingTable

        info = self.tables[name]
        assert info.signs is not None
        pieces = [super(EXL3Source, self).get(shard) for shard in info.shards]
        trellis = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return RingTable(trellis, super().get(info.signs), info.k, self.hidden)


class PartsLinears(TransformersLoader):
    """What the EXL3 and EXL2 loaders share: ``make_linear``'s factory over a linear stored under its own name or as
    parts (:func:`stored_parts`), each layer handed to the load's fast backend where there is one (it decodes the
    layer once and holds it in a layout its engine runs: :func:`anyquant_exl3.qlinear.decoded_layouts`)."""

    def linear_factory(
        self, ctx: LoadContext, stored: Mapping[str, Any], one: Callable[[str, int, int], QuantLinearBase]
    ) -> Callable[[str, nn.Linear], nn.Module | None]:
        """``make_linear``'s factory over ``one(name, in_features, out_features)``: a linear stored under its own
        name (a key of ``stored``), or one the checkpoint stores as parts (:func:`stored_parts`)."""

        def built(name: str, in_features: int, out_features: int) -> Any:
            return self.fast_convert(ctx, name, one(name, in_features, out_features))

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            if name in stored:
                return built(name, linear.in_features, linear.out_features)  # type: ignore[no-any-return]
            plan = stored_parts(name, linear, stored, ctx.probe)
            return None if plan is None else plan.build(built, linear)

        return factory


class EXL3Loader(PartsLinears):
    format = "exl3"
    backend_order = ("exllamav3", "dequantized", "reference")
    format_options: ClassVar[Mapping[str, str]] = MappingProxyType({**RUNTIME_OPTIONS, **EXLLAMAV3_OPTIONS})
    #: a fast backend gets each linear decoded: as int8 blocks (a second rounding) or a ``Decoded`` copy
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = (Int8Blocks, Decoded)
    #: exllamav3's loader ties whenever lm_head is absent, and 1.6.x writes tie_word_embeddings: false always
    #: (format doc, "Tied embeddings"): the tensors decide, not the flag
    tie_absent_head: ClassVar[bool] = True

    def own_backends(self) -> list[BackendInfo]:
        return [
            _exllamav3_backend(),
            BackendInfo("dequantized", True, description="decode once at load (pure torch); dense speed and memory"),
            BackendInfo("reference", True, description="pure torch, decode on every forward; packed memory"),
        ]

    def load(self, probe: Probe, detection: Detection, options: LoadOptions) -> LoadedModel:
        """``backend="exllamav3"`` (the ``auto`` choice on a CUDA device when exllamav3 can run) hands the
        checkpoint to exllamav3's kernels and generator (:mod:`anyquant_exl3.exllamav3_kernels`);
        ``tensor_parallel=True`` loads it tensor-parallel over 2+ GPUs there. The other backends build the
        transformers model with :class:`~anyquant_exl3.qlinear.EXL3Linear` layers."""
        from .exllamav3_kernels import check_tensor_parallel

        tensor_parallel = check_tensor_parallel(options)  # typed error before anything heavy
        requested = "exllamav3" if tensor_parallel else options.backend
        if requested in ("auto", "exllamav3"):
            from anyquant_runtime.build import resolve_device

            if self.choose_backend(requested, resolve_device(options.device)) == "exllamav3":
                from .exllamav3_kernels import load_exllamav3

                return load_exllamav3(probe, detection, options, tensor_parallel=tensor_parallel)
        return super().load(probe, detection, options)

    def finish(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        """The ring-coded embedding installed (when the checkpoint has one), before the fast backend's head."""
        src = ctx.source
        if isinstance(src, EXL3Source) and src.tables:
            loaded.info = {**loaded.info, "embedding": self._install_tables(loaded.module, src)}
        return loaded

    @staticmethod
    def _install_tables(module: Any, src: EXL3Source) -> str:
        """The ring-coded embedding in place of the build's stand-in (a head tied to it gets the decoded table)."""
        from torch import nn

        from .qlinear import EXL3TableEmbedding

        emb = module.get_input_embeddings()
        names = {id(m): n for n, m in module.named_modules()}
        name = f"{names.get(id(emb), '')}.weight"
        unused = [n for n in src.tables if n != name]
        if unused:
            raise UnsupportedFormatError(
                f"ring-coded table {unused[0].removesuffix('.weight')!r} is not this model's input embedding "
                f"({name.removesuffix('.weight')!r}); anyquant decodes ring tables only as the token embedding"
            )
        if name not in src.placeholders:
            return f"ring-coded (K={src.tables[name].k}), decoded at load"
        weight: nn.Parameter = emb.weight
        assert weight.stride() == (0, 0)  # the build's stand-in
        table = src.table(name)
        head = module.get_output_embeddings()
        if getattr(head, "weight", None) is weight:  # no head of its own: it reads the decoded table
            dense = nn.Parameter(table.decode().to(weight.dtype), requires_grad=False)
            emb.weight = head.weight = dense
            return f"ring-coded (K={table.k}), decoded at load (the LM head is tied to it)"
        module.set_input_embeddings(EXL3TableEmbedding(table.trellis, table.signs, table.k, table.hidden, weight.dtype))
        return f"ring-coded (K={table.k}), rows decoded per lookup"

    def validate(self, probe: Probe, detection: Detection) -> None:
        problems = detection.details.get("problems") or []
        if problems:
            raise CheckpointError(f"{probe.root}: the EXL3 tensors are inconsistent: {'; '.join(problems[:3])}")
        if detection.format == "exl3":
            marker = frozenset({"I32"})
            require_dtypes(
                probe,
                {
                    "trellis": frozenset({"I16"}),
                    "suh": FLOAT_SCALE_DTYPES,
                    "svh": FLOAT_SCALE_DTYPES,
                    "mcg": marker,
                    "mul1": marker,
                },
                "EXL3",
            )
            codebooks = detection.details.get("codebooks") or {}
            if len(codebooks) > 1:  # allowed per tensor (format doc 2.4), but one conversion writes one codebook
                log.warning(
                    "%s: the EXL3 modules use different codebooks by their markers (%s); each is decoded by its own "
                    "marker. A model converted once has one codebook: if this one was not assembled from several "
                    "conversions, a marker tensor may be missing",
                    probe.root,
                    ", ".join(f"{cb} x{n}" for cb, n in sorted(codebooks.items())),
                )
        tables, _ = ring_tables(probe)
        ngram = [key for key, table in tables.items() if table.signs is None]
        if ngram:
            raise UnsupportedFormatError(
                f"{probe.root}: {ngram[0]!r} is a 2-D trellis table without .signs: an exllamav3 hashed n-gram "
                "table, which belongs to architectures anyquant does not build (ring-coded token embeddings, "
                "with .signs, do load)"
            )

    def tensor_source(self, probe: Probe, options: LoadOptions) -> SafetensorsSource:
        return EXL3Source(probe, ring_tables(probe)[0])

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .qlinear import EXL3Linear

        modules = _modules(ctx.probe)
        src = ctx.source
        if isinstance(src, EXL3Source) and ctx.backend != "dequantized":
            # packed memory: the token embedding stays ring-coded (load() installs it after the build)
            src.placeholders.update(dict.fromkeys(src.tables, ctx.dtype))

        def one(name: str, in_features: int, out_features: int) -> QuantLinearBase:
            m = modules[name]
            if m["in_pad"] < in_features or m["out_pad"] < out_features:
                raise CheckpointError(
                    f"{name}: trellis covers {m['in_pad']}x{m['out_pad']}, smaller than the model's "
                    f"{in_features}x{out_features}"
                )
            multiplier = None
            marker = m["codebook"]
            if marker in LOCKED_MARKERS:
                value = int(src.get(f"{name}.{marker}").item())
                if value != LOCKED_MARKERS[marker]:
                    log.warning(
                        "%s: non-default %s multiplier %#x (exllamav3 v0.0.4-0.0.8); using it",
                        name,
                        marker,
                        value & 0xFFFFFFFF,
                    )
                    multiplier = value & 0xFFFFFFFF

            def get(suffix: str) -> torch.Tensor | None:
                key = f"{name}.{suffix}"
                return src.get(key) if key in src else None

            return EXL3Linear(
                src.get(f"{name}.trellis"),
                get("suh"),
                get("svh"),
                get("bias"),
                su=get("su") if m["legacy"] else None,
                sv=get("sv") if m["legacy"] else None,
                codebook=m["codebook"],
                in_features=in_features,
                out_features=out_features,
                multiplier=multiplier,
                mode="dequantized" if ctx.backend == "dequantized" else "reference",
                compute_dtype=ctx.dtype,
            )

        return self.linear_factory(ctx, modules, one)

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        modules = _modules(probe)
        tables = ring_tables(probe)[0]
        hidden = _hidden_size(probe)
        rows = [
            ModuleInfo(
                key,
                "exl3",
                (table.rows, (hidden or table.groups * RING_GROUP) if table.signs else table.row_words),
                float(table.k) if table.signs else None,
                None,
                table.nbytes,
                extra={"codebook": "mul1", "table": "ring-coded embedding" if table.signs else "n-gram (not loaded)"},
            )
            for key, table in tables.items()
        ]
        logical = _logical_shapes(probe)
        for name, m in modules.items():
            padded = (m["out_pad"], m["in_pad"])
            moe = ".experts." in name or "shared_expert" in name  # sized by other config keys: left padded
            shape = padded if moe else logical.get(name.rpartition(".")[2], padded)
            if not (shape[0] <= padded[0] and shape[1] <= padded[1]):
                shape = padded  # the config does not describe this layer
            extra = (
                {"codebook": m["codebook"], "padded_shape": padded} if shape != padded else {"codebook": m["codebook"]}
            )
            rows.append(ModuleInfo(name, "exl3", shape, m["k"], None, m["nbytes"], extra=extra))
        pieces = {shard.removesuffix(".trellis") for table in tables.values() for shard in table.shards}
        return rows + dense_rows(probe, skip=set(modules) | set(tables) | pieces)
