"""The EXL2 (exllamav2) loader: exllamav2 is archived and CUDA-only; this reads its checkpoints on any torch device,
with EXL3's linear factory (a fast backend gets each linear decoded once at load, as EXL3's are)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from anyquant.plugin import BackendInfo, CheckpointError, Detection, ModuleInfo, Probe, dense_rows, tensors_by_module
from anyquant_runtime import (
    FLOAT_SCALE_DTYPES,
    RUNTIME_OPTIONS,
    LoadContext,
    require_dtypes,
)
from anyquant_runtime.layouts import Decoded, Int8Blocks, Layout

from ..loader import PartsLinears

if TYPE_CHECKING:
    from torch import nn

    from anyquant_runtime.qlinear import QuantLinearBase

__all__ = ["EXL2Loader"]


class EXL2Loader(PartsLinears):
    """EXL2 on CPU: exllamav2 is archived and CUDA-only; this is a maintained way to read it."""

    format = "exl2"
    backend_order = ("dequantized", "reference")
    format_options: ClassVar[Mapping[str, str]] = RUNTIME_OPTIONS
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = (Int8Blocks, Decoded)
    SUFFIXES = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "q_perm")

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        """Per linear, from the headers: logical shape ``(out, in)`` (``q_weight``'s columns, the permutation's
        length), average bits per weight from ``q_weight``'s 32-bit rows, and every byte of the module."""
        groups = tensors_by_module(probe)
        rows = []
        for prefix, ts in sorted(groups.items()):
            by = {t.name.rpartition(".")[2]: t for t in ts}
            qw = by.get("q_weight")
            if qw is None or len(qw.shape) != 2:
                continue
            perm = by.get("q_invperm") or by.get("q_perm")
            inn = perm.shape[0] if perm is not None and perm.shape else None
            shape = (qw.shape[1], inn) if inn else (qw.shape[1],)
            bits = round(32 * qw.shape[0] / inn, 3) if inn else None
            rows.append(ModuleInfo(prefix, "exl2", shape, bits, None, sum(t.nbytes for t in ts)))
        return rows + dense_rows(probe, skip={r.name for r in rows}, groups=groups)

    def validate(self, probe: Probe, detection: Detection) -> None:
        ints = frozenset({"I16", "I32", "I64"})
        require_dtypes(
            probe,
            {
                "q_weight": frozenset({"I32"}),
                "q_scale": frozenset({"I32"}),
                "q_scale_max": FLOAT_SCALE_DTYPES,
                "q_groups": ints,
                "q_invperm": ints,
                "q_perm": ints,
            },
            "EXL2",
        )
        for prefix in probe.modules_with("q_weight"):
            if f"{prefix}.q_invperm" not in probe.tensors and f"{prefix}.q_perm" not in probe.tensors:
                raise CheckpointError(
                    f"{probe.root}: EXL2 module {prefix!r} has no q_invperm (or q_perm); exllamav2 writes one for "
                    "every layer, and without it the rows' order is unknown"
                )

    def own_backends(self) -> list[BackendInfo]:
        return [
            BackendInfo("dequantized", True, description="decode once at load (pure torch); dense speed and memory"),
            BackendInfo("reference", True, description="pure torch, decode on every forward; packed memory"),
        ]

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .qlinear import EXL2Linear

        src = ctx.source
        stored: dict[str, Any] = {p: {} for p in ctx.probe.modules_with("q_weight")}

        def one(name: str, in_features: int, out_features: int) -> QuantLinearBase:
            tensors = {s: src.get(f"{name}.{s}") for s in self.SUFFIXES if f"{name}.{s}" in src}
            bias = src.get(f"{name}.bias") if f"{name}.bias" in src else None
            return EXL2Linear(
                tensors,
                bias,
                in_features=in_features,
                out_features=out_features,
                mode="dequantized" if ctx.backend == "dequantized" else "reference",
                compute_dtype=ctx.dtype,
            )

        return self.linear_factory(ctx, stored, one)  # a fused projection may be stored split
