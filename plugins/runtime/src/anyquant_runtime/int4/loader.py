"""The loader base of int4 group-quantized formats (GPTQ, AWQ) and of the packed formats that share its backend
choice (compressed-tensors, FP8, bitsandbytes, MLX, MXFP4): backends, the backend choice, and the per-load plan of
the ``gptqmodel`` backend.

A format subclasses :class:`Int4Loader` and supplies ``validate``, ``make_linear`` (its reference linear, passed
through :meth:`~anyquant_runtime.loaders.TransformersLoader.fast_convert`, or ``Int4State.kernel_plan.build(...)``
under backend ``gptqmodel``) and ``inspect``; it says what differs in its backend choice with
:attr:`Int4Loader.kernel_method`, :attr:`Int4Loader.gptqmodel_layouts` and :meth:`Int4Loader.facts`. The registered
backends that run its layouts (:attr:`~anyquant_runtime.loaders.TransformersLoader.layout_kinds`) are the base's.
Importing this module imports neither torch nor GPTQModel.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from anyquant.errors import ConfigError, UnsupportedBackendError, UnsupportedFormatError
from anyquant.probe import Probe
from anyquant.protocols import BackendInfo, Detection, LoadOptions

from ..layouts import Decoded, Int4Groups, Layout
from ..loaders import (
    FLOAT_SCALE_DTYPES,
    RUNTIME_OPTIONS,
    LoadContext,
    LoadPlan,
    TransformersLoader,
)
from . import GPTQMODEL_OPTIONS

if TYPE_CHECKING:
    import torch

    from anyquant.protocols import LoadedModel

    from .gptqmodel_kernels import KernelPlan

__all__ = [
    "DEQUANT_RAM_SHARE",
    "INT4_OPTIONS",
    "QUANT_DTYPES",
    "Int4Loader",
    "Int4State",
    "PackedFormatLoader",
    "gptqmodel_backend",
    "gptqmodel_status",
]

#: auto picks "dequantized" over "reference" when the dense weights take less than this share of RAM
DEQUANT_RAM_SHARE = 0.5

#: packed codes are int32, scales float (GPTQ and AWQ alike; for :func:`anyquant_runtime.loaders.require_dtypes`)
QUANT_DTYPES: Mapping[str, frozenset[str]] = MappingProxyType(
    {"qweight": frozenset({"I32"}), "qzeros": frozenset({"I32"}), "scales": FLOAT_SCALE_DTYPES}
)

#: the load options of every :class:`Int4Loader` (its fast backends' are the base's)
INT4_OPTIONS: Mapping[str, str] = MappingProxyType({**RUNTIME_OPTIONS, **GPTQMODEL_OPTIONS})

#: the key of :class:`Int4State` in ``ctx.state``
STATE_KEY = "int4"


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 8 << 30


def gptqmodel_backend() -> BackendInfo:
    """The ``gptqmodel`` backend (GPTQModel's CUDA kernels; see :mod:`anyquant_runtime.int4.gptqmodel_kernels`)."""
    try:
        from .gptqmodel_kernels import gptqmodel_backend_info
    except ImportError:  # pragma: no cover - torch missing
        return BackendInfo("gptqmodel", False, "torch is not installed", devices=("cuda",))
    return gptqmodel_backend_info()


def gptqmodel_status() -> tuple[bool, str]:
    """The registered ``gptqmodel`` backend's availability here (:class:`~anyquant.protocols.BackendSpec`)."""
    info = gptqmodel_backend()
    return info.available, info.reason


@dataclass
class Int4State:
    """One int4 load: what the backend choice is made from (:meth:`Int4Loader.facts`, read once) and the
    plans :meth:`Int4Loader.prepare` makes for it; kept in ``ctx.state`` (:meth:`Int4Loader.state`)."""

    #: ``options.extra`` (the ``gptqmodel`` backend's options)
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: the checkpoint's layout (``detection.variant``), for :attr:`Int4Loader.gptqmodel_layouts` (``None``: not
    #: known, taken to be one GPTQModel runs)
    layout: str | None = None
    #: layers the fast backend's engine takes here, counted from the headers (:func:`anyquant_cpu.engine.layouts_run`;
    #: ``auto`` passes the fast backends by when 0); ``None``: not counted, every layer is taken to
    fast_layers: int | None = None
    #: float32 bytes of every quantized layer dequantized (``auto`` picks ``reference`` over ``dequantized``
    #: when they take :data:`DEQUANT_RAM_SHARE` of RAM or more); ``None``: not counted, they fit
    dense_bytes: int | None = None
    #: the format's parsed tensor signature, when :meth:`Int4Loader.facts` read one (GPTQ's)
    signature: Any = None
    #: backend ``gptqmodel``: the GPTQModel kernels of each layer
    kernel_plan: KernelPlan | None = None


class Int4Loader(TransformersLoader):
    """Loads a checkpoint of 4-bit (GPTQ: 2/3/4/8-bit) codes with a scale and zero point per group.

    ``auto`` picks, in order: ``gptqmodel`` on a CUDA device when GPTQModel is installed and runs the
    layout; a registered backend that runs int4 groups (``cpu-fast`` on the CPU) where it takes some layers; else
    ``dequantized`` when the dense weights fit in half of RAM, ``reference`` when they do not.
    """

    backend_order = ("gptqmodel", "dequantized", "reference")
    format_options: ClassVar[Mapping[str, str]] = INT4_OPTIONS
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = (Int4Groups,)
    #: GPTQModel's quantization method of this format's kernels (:meth:`KernelPlan.create`): "gptq" or "awq"
    kernel_method: ClassVar[str] = "gptq"
    #: the layouts (``detection.variant``) GPTQModel's kernels run; ``None``: every layout this loader loads
    gptqmodel_layouts: ClassVar[frozenset[str] | None] = None

    def own_backends(self) -> list[BackendInfo]:
        return [
            gptqmodel_backend(),
            BackendInfo("dequantized", True, description="dequantize once at load; dense speed and memory"),
            BackendInfo("reference", True, description="pure torch, dequantize on every forward; packed memory"),
        ]

    def facts(self, probe: Probe, detection: Detection, options: LoadOptions) -> Int4State:
        """What the backend choice needs to know of this checkpoint, read once per load (header only). The
        base counts nothing (``fast_layers`` and ``dense_bytes`` stay ``None``); a format whose layers may not
        all run on the CPU engine describes them as packed layouts and counts them
        (:func:`anyquant_cpu.engine.layouts_run`)."""
        return Int4State(extra=options.extra, layout=detection.variant)

    def plan(self, probe: Probe, detection: Detection, options: LoadOptions, device: torch.device) -> LoadPlan:
        facts = self.facts(probe, detection, options)
        return LoadPlan(self.choose_backend(options.backend, device, facts), {STATE_KEY: facts})

    def choose_backend(self, requested: str, device: Any, facts: Int4State | None = None) -> str:
        """The backend for ``requested`` on ``device`` (:func:`anyquant.backends.choose_backend`, with what this
        checkpoint rules out: :meth:`backend_skips`); ``facts`` (:meth:`facts`) are this checkpoint's (without
        them, as in a call outside a load, the layout is taken to run on GPTQModel and every layer to fit the fast
        backends and dequantized)."""
        from anyquant.backends import choose_backend

        facts = Int4State() if facts is None else facts
        if requested == "gptqmodel":
            from .gptqmodel_kernels import check_gptqmodel_request

            check_gptqmodel_request(self.format, device, facts.extra)
            if not self._gptqmodel_runs(facts.layout):
                layouts = "/".join(sorted(s.upper() for s in self.gptqmodel_layouts or ()))
                raise UnsupportedBackendError(
                    f"{self.format} backend 'gptqmodel' runs the {layouts} layout; this checkpoint is {facts.layout}: "
                    f"use backend='dequantized' (or re-export it as {layouts})"
                )
            return requested
        return choose_backend(
            self.format, self.backends(), self.preference(), requested, device, skip=self.backend_skips(facts)
        )

    def backend_skips(self, facts: Int4State) -> dict[str, str]:
        """What ``auto`` passes by for this checkpoint: GPTQModel's kernels where they do not run its layout, the
        fast backends where no layer takes their kernels, ``dequantized`` where the dense weights would take
        :data:`DEQUANT_RAM_SHARE` of RAM or more (``reference`` then, packed)."""
        skip: dict[str, str] = {}
        if not self._gptqmodel_runs(facts.layout):
            skip["gptqmodel"] = f"its kernels do not run the {facts.layout} layout"
        if facts.fast_layers == 0:
            skip.update((s.name, "no layer of this checkpoint runs on its kernels") for s in self.fast_backends())
        if facts.dense_bytes is not None and facts.dense_bytes >= DEQUANT_RAM_SHARE * _ram_bytes():
            skip["dequantized"] = f"the dense weights would take {DEQUANT_RAM_SHARE:.0%} of RAM or more"
        return skip

    def _gptqmodel_runs(self, layout: str | None) -> bool:
        return self.gptqmodel_layouts is None or layout is None or layout in self.gptqmodel_layouts

    @staticmethod
    def state(ctx: LoadContext) -> Int4State:
        """This load's :class:`Int4State` (made by :meth:`plan`)."""
        state = ctx.state.get(STATE_KEY)
        if not isinstance(state, Int4State):  # a context this loader's plan did not make
            state = ctx.state[STATE_KEY] = Int4State(extra=ctx.options.extra, layout=ctx.detection.variant)
        return state

    def prepare(self, ctx: LoadContext) -> None:
        """Backend ``gptqmodel``: its kernels (GPTQModel is imported here, and a bad ``gptqmodel_kernel`` refused
        before any weight is read)."""
        state = self.state(ctx)
        state.kernel_plan = None
        if ctx.backend == "gptqmodel":
            from .gptqmodel_kernels import KernelPlan

            state.kernel_plan = KernelPlan.create(self.kernel_method, ctx.device, ctx.dtype, ctx.options.extra)

    def finish(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        """The ``gptqmodel`` plan's record in ``loaded.info``."""
        state = self.state(ctx)
        if loaded.backend == "gptqmodel" and state.kernel_plan is not None:
            loaded.info = {**loaded.info, "gptqmodel": state.kernel_plan.summary()}
        return loaded


class PackedFormatLoader(Int4Loader):
    """The loader base of formats that GPTQModel's kernels do not run (compressed-tensors, FP8, bitsandbytes, MLX):
    :class:`Int4Loader`'s backend choice without the ``gptqmodel`` backend.

    A format sets :attr:`~anyquant_runtime.loaders.TransformersLoader.layout_kinds` and :attr:`serve_hint`, and
    implements :meth:`read_signature` (its parsed modules, read once per load into ``Int4State.signature``) and
    :meth:`fast_layer_count` (how many of them a fast backend converts here: ``auto`` passes the fast backends by
    where there are none), which describes each module in the packed layouts of :mod:`anyquant_runtime.layouts` from
    the headers alone and lets the engine count them (:func:`anyquant_cpu.engine.layouts_run`): the loader holds no
    kernel knowledge. By default every layer is described as ``Decoded`` (a bfloat16 copy, which ``cpu-fast``
    prepacks for oneDNN where the CPU has AMX or AVX512-BF16).
    """

    gptqmodel_layouts: ClassVar[frozenset[str] | None] = frozenset()
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = (Decoded,)
    #: what to do on a GPU, said when ``gptqmodel`` is asked for
    serve_hint: ClassVar[str] = "serve it with vLLM (`anyquant serve --engine vllm`)"

    def read_signature(self, probe: Probe) -> Any:
        raise NotImplementedError

    @staticmethod
    def raise_detected_error(detection: Detection) -> None:
        """A claimed checkpoint whose config is malformed: detection kept the plugin's typed error in
        ``details["config_error"]`` (``[kind, message]``: ``ConfigError`` or ``UnsupportedFormatError``) rather than
        let it read as "no plugin recognises this"; the load raises it as it is."""
        kept = detection.details.get("config_error")
        if kept:
            raise (UnsupportedFormatError if kept[0] == "UnsupportedFormatError" else ConfigError)(str(kept[1]))

    def fast_layer_count(self, signature: Any, probe: Probe) -> int:
        """How many of ``signature``'s modules the fast backend converts here, before any tensor is read (``probe``:
        the headers the signature was read from). By default each is described as ``Decoded``."""
        from ..cpu import layouts_run

        return layouts_run([Decoded(None)] for _ in getattr(signature, "modules", signature))

    def own_backends(self) -> list[BackendInfo]:
        return [b for b in super().own_backends() if b.name in ("dequantized", "reference")]

    def choose_backend(self, requested: str, device: Any, facts: Int4State | None = None) -> str:
        if requested == "gptqmodel":
            raise UnsupportedBackendError(
                f"{self.format} has no 'gptqmodel' backend; on a GPU {self.serve_hint}, here use "
                + ", ".join(repr(b.name) for b in self.backends())
            )
        return super().choose_backend(requested, device, Int4State(layout=self.format) if facts is None else facts)

    def facts(self, probe: Probe, detection: Detection, options: LoadOptions) -> Int4State:
        facts = super().facts(probe, detection, options)
        facts.layout = self.format
        facts.signature = self.read_signature(probe)
        facts.fast_layers = self.fast_layer_count(facts.signature, probe)
        return facts
