"""anyquant-runtime's plugin: the ``gptqmodel`` backend (GPTQModel's CUDA kernels for the int4 group layouts GPTQ and
AWQ share, run by the runtime's int4 loader base). The ``dense`` format is core's (its loader is this package's
``dense.DenseLoader``, named by core's FormatSpec)."""

from __future__ import annotations

from collections.abc import Callable

from anyquant.plugin import BackendSpec, hookimpl

__all__ = ["anyquant_register_backends"]


@hookimpl
def anyquant_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(
        BackendSpec(
            name="gptqmodel",
            description="GPTQModel's CUDA kernels (GPTQ; AWQ's GEMM layout)",
            devices=("cuda",),
            layouts=("int4-groups",),
            status="anyquant_runtime.int4.loader:gptqmodel_status",
        )
    )
