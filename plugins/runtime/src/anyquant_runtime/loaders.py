"""A base class for loaders of transformers-architecture checkpoints.

A format plugin subclasses :class:`TransformersLoader` and supplies ``make_linear`` (its
quantized linear for each ``nn.Linear`` of the model); the base class does the rest: device and
dtype, the meta skeleton, tensor filling, tying, the tokenizer, and core's generator. Importing
this module does not import torch; :meth:`TransformersLoader.load` does.

One load's state lives on its :class:`LoadContext` (``ctx.state``), never on the loader: :meth:`~TransformersLoader.plan`
reads what the backend choice needs, :meth:`~TransformersLoader.prepare` makes what the build's hooks share, and
:meth:`~TransformersLoader.finish` completes the loaded model (see :meth:`TransformersLoader.load` for the order).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from anyquant.errors import CheckpointError
from anyquant.probe import Probe, thaw
from anyquant.protocols import (
    BackendInfo,
    BackendSpec,
    Detection,
    LoadedModel,  # torch-free, like TensorSource: resolvable by typing.get_type_hints
    LoadOptions,
)

from .tensors import LAYER_PREFIX, TensorSource

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .layouts import Layout

__all__ = [
    "FAST_PLAN",
    "FLOAT_SCALE_DTYPES",
    "RUNTIME_OPTIONS",
    "LoadContext",
    "LoadPlan",
    "TransformersLoader",
    "require_dtypes",
]

#: the dtypes a quantized format's scales may be stored in (for :func:`require_dtypes`)
FLOAT_SCALE_DTYPES = frozenset({"F16", "BF16", "F32"})


def require_dtypes(probe: Probe, rules: Mapping[str, frozenset[str]], fmt: str) -> None:
    """A :class:`CheckpointError` when a tensor whose name ends in ``.<suffix>`` of ``rules`` has a dtype outside
    its set (integer scales would otherwise load as if they were float, silently wrong)."""
    bad = [
        f"{t.name} is {t.dtype} (expected {'/'.join(sorted(rules[suffix]))})"
        for t in probe.tensors.values()
        if (suffix := t.name.rpartition(".")[2]) in rules and t.dtype not in rules[suffix]
    ]
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CheckpointError(f"{probe.root}: the {fmt} tensors have wrong dtypes: {'; '.join(bad[:3])}{more}")


log = logging.getLogger(__name__)


#: the load options (``anyquant.load(path, **options)``) every :class:`TransformersLoader` reads
RUNTIME_OPTIONS: Mapping[str, str] = MappingProxyType(
    {
        "runtime": "'auto' (default), 'native' or 'transformers': which module class is built",
    }
)
_T = TypeVar("_T")

#: the key of a load's fast-backend plan in ``ctx.state`` (:meth:`TransformersLoader.fast_plan`)
FAST_PLAN = "fast_plan"


@dataclass
class LoadPlan:
    """What :meth:`TransformersLoader.plan` decides before anything is read: the backend, and the facts the
    choice was made from (a parsed tensor signature, layer counts) that the load keeps in ``ctx.state``."""

    backend: str
    state: dict[str, Any] = field(default_factory=dict)


class LoadContext:
    """One load: the probe, detection, tensor source, chosen backend, dtype, device and options, and ``state``,
    what the loader's hooks share during this load (started by :meth:`TransformersLoader.plan`)."""

    def __init__(
        self,
        probe: Probe,
        detection: Detection,
        source: TensorSource,
        backend: str,
        dtype: torch.dtype,
        device: torch.device,
        options: LoadOptions,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.probe, self.detection, self.source = probe, detection, source
        self.backend, self.dtype, self.device, self.options = backend, dtype, device, options
        #: per-load state of the loader's hooks (keys are the loader's own)
        self.state: dict[str, Any] = {} if state is None else state
        #: parameters the build left in the checkpoint file (when :meth:`TransformersLoader.file_tables` says so)
        self.file_tables: dict[str, Any] = {}


class TransformersLoader:
    """Loads a checkpoint whose ``config.json`` names a transformers causal-LM architecture.

    Backends: the format's own (:meth:`own_backends`, in :attr:`backend_order`), and every registered backend with an
    engine (:class:`~anyquant.protocols.BackendSpec`, e.g. ``cpu-fast``) that runs one of the packed layouts the
    format's layers offer (:attr:`layout_kinds`): the format writes no code for it. Such a backend's load options
    are accepted (:attr:`load_options`), its plan is made before anything is read (:meth:`fast_plan`), the format's
    reference linears pass through it (:meth:`fast_convert`), and it finishes the model after :meth:`finish`
    (:meth:`finish_fast`)."""

    format: str = "dense"
    #: the format's own backends in order of preference for ``backend="auto"``; registered backends it is offered
    #: (:meth:`fast_backends`) come after its own accelerator backends and before its exact ones
    backend_order: tuple[str, ...] = ("reference",)
    #: the keyword options of the format itself; :attr:`load_options` adds its fast backends'
    format_options: ClassVar[Mapping[str, str]] = RUNTIME_OPTIONS
    #: the packed layouts (:mod:`anyquant_runtime.layouts` classes) this format's layers offer a backend
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = ()
    #: tie a missing output head to the input embedding even where ``config.json`` says
    #: ``tie_word_embeddings: false`` (formats whose own loader does so); otherwise that is a MissingTensorError.
    tie_absent_head: ClassVar[bool] = False

    @property
    def load_options(self) -> Mapping[str, str]:
        """The keyword options ``anyquant.load`` accepts for this loader (name -> what it does): the format's own and
        those of the backends it is offered; any other keyword is a :class:`~anyquant.errors.ParameterError` before
        anything is read. A loader without this attribute (a third party's) gets every keyword unchecked."""
        kinds = [k.kind for k in self.layout_kinds]
        merged = dict(self.format_options)
        for spec in self.fast_backends():
            merged.update(spec.options_for(kinds))
        return MappingProxyType(merged)

    def fast_backends(self) -> list[BackendSpec]:
        """The registered backends with an engine that run one of :attr:`layout_kinds`, in registration order; where no
        plugin registers ``cpu-fast``, its stand-in (:data:`anyquant_runtime.cpu.NOT_INSTALLED`: listed, unavailable,
        saying what to install)."""
        if not self.layout_kinds:
            return []
        from anyquant.api import default_registry

        from .cpu import NOT_INSTALLED

        kinds = {k.kind for k in self.layout_kinds}
        registered = default_registry().backends()
        fast = [s for s in registered.values() if s.engine and kinds & set(s.layouts)]
        if NOT_INSTALLED.name not in registered and kinds & set(NOT_INSTALLED.layouts):
            fast.append(NOT_INSTALLED)
        return fast

    def fast_backend_info(self, spec: BackendSpec) -> BackendInfo:
        """``spec`` as this format offers it: available where its engine runs one of :attr:`layout_kinds` here."""
        from .cpu import engine_of

        found = engine_of(spec.name)
        if found is None:
            from .cpu import MISSING, NOT_INSTALLED

            ok, reason = False, MISSING if spec is NOT_INSTALLED else f"the engine of {spec.name} cannot be imported"
        else:
            ok, reason = found.layout_kinds_run(*self.layout_kinds)
        kinds = ", ".join(k.kind for k in self.layout_kinds)
        return BackendInfo(
            spec.name, ok, reason, devices=spec.devices, description=f"{spec.description} ({self.format}: {kinds})"
        )

    def own_backends(self) -> list[BackendInfo]:
        """The format's own backends (its exact ones, and an accelerator backend that is its alone)."""
        return [BackendInfo("reference", True, description="pure torch, runs anywhere")]

    def backends(self) -> list[BackendInfo]:
        fast = [self.fast_backend_info(s) for s in self.fast_backends()]
        return _around(self.own_backends(), fast, lambda b: b.name)

    def preference(self) -> tuple[str, ...]:
        """``auto``'s order: :attr:`backend_order`'s accelerator backends, the fast backends, its exact backends."""
        return tuple(_around(list(self.backend_order), [s.name for s in self.fast_backends()], lambda n: n))

    def validate(self, probe: Probe, detection: Detection) -> None:
        """Second line of defence: re-check the tensor signature before any weights are read."""

    def choose_backend(self, requested: str, device: torch.device) -> str:
        """The backend for ``requested`` on ``device``: :func:`anyquant.backends.choose_backend` over
        :meth:`backends` in :meth:`preference` (a loader whose checkpoint rules some out passes ``skip``)."""
        from anyquant.backends import choose_backend

        return choose_backend(self.format, self.backends(), self.preference(), requested, device)

    def plan(self, probe: Probe, detection: Detection, options: LoadOptions, device: torch.device) -> LoadPlan:
        """The first step of a load, before the tokenizer or any weight is read: the backend
        (:meth:`choose_backend` of ``options.backend``), and in ``LoadPlan.state`` whatever per-load facts the
        choice needed, which the load keeps as ``ctx.state`` (read a tensor signature once, here)."""
        return LoadPlan(self.choose_backend(options.backend, device))

    def prepare(self, ctx: LoadContext) -> None:
        """Called once, with the tensor source open and before :meth:`make_linear`, :meth:`runtime`,
        :meth:`keep_embedding_dtype` and :meth:`file_tables` are asked: make what they share (kernel plans)
        in ``ctx.state``."""

    def finish(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        """Called once the model is built and wrapped (the source is closed): install what the build left out
        (``ctx.file_tables``), record this load in ``loaded.info``; returns the loaded model."""
        return loaded

    def model_config(self, probe: Probe) -> Mapping[str, Any]:
        if probe.config is None:
            from anyquant.errors import CheckpointError

            raise CheckpointError(f"{probe.root} has no config.json: the architecture is unknown")
        config: Mapping[str, Any] = thaw(probe.config)
        return config

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None] | None:
        """The factory for quantized linears; ``None`` keeps every linear dense."""
        return None

    def make_module(self, ctx: LoadContext) -> Callable[[str, nn.Module], nn.Module | None] | None:
        """The factory for a format's own form of other modules (e.g. a fused experts module kept packed), asked for
        each module of the skeleton before its parameters are read; ``None`` (the default) keeps them."""
        return None

    def keep_embedding_dtype(self, ctx: LoadContext) -> bool:
        """Build the input embedding in the checkpoint's 16-bit dtype (see :func:`anyquant_runtime.build.build_model`);
        a loader that says yes replaces it after the build. By default: where the fast backend's plan replaces it."""
        plan = self.fast_plan(ctx)
        return plan is not None and bool(plan.keeps_embedding_dtype())

    def file_tables(self, ctx: LoadContext) -> bool:
        """Leave the input embedding and a dense head in the checkpoint file, unread (``build_model``'s
        ``file_tables``, collected in ``ctx.file_tables``); a loader that says yes installs or fills them after
        the build. By default: where the fast backend's plan reads them from there, on the CPU."""
        plan = self.fast_plan(ctx)
        return plan is not None and ctx.device.type == "cpu" and bool(plan.file_tables())

    def start_fast(self, backend: str, options: LoadOptions) -> Any:
        """The plan of ``backend`` when it is one of :meth:`fast_backends` (its engine's ``plan(options)``: the
        options checked before anything is read), else ``None``."""
        if backend not in {s.name for s in self.fast_backends()}:
            return None
        from .cpu import require_engine

        return require_engine(backend).plan(options.extra)

    @staticmethod
    def fast_plan(ctx: LoadContext) -> Any:
        """This load's fast-backend plan (``None`` on the format's own backends): ``convert(name, layer)`` turns a
        reference linear into the backend's module (:meth:`fast_convert`)."""
        return ctx.state.get(FAST_PLAN)

    def fast_convert(self, ctx: LoadContext, name: str, layer: nn.Module, **kwargs: Any) -> nn.Module:
        """``layer`` (a reference linear offering its packed layouts) as this load's fast backend runs it; itself
        on the format's own backends."""
        plan = self.fast_plan(ctx)
        if plan is None:
            return layer
        fast: nn.Module = plan.convert(name, layer, **kwargs)
        return fast

    def finish_fast(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        """After :meth:`finish`: the fast backend completes the model (its head, its decode-path modules) and its
        record goes in ``loaded.info`` under its name (``cpu-fast``: ``info["cpu_fast"]``)."""
        plan = self.fast_plan(ctx)
        if plan is None:
            return loaded
        import torch

        plan.finish(loaded.module, getattr(torch, loaded.dtype), tables=ctx.file_tables)
        return self.record_fast(loaded, plan.summary())

    @staticmethod
    def record_fast(loaded: LoadedModel, record: Mapping[str, Any]) -> LoadedModel:
        """``record`` in ``loaded.info`` under the fast backend's name (``cpu-fast``: ``info["cpu_fast"]``)."""
        loaded.info = {**loaded.info, loaded.backend.replace("-", "_"): record}
        return loaded

    def runtime(self, ctx: LoadContext) -> str:
        """The module class to build: ``load(..., runtime=...)``: ``"auto"`` (the default: anyquant's native
        decoder for the Llama-family configs it supports, transformers' class otherwise), ``"native"`` or
        ``"transformers"``; see :func:`anyquant_runtime.build.choose_runtime`."""
        return str(ctx.options.extra.get("runtime", "auto"))

    def tensor_source(self, probe: Probe, options: LoadOptions) -> TensorSource:
        from .tensors import SafetensorsSource

        return SafetensorsSource(probe)

    def tokenizer(self, probe: Probe, options: LoadOptions) -> Any:
        from .tokenizer import load_tokenizer

        return load_tokenizer(probe, trust_remote_code=options.trust_remote_code)

    def load(self, probe: Probe, detection: Detection, options: LoadOptions) -> LoadedModel:
        """Steps, in order: :meth:`plan` (the backend), :meth:`tokenizer`, :meth:`tensor_source`,
        :meth:`model_config`, :meth:`prepare`, the build (asking :meth:`make_linear`, :meth:`runtime`,
        :meth:`keep_embedding_dtype`, :meth:`file_tables`), :meth:`finish`."""
        from anyquant.protocols import LoadedModel

        from .build import build_model, resolve_device, resolve_dtype
        from .generate import TorchGenerator

        device = resolve_device(options.device)
        dtype = resolve_dtype(options.dtype, device)
        plan = self.plan(probe, detection, options, device)
        backend = plan.backend
        fast = self.start_fast(backend, options)  # its options checked before anything is read
        if fast is not None:
            plan.state[FAST_PLAN] = fast
        kv_dtype = None if fast is None else fast.kv_cache_dtype(dtype)
        from anyquant._memory import release_free_heap

        # the tokenizer first: its parse peaks at several times what it keeps, and
        # that transient then lands before the weights, not on top of them; nothing is open yet if it fails
        tokenizer = self.tokenizer(probe, options)
        release_free_heap()
        source = self.tensor_source(probe, options)
        ctx = LoadContext(probe, detection, source, backend, dtype, device, options, plan.state)
        config = self.model_config(probe)
        try:
            self.prepare(ctx)
            module = build_model(
                config,
                source,
                make_linear=self.make_linear(ctx),
                make_module=self.make_module(ctx),
                dtype=dtype,
                device=device,
                trust_remote_code=options.trust_remote_code,
                runtime=self.runtime(ctx),
                keep_embedding_dtype=self.keep_embedding_dtype(ctx),
                file_tables=ctx.file_tables if self.file_tables(ctx) else None,
                tie_absent_head=self.tie_absent_head,
            )
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
        release_free_heap()  # the build's read and repacking temporaries
        unused: list[str] = getattr(source, "unused", list)()
        if unused:
            _check_unused_layers(unused, list(source.keys()), config)
            log.warning("%d checkpoint tensors were not used (e.g. %s)", len(unused), unused[:3])
        if backend == "reference":
            check_decodes(module)
        info: dict[str, Any] = {"unused_tensors": unused, "runtime": getattr(module, "runtime_name", "transformers")}
        if hasattr(module, "kv_cache_dtype"):  # the native decoder: its caches hold this (the exact backends: None)
            setattr(module, "kv_cache_dtype", kv_dtype)  # noqa: B010 - an nn.Module's plain attribute
            info["kv_cache"] = str(kv_dtype or dtype).replace("torch.", "")
        loaded = LoadedModel(
            module=module,
            tokenizer=tokenizer,
            format=detection.format,
            backend=backend,
            detection=detection,
            generator=TorchGenerator(module, tokenizer, device=device, eos_ids=end_of_sequence_ids(probe)),
            # a generator put in its place without complete/loglikelihood gets them from one over the same module
            fallback=lambda: TorchGenerator(module, tokenizer, device=device),
            device=str(device),
            dtype=str(dtype).replace("torch.", ""),
            info=info,
        )
        return self.finish_fast(self.finish(loaded, ctx), ctx)


def _around(own: list[_T], fast: list[_T], name: Callable[[_T], str]) -> list[_T]:
    """``fast`` between ``own``'s accelerator backends and its exact ones (:data:`anyquant.backends.EXACT_BACKENDS`),
    each keeping its order."""
    from anyquant.backends import EXACT_BACKENDS

    exact = [x for x in own if name(x) in EXACT_BACKENDS]
    return [x for x in own if name(x) not in EXACT_BACKENDS] + fast + exact


def _check_unused_layers(unused: Sequence[str], names: Sequence[str], config: Mapping[str, Any]) -> None:
    """Tensors of decoder layers past ``num_hidden_layers`` (plus DeepSeek/GLM's multi-token-prediction
    layers, ``num_nextn_predict_layers``) left unused, under the same prefix as layers that were used:
    config.json describes a shorter model than the weights, and the built one would run without those
    layers. (A stack whose tensors were all unused, such as a vision tower's, is not the decoder.)"""
    layers = config.get("num_hidden_layers")
    extra = config.get("num_nextn_predict_layers") or 0
    if not isinstance(layers, int) or not isinstance(extra, int):
        return
    skipped = set(unused)
    used_stacks = {m.group(1) for n in names if n not in skipped and (m := LAYER_PREFIX.match(n))}
    beyond = sorted(
        {
            int(m.group(2))
            for n in unused
            if (m := LAYER_PREFIX.match(n)) and m.group(1) in used_stacks and int(m.group(2)) >= layers + extra
        }
    )
    if beyond:
        raise CheckpointError(
            f"config.json says num_hidden_layers={layers}, but the checkpoint has tensors of layer(s) "
            f"{', '.join(map(str, beyond[:5]))}{' ...' if len(beyond) > 5 else ''}: the config and the weights "
            "disagree (the model would run without those layers)"
        )


def check_decodes(module: Any) -> None:
    """Decode every quantized linear of a ``reference``-mode model once and drop the result, so that packed
    tensors that contradict each other (a ``g_idx`` past its groups, ``suh`` shorter than the trellis, an
    EXL2 ``q_invperm`` out of range) fail at load, as in the other backends, and not at the first forward.
    Peak memory: one layer's weight."""
    import torch

    from .qlinear import QuantLinearBase

    with torch.no_grad():
        for name, m in module.named_modules():
            if isinstance(m, QuantLinearBase) and m.mode == "reference":
                shape = tuple(m.dequantize().shape)
                if shape != (m.out_features, m.in_features):
                    raise CheckpointError(
                        f"{name}: the packed tensors decode to a {list(shape)} weight, the layer is "
                        f"[{m.out_features}, {m.in_features}]"
                    )


def end_of_sequence_ids(probe: Probe) -> set[int]:
    """The ``eos_token_id`` values (an id or a list) of the checkpoint's ``config.json`` and
    ``generation_config.json``: transformers' ``generate`` stops at the latter's, which often lists more
    (Llama-3-Instruct's ``<|eot_id|>``, Qwen2.5's ``<|im_end|>``) than the tokenizer's one ``eos_token``."""
    from anyquant.probe import read_checkpoint_json

    sources: list[Any] = [probe.config]
    if probe.root.is_dir():
        sources.append(read_checkpoint_json(probe.root, "generation_config.json"))
    ids: set[int] = set()
    for cfg in sources:
        value = cfg.get("eos_token_id") if isinstance(cfg, Mapping) else None
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31:
                ids.add(v)
    return ids
