"""The GPTQ loader: validation, backends, and the per-linear factory."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from anyquant.errors import CheckpointError, UnsupportedBackendError
from anyquant.loaders import (
    CPU_FAST_OPTIONS,
    FLOAT_SCALE_DTYPES,
    RUNTIME_OPTIONS,
    LoadContext,
    TransformersLoader,
    require_dtypes,
)
from anyquant.probe import Probe
from anyquant.protocols import BackendInfo, Detection, ModuleInfo
from anyquant.report import dense_rows

from .signature import read_signature

if TYPE_CHECKING:
    from torch import nn

    from anyquant.runtime.loaded import LoadedModel

    from .gptqmodel_kernels import KernelPlan

__all__ = ["COMPILE_OPTION", "CPU_TEST_OPTION", "GPTQMODEL_OPTIONS", "KERNEL_OPTION", "GPTQLoader"]

log = logging.getLogger(__name__)

#: auto picks "dequantized" when the dense weights take less than this share of RAM.
DEQUANT_RAM_SHARE = 0.5


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 8 << 30


def cpu_fast_backend() -> BackendInfo:
    """The ``cpu-fast`` backend (torch's int4 CPU kernel; see :mod:`anyquant.runtime.fastcpu`)."""
    from anyquant.runtime.fastcpu import fast_cpu_capable

    ok, reason = fast_cpu_capable()
    return BackendInfo(
        "cpu-fast",
        ok,
        reason,
        description="4-bit layers repacked for torch's int4 CPU kernel (bf16 decode) + on-the-fly "
        "dequantized GEMM for prompts; packed memory; other layers dequantized",
    )


def gptqmodel_backend() -> BackendInfo:
    """The ``gptqmodel`` backend (GPTQModel's CUDA kernels; see :mod:`anyquant_gptq.gptqmodel_kernels`)."""
    try:
        from .gptqmodel_kernels import gptqmodel_backend_info
    except ImportError:  # pragma: no cover - torch missing
        return BackendInfo("gptqmodel", False, "torch is not installed")
    return gptqmodel_backend_info()


def start_layer_plans(loader: Any, ctx: LoadContext, method: str) -> tuple[Any, KernelPlan | None]:
    """The per-layer plan of the chosen backend (``cpu-fast``: a FastCPUPlan; ``gptqmodel``: a
    KernelPlan), kept on ``loader`` for :func:`finish_layer_plans`. Shared by GPTQ and AWQ."""
    from anyquant.runtime.fastcpu import FastCPUPlan

    loader._fast_plan = FastCPUPlan.from_options(ctx.options.extra) if ctx.backend == "cpu-fast" else None
    loader._file_tables = ctx.file_tables
    loader._kernel_plan = None
    if ctx.backend == "gptqmodel":
        from .gptqmodel_kernels import KernelPlan

        loader._kernel_plan = KernelPlan.create(method, ctx.device, ctx.dtype, ctx.options.extra)
    return loader._fast_plan, loader._kernel_plan


def plan_keeps_embedding_dtype(loader: Any) -> bool:
    """Whether the build may keep the embedding 16-bit: cpu-fast's head replaces it (the plan is made by
    :func:`start_layer_plans`, in ``make_linear``, before the build asks)."""
    plan = getattr(loader, "_fast_plan", None)
    return plan is not None and plan.keeps_embedding_dtype()


def plan_file_tables(loader: Any, ctx: LoadContext) -> bool:
    """Whether the build may leave the embedding and a dense head in the file: cpu-fast's head reads them
    from there (see :meth:`anyquant.runtime.fastcpu.FastCPUPlan.file_tables`)."""
    plan = getattr(loader, "_fast_plan", None)
    return plan is not None and ctx.device.type == "cpu" and plan.file_tables()


def finish_layer_plans(loader: Any, loaded: LoadedModel) -> None:
    """After the build: cpu-fast's LM head, and each plan's record in ``loaded.info``."""
    plan = getattr(loader, "_fast_plan", None)
    tables = getattr(loader, "_file_tables", None)
    loader._file_tables = None
    if loaded.backend == "cpu-fast" and plan is not None:
        import torch

        plan.finish(loaded.module, getattr(torch, loaded.dtype), tables=tables)
        loaded.info = {**loaded.info, "cpu_fast": plan.summary()}
    kernels = getattr(loader, "_kernel_plan", None)
    if loaded.backend == "gptqmodel" and kernels is not None:
        loaded.info = {**loaded.info, "gptqmodel": kernels.summary()}


#: load options of GPTQ and AWQ checkpoints' ``gptqmodel`` backend (read in :mod:`anyquant_gptq.gptqmodel_kernels`)
KERNEL_OPTION = "gptqmodel_kernel"
COMPILE_OPTION = "gptqmodel_compile"
#: internal, for tests: run backend "gptqmodel" on the CPU with GPTQModel's torch kernel
CPU_TEST_OPTION = "_gptqmodel_cpu"
GPTQMODEL_OPTIONS: Mapping[str, str] = MappingProxyType(
    {
        KERNEL_OPTION: "backend='gptqmodel': 'auto' (default) or one GPTQModel kernel by name",
        COMPILE_OPTION: "backend='gptqmodel': torch.compile the GPTQModel kernels (default False)",
        CPU_TEST_OPTION: "tests only: backend='gptqmodel' on the CPU, with GPTQModel's torch kernel",
    }
)


#: packed codes are int32, scales float (GPTQ and AWQ alike)
QUANT_DTYPES = {"qweight": frozenset({"I32"}), "qzeros": frozenset({"I32"}), "scales": FLOAT_SCALE_DTYPES}


class GPTQLoader(TransformersLoader):
    format = "gptq"
    backend_order = ("gptqmodel", "cpu-fast", "dequantized", "reference")
    load_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {**RUNTIME_OPTIONS, **CPU_FAST_OPTIONS, **GPTQMODEL_OPTIONS}
    )
    #: the GPTQModel kernels of the last load with backend "gptqmodel"
    _kernel_plan: KernelPlan | None = None
    _extra: Mapping[str, Any] = {}

    def backends(self) -> list[BackendInfo]:
        return [
            gptqmodel_backend(),
            cpu_fast_backend(),
            BackendInfo("dequantized", True, description="dequantize once at load; dense speed and memory"),
            BackendInfo("reference", True, description="pure torch, dequantize on every forward; packed memory"),
        ]

    def validate(self, probe: Probe, detection: Detection) -> None:
        d = detection.details
        fmt = d.get("checkpoint_format", "gptq")
        if detection.variant in ("marlin", "bitblas"):
            raise UnsupportedBackendError(
                f"{probe.root}: GPTQ in the {detection.variant} layout is packed for CUDA kernels only; "
                "anyquant's CPU backends need the plain GPTQ layout (checkpoint_format gptq or gptq_v2). "
                "Re-export it with GPTQModel in format 'gptq', or load it with gptqmodel on a GPU."
            )
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedBackendError(f"{probe.root}: GPTQ checkpoint_format {fmt!r} is not supported on CPU")
        problems = d.get("problems") or []
        if problems:
            raise CheckpointError(f"{probe.root}: the GPTQ tensors are inconsistent: {'; '.join(problems[:3])}")
        require_dtypes(probe, QUANT_DTYPES, "GPTQ")
        if fmt == "gptq" and d.get("sym") is False:
            quantizers = [q.split(":")[0].lower() for q in d.get("quantizer", [])]
            if "gptqmodel" not in quantizers:
                raise CheckpointError(
                    f"{probe.root}: asymmetric GPTQ in the v1 format (zero-1 stored) decodes differently "
                    "depending on the tool that wrote it, and meta.quantizer does not name gptqmodel "
                    f"(it says {d.get('quantizer')!r}). anyquant refuses to guess; re-save it as gptq_v2."
                )

    def choose_backend(self, requested: str, device: Any) -> str:
        if requested == "cpu-fast" and getattr(device, "type", "cpu") != "cpu":
            raise UnsupportedBackendError(f"backend 'cpu-fast' runs on the CPU, not on {device}")
        if requested == "gptqmodel":
            from .gptqmodel_kernels import check_gptqmodel_request

            check_gptqmodel_request(self.format, device, getattr(self, "_extra", {}))
            return requested
        if requested != "auto":
            return super().choose_backend(requested, device)
        if getattr(device, "type", "cpu") == "cuda" and gptqmodel_backend().available:
            return "gptqmodel"
        # measured (docs/benchmarks.md): cpu-fast decodes faster than dense float32 at a quarter of
        # its memory wherever torch's int4 kernel is vectorized (AVX2, AVX512)
        if getattr(device, "type", "cpu") == "cpu" and getattr(self, "_fast_layers", 0) > 0:
            if cpu_fast_backend().available:
                return "cpu-fast"
        return "dequantized" if self._dense_bytes_ok() else "reference"

    def _dense_bytes_ok(self) -> bool:
        budget = getattr(self, "_dense_bytes", 0)
        return budget < DEQUANT_RAM_SHARE * _ram_bytes()

    def load(self, probe: Probe, detection: Detection, options: Any) -> Any:
        from anyquant.runtime.fastcpu import unsupported_reason

        self._extra = options.extra
        self._kernel_plan = None
        sig = read_signature(probe)
        self._dense_bytes = sum(m.in_features * m.out_features * 4 for m in sig.modules)
        self._fast_layers = sum(
            1
            for m in sig.modules
            if m.bits == 4
            and unsupported_reason(m.bits, m.in_features, m.out_features, m.in_features // m.groups) is None
        )
        loaded = super().load(probe, detection, options)
        finish_layer_plans(self, loaded)
        return loaded

    def keep_embedding_dtype(self, ctx: LoadContext) -> bool:
        return plan_keeps_embedding_dtype(self)

    def file_tables(self, ctx: LoadContext) -> bool:
        return plan_file_tables(self, ctx)

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .dequant import gptq_zero_label_check
        from .qlinear import GPTQLinear

        plan, kernels = start_layer_plans(self, ctx, "gptq")

        sig = {m.name: m for m in read_signature(ctx.probe).modules}
        d = ctx.detection.details
        declared = d.get("checkpoint_format", "gptq")
        checked: dict[str, str] = {}

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            m = sig.get(name)
            if m is None:
                return None  # dense (lm_head, skipped modules): filled from the checkpoint's .weight
            if (m.in_features, m.out_features) != (linear.in_features, linear.out_features):
                raise CheckpointError(
                    f"{name}: GPTQ tensors are {m.in_features}x{m.out_features}, the model expects "
                    f"{linear.in_features}x{linear.out_features}"
                )
            src = ctx.source
            qzeros = src.get(f"{name}.qzeros")
            fmt = declared
            if d.get("sym", True) is not False and "label" not in checked:
                shown = gptq_zero_label_check(qzeros, m.bits, declared, out_features=m.out_features)
                checked["label"] = shown or declared
                if shown is not None:
                    log.warning(
                        "%s: checkpoint_format says %r but the qzeros show %r; the tensors decide",
                        ctx.probe.root,
                        declared,
                        shown,
                    )
            fmt = checked.get("label", declared)
            bias = src.get(f"{name}.bias") if m.has_bias else None
            if kernels is not None:
                return _gptqmodel_layer(kernels, name, m, src, qzeros, bias, fmt, d)
            layer = GPTQLinear(
                src.get(f"{name}.qweight"),
                qzeros,
                src.get(f"{name}.scales"),
                src.get(f"{name}.g_idx"),
                bias,
                bits=m.bits,
                in_features=m.in_features,
                out_features=m.out_features,
                checkpoint_format=fmt,
                sym=d.get("sym"),
                mode="dequantized" if ctx.backend == "dequantized" else "reference",
                compute_dtype=ctx.dtype,
            )
            return layer if plan is None else plan.convert(name, layer)

        return factory

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        sig = read_signature(probe)
        rows = []
        covered = set()
        for m in sig.modules:
            names = [f"{m.name}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx", "bias")]
            nbytes = sum(probe.tensors[n].nbytes for n in names if n in probe.tensors)
            covered.add(m.name)
            rows.append(
                ModuleInfo(m.name, "gptq", (m.out_features, m.in_features), float(m.bits), m.group_size, nbytes)
            )
        return rows + dense_rows(probe, skip=covered)


def _gptqmodel_layer(
    kernels: Any, name: str, m: Any, src: Any, qzeros: Any, bias: Any, fmt: str, details: Mapping[str, Any]
) -> nn.Module:
    """One GPTQ layer on a GPTQModel kernel (zeros, sym and desc_act decided by the tensors)."""
    from .gptqmodel_kernels import gptq_kernel_tensors

    gs = details.get("group_size")
    t = gptq_kernel_tensors(
        qzeros,
        src.get(f"{name}.g_idx"),
        bits=m.bits,
        in_features=m.in_features,
        out_features=m.out_features,
        groups=m.groups,
        checkpoint_format=fmt,
        sym=details.get("sym"),
        group_size=gs if isinstance(gs, int) else None,
    )
    tensors = {
        "qweight": src.get(f"{name}.qweight"),
        "scales": src.get(f"{name}.scales"),
        "g_idx": t["g_idx"],
        "qzeros_v2": t["qzeros_v2"],
        "qzeros_v1": t["qzeros_v1"],
    }
    layer: nn.Module = kernels.build(
        name,
        tensors,
        bias,
        bits=m.bits,
        group_size=t["group_size"],
        sym=t["sym"],
        desc_act=t["desc_act"],
        in_features=m.in_features,
        out_features=m.out_features,
    )
    return layer
