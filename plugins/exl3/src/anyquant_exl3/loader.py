"""The EXL3 loader (pure-torch reference decoder on any device) and the EXL2 loader stub."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from anyquant.errors import CheckpointError, UnsupportedBackendError, UnsupportedFormatError
from anyquant.loaders import LoadContext, TransformersLoader
from anyquant.probe import Probe
from anyquant.protocols import BackendInfo, Detection, LoadOptions, ModuleInfo
from anyquant.report import dense_rows

if TYPE_CHECKING:
    from torch import nn

    from anyquant.runtime.loaded import LoadedModel

__all__ = ["EXL2Loader", "EXL3Loader"]

log = logging.getLogger(__name__)

#: the locked codebook multipliers (uint32 viewed as int32 in the marker tensors).
LOCKED_MARKERS = {"mcg": -877912083, "mul1": -2082680531}


def _exllamav3_backend() -> BackendInfo:
    """Cheap availability check (never imports exllamav3: its import JIT-compiles a CUDA extension)."""
    from .cuda_backend import backend_info

    return backend_info()


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


class EXL3Loader(TransformersLoader):
    format = "exl3"
    backend_order = ("exllamav3", "dequantized", "reference")

    def backends(self) -> list[BackendInfo]:
        return [
            _exllamav3_backend(),
            BackendInfo("dequantized", True, description="decode once at load (pure torch); dense speed and memory"),
            BackendInfo("reference", True, description="pure torch, decode on every forward; packed memory"),
        ]

    def choose_backend(self, requested: str, device: Any) -> str:
        on_cuda = getattr(device, "type", "cpu") == "cuda"
        if requested == "auto" and not on_cuda:
            # exllamav3 runs on CUDA only: any other device picks among the pure-torch backends
            available = {b.name for b in self.backends() if b.available}
            for name in self.backend_order:
                if name != "exllamav3" and name in available:
                    return name
        if requested == "exllamav3" and not on_cuda and _exllamav3_backend().available:
            raise UnsupportedBackendError(f"backend 'exllamav3' runs on CUDA GPUs only, not on device {str(device)!r}")
        return super().choose_backend(requested, device)

    def load(self, probe: Probe, detection: Detection, options: LoadOptions) -> LoadedModel:
        """``backend="exllamav3"`` (the ``auto`` choice on a CUDA device when exllamav3 can run) hands the
        checkpoint to exllamav3's kernels and generator (:mod:`anyquant_exl3.cuda_backend`);
        ``tensor_parallel=True`` loads it tensor-parallel over 2+ GPUs there. The other backends build the
        transformers model with :class:`~anyquant_exl3.qlinear.EXL3Linear` layers."""
        from .cuda_backend import check_tensor_parallel

        tensor_parallel = check_tensor_parallel(options)  # typed error before anything heavy
        requested = "exllamav3" if tensor_parallel else options.backend
        if requested in ("auto", "exllamav3"):
            from anyquant.runtime.build import resolve_device

            if self.choose_backend(requested, resolve_device(options.device)) == "exllamav3":
                from .cuda_backend import load_exllamav3

                return load_exllamav3(probe, detection, options, tensor_parallel=tensor_parallel)
        return super().load(probe, detection, options)

    def validate(self, probe: Probe, detection: Detection) -> None:
        problems = detection.details.get("problems") or []
        if problems:
            raise CheckpointError(f"{probe.root}: the EXL3 tensors are inconsistent: {'; '.join(problems[:3])}")
        tables = detection.details.get("tables") or []
        if tables:
            raise UnsupportedFormatError(
                f"{probe.root}: {len(tables)} 2-D trellis tables (exllamav3 1.6 quantized embeddings / n-gram "
                f"tables, e.g. {tables[0]!r}) are recognised but not decoded by anyquant yet"
            )

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .qlinear import EXL3Linear

        modules = _modules(ctx.probe)
        src = ctx.source

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            m = modules.get(name)
            if m is None:
                return None
            if m["in_pad"] < linear.in_features or m["out_pad"] < linear.out_features:
                raise CheckpointError(
                    f"{name}: trellis covers {m['in_pad']}x{m['out_pad']}, smaller than the model's "
                    f"{linear.in_features}x{linear.out_features}"
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
            get = lambda s: src.get(f"{name}.{s}") if f"{name}.{s}" in src else None  # noqa: E731
            return EXL3Linear(
                src.get(f"{name}.trellis"),
                get("suh"),
                get("svh"),
                get("bias"),
                su=get("su") if m["legacy"] else None,
                sv=get("sv") if m["legacy"] else None,
                codebook=m["codebook"],
                in_features=linear.in_features,
                out_features=linear.out_features,
                multiplier=multiplier,
                mode="dequantized" if ctx.backend == "dequantized" else "reference",
                compute_dtype=ctx.dtype,
            )

        return factory

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        modules = _modules(probe)
        rows = [
            ModuleInfo(
                name,
                "exl3",
                (m["out_pad"], m["in_pad"]),
                m["k"],
                None,
                m["nbytes"],
                extra={"codebook": m["codebook"], "padded": True},
            )
            for name, m in modules.items()
        ]
        return rows + dense_rows(probe, skip=set(modules))


class EXL2Loader(TransformersLoader):
    """EXL2 on CPU: exllamav2 is archived and CUDA-only; this is a maintained way to read it."""

    format = "exl2"
    backend_order = ("dequantized", "reference")
    SUFFIXES = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "q_perm")

    def backends(self) -> list[BackendInfo]:
        return [
            BackendInfo("dequantized", True, description="decode once at load (pure torch); dense speed and memory"),
            BackendInfo("reference", True, description="pure torch, decode on every forward; packed memory"),
        ]

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .qlinear import EXL2Linear

        src = ctx.source

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            if f"{name}.q_weight" not in src:
                return None
            tensors = {s: src.get(f"{name}.{s}") for s in self.SUFFIXES if f"{name}.{s}" in src}
            bias = src.get(f"{name}.bias") if f"{name}.bias" in src else None
            return EXL2Linear(
                tensors,
                bias,
                in_features=linear.in_features,
                out_features=linear.out_features,
                mode="dequantized" if ctx.backend == "dequantized" else "reference",
                compute_dtype=ctx.dtype,
            )

        return factory
