"""anyquant-cpu's hooks: the ``cpu-fast`` backend (no formats; formats offer it through the layouts it runs)."""

from __future__ import annotations

from collections.abc import Callable

from anyquant.plugin import BackendSpec, hookimpl

from .options import OPTION_LAYOUTS, OPTIONS

__all__ = ["anyquant_register_backends", "status"]


@hookimpl
def anyquant_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(
        BackendSpec(
            name="cpu-fast",
            description="anyquant's CPU engine: packed weights on its compiled kernel or torch's int4 kernel, "
            "other layers as bfloat16 prepacked for oneDNN; the compiled decode step",
            devices=("cpu",),
            layouts=("int4-groups", "affine4-blocks", "int8-blocks", "table4", "e4m3-groups", "gguf-blocks", "decoded"),
            status="anyquant_cpu.plugin:status",
            requires=("anyquant-cpu",),
            engine="anyquant_cpu.backend",
            options=OPTIONS,
            option_layouts=OPTION_LAYOUTS,
        )
    )


def status() -> tuple[bool, str]:
    """``cpu-fast`` here: which of the CPU engine's kernels run (torch's int4 kernel, the compiled kernel, oneDNN's
    prepacked bfloat16); available when one does (each format says which of its layouts it takes)."""
    from . import kernels
    from .engine import bf16_head_status, fast_cpu_capable

    runs: list[str] = []
    missing: list[str] = []
    built = (kernels.available(), kernels.stale() or "not built (reinstall anyquant-cpu)")
    for name, (ok, why) in (
        ("torch's int4 kernel", fast_cpu_capable()),
        ("the compiled kernel", built),
        ("bfloat16 prepacked", bf16_head_status()),
    ):
        (runs if ok else missing).append(name if ok else f"{name}: {why}")
    if not runs:
        return False, "; ".join(missing)
    return True, "runs " + ", ".join(runs) + ("" if not missing else " (not " + "; ".join(missing) + ")")
