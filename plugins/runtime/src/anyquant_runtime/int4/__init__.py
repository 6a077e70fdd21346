"""What the int4 group-quantized formats share (GPTQ, AWQ: packed int32 codes, a float scale and a zero
point per group): the loader base :class:`anyquant_runtime.int4.loader.Int4Loader` with its backends (GPTQModel's
CUDA kernels, ``cpu-fast``, ``dequantized``, ``reference``), GPTQModel's kernels
(:mod:`anyquant_runtime.int4.gptqmodel_kernels`) and GPTQModel's quantizer (:mod:`anyquant_tools.gptqmodel_quantizer`,
run in :mod:`anyquant_tools.gptqmodel_worker`).

Not imported by ``import anyquant``; importing this package or its ``loader`` imports neither torch nor
GPTQModel. This module holds the ``gptqmodel`` backend's option names, read by the loader and the kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["COMPILE_OPTION", "CPU_TEST_OPTION", "GPTQMODEL_OPTIONS", "KERNEL_OPTION"]

#: load options of the ``gptqmodel`` backend (read in :mod:`anyquant_runtime.int4.gptqmodel_kernels`)
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
