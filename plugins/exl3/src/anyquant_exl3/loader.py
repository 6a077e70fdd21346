"""The EXL3 loader (pure-torch reference decoder on any device) and the ``cpu-fast`` base it shares with EXL2's
(:mod:`anyquant_exl3.exl2.loader`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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
    CPU_FAST_OPTIONS,
    FLOAT_SCALE_DTYPES,
    RUNTIME_OPTIONS,
    LoadContext,
    TransformersLoader,
    require_dtypes,
)
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
    "CPU_FAST_WEIGHTS_OPTIONS",
    "EXLLAMAV3_OPTIONS",
    "BF16CpuFast",
    "CpuFastState",
    "DecodedCpuFast",
    "EXL3Loader",
    "cpu_fast_backend",
    "cpu_fast_weights",
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


#: the load option of EXL3's and EXL2's ``cpu-fast`` (besides core's ``CPU_FAST_OPTIONS``)
CPU_FAST_WEIGHTS_OPTIONS: Mapping[str, str] = MappingProxyType(
    {
        "cpu_fast_weights": "cpu-fast's form of each decoded linear: 'auto' (default: Q8_0 blocks on the compiled "
        "block kernel where it is built and vectorized, else bfloat16), 'q8_0' (re-quantized per block of 32, 1.06 "
        "bytes per weight; refused where the kernel does not run) or 'bfloat16' (prepacked for oneDNN, 2 bytes)",
    }
)
_STATE_KEY = "exl3_cpu_fast"


def cpu_fast_backend() -> BackendInfo:
    """``cpu-fast``: each linear decoded once at load and held as Q8_0 blocks on the compiled block kernel (where it
    is built and vectorized) or as bfloat16 prepacked for oneDNN, where AMX or AVX512-BF16 makes that fast."""
    from anyquant_runtime.cpu import MISSING, engine

    found = engine()
    ok, reason = (False, MISSING) if found is None else found.bf16_head_status()
    return BackendInfo(
        "cpu-fast",
        ok,
        reason,
        devices=("cpu",),
        description="decode once at load to Q8_0 blocks on the compiled block kernel (1.06 bytes per weight; "
        "where it is built and vectorized) or a bfloat16 weight prepacked for oneDNN (AMX/AVX512-BF16, 2 bytes "
        "per weight; option cpu_fast_weights); a dense head as GPTQ/AWQ's cpu-fast",
    )


def cpu_fast_weights(extra: Mapping[str, Any]) -> str:
    """Load option ``cpu_fast_weights`` checked (``"auto"``, ``"q8_0"`` or ``"bfloat16"``); ``"q8_0"`` asked for
    where the compiled block kernel does not run is refused, before anything is read."""
    from anyquant.plugin import ParameterError
    from anyquant_runtime.cpu import block_kernel_is_fast

    from .qlinear import CPU_FAST_WEIGHTS

    weights = extra.get("cpu_fast_weights", "auto")
    if weights not in CPU_FAST_WEIGHTS:
        raise ParameterError(f"cpu_fast_weights={weights!r} is not one of {', '.join(map(repr, CPU_FAST_WEIGHTS))}")
    if weights == "q8_0" and not block_kernel_is_fast():
        raise ParameterError(
            "cpu_fast_weights='q8_0' runs on the compiled block kernel, which is not built (or not vectorized) "
            "here (python -m anyquant_cpu.kernels says why); 'auto' or 'bfloat16' hold the weights in bfloat16"
        )
    return str(weights)


@dataclass
class CpuFastState:
    """One cpu-fast load of an EXL3 / EXL2 checkpoint: core's plan (its options; :meth:`FastCPUPlan.convert` builds
    each linear from the layouts the layer offers), the ``cpu_fast_weights`` asked for, and each built module's form
    by ``id`` (for the record)."""

    plan: Any  # the engine's FastCPUPlan (anyquant_runtime.cpu.require())
    weights: str
    forms: dict[int, str] = field(default_factory=dict)

    def describe(self) -> str:
        """The linears' forms: one, or each with its count."""
        counts = Counter(self.forms.values())
        if len(counts) == 1:
            return next(iter(counts))
        return ", ".join(f"{form} x{n}" for form, n in counts.most_common())


class DecodedCpuFast:
    """The ``cpu-fast`` backend shared by the EXL3 and EXL2 loaders: each quantized linear decoded once at load and
    built by core's engine (:meth:`~anyquant_cpu.engine.FastCPUPlan.convert`) from the layouts the layer offers
    (:func:`anyquant_exl3.qlinear.decoded_layouts`: Q8_0 blocks on the compiled kernel, or bfloat16 prepacked for
    oneDNN, per option ``cpu_fast_weights``); a 16-bit LM head as GPTQ/AWQ's cpu-fast does (its exact table and the
    embedding left in the checkpoint file)."""

    def prepare(self, ctx: LoadContext) -> None:
        """cpu-fast: its options read (a bad one refused before any weight is read) into this load's state."""
        if ctx.backend != "cpu-fast":
            return
        from anyquant_runtime.cpu import require

        plan = require().FastCPUPlan.from_options(ctx.options.extra)
        ctx.state[_STATE_KEY] = CpuFastState(plan, cpu_fast_weights(ctx.options.extra))

    @staticmethod
    def fast_state(ctx: LoadContext) -> CpuFastState | None:
        """This load's cpu-fast state (``None``: another backend)."""
        state = ctx.state.get(_STATE_KEY)
        return state if isinstance(state, CpuFastState) else None

    def layer_weights(self, ctx: LoadContext) -> str:
        """The ``cpu_fast_weights`` a layer is built with (its :meth:`packed_layouts` offer them)."""
        state = self.fast_state(ctx)
        return "auto" if state is None else state.weights

    def fast_layer(self, ctx: LoadContext, name: str, layer: QuantLinearBase) -> Any:
        """``layer`` (built in ``reference`` mode with :meth:`layer_weights`) as cpu-fast runs it; itself under the
        other backends."""
        state = self.fast_state(ctx)
        if state is None:
            return layer
        fast = state.plan.convert(name, layer)
        if fast is layer:  # no layout runs here: the exact dequantized weight (the plan recorded why)
            form = "dequantized"
        else:
            form = "Q8_0 blocks" if getattr(fast, "type_name", None) == "Q8_0" else "bfloat16 prepacked"
        state.forms[id(fast)] = form
        return fast

    def linear_factory(
        self, ctx: LoadContext, stored: Mapping[str, Any], one: Callable[[str, int, int], QuantLinearBase]
    ) -> Callable[[str, nn.Linear], nn.Module | None]:
        """``make_linear``'s factory over ``one(name, in_features, out_features)``: a linear stored under its own
        name (a key of ``stored``), or one the checkpoint stores as parts (:func:`stored_parts`), each part
        built for cpu-fast."""

        def built(name: str, in_features: int, out_features: int) -> Any:
            return self.fast_layer(ctx, name, one(name, in_features, out_features))

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            if name in stored:
                return built(name, linear.in_features, linear.out_features)  # type: ignore[no-any-return]
            plan = stored_parts(name, linear, stored, ctx.probe)
            return None if plan is None else plan.build(built, linear)

        return factory

    def keep_embedding_dtype(self, ctx: LoadContext) -> bool:
        """cpu-fast: the embedding stays 16-bit for the fast head's tables (see ``FastCPUPlan``)."""
        return ctx.backend == "cpu-fast"

    def file_tables(self, ctx: LoadContext) -> bool:
        """cpu-fast: a 16-bit head and the embedding stay in the file, read by the fast head and embedding."""
        return ctx.backend == "cpu-fast" and ctx.device.type == "cpu"

    def finish_cpu_fast(self, loaded: LoadedModel, ctx: LoadContext) -> None:
        """After the build: cpu-fast's head (a quantized head is built as the linears are), and the record."""
        state = self.fast_state(ctx)
        if loaded.backend != "cpu-fast" or state is None:
            return
        import torch

        plan = state.plan
        plan.finish(loaded.module, getattr(torch, loaded.dtype), tables=ctx.file_tables)
        head = plan.head_info
        quantized_head = state.forms.get(id(loaded.module.get_output_embeddings()))
        if quantized_head is not None:
            head = {"head": f"{quantized_head} (a quantized head)"}
        record: dict[str, Any] = {"linears": state.describe(), "weights": state.weights, "lm_head": head}
        if plan.fallback:
            record["dequantized_layers"] = dict(plan.fallback)
        loaded.info = {**loaded.info, "cpu_fast": record}


#: the mixin's former name (it held every linear in bfloat16), for code that imports it
BF16CpuFast = DecodedCpuFast


class EXL3Loader(DecodedCpuFast, TransformersLoader):
    format = "exl3"
    backend_order = ("exllamav3", "cpu-fast", "dequantized", "reference")
    load_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {**RUNTIME_OPTIONS, **CPU_FAST_OPTIONS, **CPU_FAST_WEIGHTS_OPTIONS, **EXLLAMAV3_OPTIONS}
    )
    #: exllamav3's loader ties whenever lm_head is absent, and 1.6.x writes tie_word_embeddings: false always
    #: (format doc, "Tied embeddings"): the tensors decide, not the flag
    tie_absent_head: ClassVar[bool] = True

    def backends(self) -> list[BackendInfo]:
        return [
            _exllamav3_backend(),
            cpu_fast_backend(),
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
        """The ring-coded embedding installed (when the checkpoint has one), then cpu-fast's head."""
        src = ctx.source
        if isinstance(src, EXL3Source) and src.tables:
            loaded.info = {**loaded.info, "embedding": self._install_tables(loaded.module, src)}
        self.finish_cpu_fast(loaded, ctx)
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
        weights = self.layer_weights(ctx)
        src = ctx.source
        if isinstance(src, EXL3Source) and ctx.backend in ("reference", "cpu-fast"):
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
                cpu_fast_weights=weights,
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
