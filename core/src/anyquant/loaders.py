"""A base class for loaders of transformers-architecture checkpoints.

A format plugin subclasses :class:`TransformersLoader` and supplies ``make_linear`` (its
quantized linear for each ``nn.Linear`` of the model); the base class does the rest: device and
dtype, the meta skeleton, tensor filling, tying, the tokenizer, and core's generator. Importing
this module does not import torch; :meth:`TransformersLoader.load` does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import CheckpointError, UnsupportedBackendError
from .probe import Probe, thaw
from .protocols import BackendInfo, Detection, LoadOptions

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .runtime.loaded import LoadedModel
    from .runtime.tensors import TensorSource

__all__ = [
    "CPU_FAST_OPTIONS",
    "FLOAT_SCALE_DTYPES",
    "RUNTIME_OPTIONS",
    "LoadContext",
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
#: the ``cpu-fast`` backend's options (read by :class:`anyquant.runtime.fastcpu.FastCPUPlan`)
CPU_FAST_OPTIONS: Mapping[str, str] = MappingProxyType(
    {
        "cpu_fast_prefill": "None (default: prompts in exact float32), 'bfloat16' or 'auto'",
        "cpu_fast_small_rows": "rows up to which the decode kernels run (default 64)",
        "cpu_fast_head": "'bfloat16' (default: the prepacked head) or 'dense'",
        "cpu_fast_tables": "'file' (default: embedding and exact head read from the checkpoint) or 'memory'",
    }
)


class LoadContext:
    """What ``make_linear`` needs: the probe, detection, tensor source, chosen backend, dtype, device."""

    def __init__(
        self,
        probe: Probe,
        detection: Detection,
        source: TensorSource,
        backend: str,
        dtype: torch.dtype,
        device: torch.device,
        options: LoadOptions,
    ) -> None:
        self.probe, self.detection, self.source = probe, detection, source
        self.backend, self.dtype, self.device, self.options = backend, dtype, device, options
        #: parameters the build left in the checkpoint file (when :meth:`TransformersLoader.file_tables` says so)
        self.file_tables: dict[str, Any] = {}


class TransformersLoader:
    """Loads a checkpoint whose ``config.json`` names a transformers causal-LM architecture."""

    format: str = "dense"
    #: backends in order of preference for ``backend="auto"``.
    backend_order: tuple[str, ...] = ("reference",)
    #: the keyword options ``anyquant.load`` accepts for this loader (name -> what it does); any other keyword
    #: is a :class:`~anyquant.errors.ParameterError` before anything is read. A loader without this attribute
    #: (a third party's) gets every keyword unchecked.
    load_options: ClassVar[Mapping[str, str]] = RUNTIME_OPTIONS

    def backends(self) -> list[BackendInfo]:
        return [BackendInfo("reference", True, description="pure torch, runs anywhere")]

    def validate(self, probe: Probe, detection: Detection) -> None:
        """Second line of defence: re-check the tensor signature before any weights are read."""

    def choose_backend(self, requested: str, device: torch.device) -> str:
        available = {b.name: b for b in self.backends()}
        if requested == "auto":
            for name in self.backend_order:
                info = available.get(name)
                if info is not None and info.available:
                    return name
            raise UnsupportedBackendError(
                f"no {self.format} backend can run here: "
                + "; ".join(f"{b.name}: {b.reason}" for b in available.values())
            )
        info = available.get(requested)
        if info is None:
            raise UnsupportedBackendError(
                f"backend {requested!r} is not a {self.format} backend; choose one of {sorted(available)}"
            )
        if not info.available:
            raise UnsupportedBackendError(f"{self.format} backend {requested!r} cannot run here: {info.reason}")
        return requested

    def model_config(self, probe: Probe) -> Mapping[str, Any]:
        if probe.config is None:
            from .errors import CheckpointError

            raise CheckpointError(f"{probe.root} has no config.json: the architecture is unknown")
        return thaw(probe.config)

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None] | None:
        """The factory for quantized linears; ``None`` keeps every linear dense."""
        return None

    def keep_embedding_dtype(self, ctx: LoadContext) -> bool:
        """Build the input embedding in the checkpoint's 16-bit dtype (see :func:`anyquant.runtime.build.build_model`);
        a loader that says yes replaces it after the build."""
        return False

    def file_tables(self, ctx: LoadContext) -> bool:
        """Leave the input embedding and a dense head in the checkpoint file, unread (``build_model``'s
        ``file_tables``, collected in ``ctx.file_tables``); a loader that says yes installs or fills them after
        the build."""
        return False

    def runtime(self, ctx: LoadContext) -> str:
        """The module class to build: ``load(..., runtime=...)``: ``"auto"`` (the default: anyquant's native
        decoder for the Llama-family configs it supports, transformers' class otherwise), ``"native"`` or
        ``"transformers"``; see :func:`anyquant.runtime.build.choose_runtime`."""
        return str(ctx.options.extra.get("runtime", "auto"))

    def tensor_source(self, probe: Probe, options: LoadOptions) -> TensorSource:
        from .runtime.tensors import SafetensorsSource

        return SafetensorsSource(probe)

    def tokenizer(self, probe: Probe, options: LoadOptions) -> Any:
        from .runtime.tokenizer import load_tokenizer

        return load_tokenizer(probe, trust_remote_code=options.trust_remote_code)

    def load(self, probe: Probe, detection: Detection, options: LoadOptions) -> LoadedModel:
        from .runtime.build import build_model, resolve_device, resolve_dtype
        from .runtime.generate import TorchGenerator
        from .runtime.loaded import LoadedModel

        device = resolve_device(options.device)
        dtype = resolve_dtype(options.dtype, device)
        backend = self.choose_backend(options.backend, device)
        from ._memory import release_free_heap

        # the tokenizer first: its parse peaks at ~3x what it keeps (SmolLM2's: +41 MiB, then 14), and
        # that transient then lands before the weights, not on top of them; nothing is open yet if it fails
        tokenizer = self.tokenizer(probe, options)
        release_free_heap()
        source = self.tensor_source(probe, options)
        ctx = LoadContext(probe, detection, source, backend, dtype, device, options)
        try:
            module = build_model(
                self.model_config(probe),
                source,
                make_linear=self.make_linear(ctx),
                dtype=dtype,
                device=device,
                trust_remote_code=options.trust_remote_code,
                runtime=self.runtime(ctx),
                keep_embedding_dtype=self.keep_embedding_dtype(ctx),
                file_tables=ctx.file_tables if self.file_tables(ctx) else None,
            )
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
        release_free_heap()  # the build's read and repacking temporaries
        unused: list[str] = getattr(source, "unused", list)()
        if unused:
            log.warning("%d checkpoint tensors were not used (e.g. %s)", len(unused), unused[:3])
        return LoadedModel(
            module=module,
            tokenizer=tokenizer,
            format=detection.format,
            backend=backend,
            detection=detection,
            generator=TorchGenerator(module, tokenizer, device=device),
            device=str(device),
            dtype=str(dtype).replace("torch.", ""),
            info={"unused_tensors": unused, "runtime": getattr(module, "runtime_name", "transformers")},
        )
