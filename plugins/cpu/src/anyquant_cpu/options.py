"""The ``cpu-fast`` backend's load options, as it registers them (:attr:`~anyquant.protocols.BackendSpec.options`):
``anyquant.load`` accepts them for every format whose layers offer a layout the backend runs, and
:meth:`anyquant_cpu.engine.FastCPUPlan.from_options` reads them. Importing this module imports neither torch nor
the engine."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["OPTIONS", "OPTION_LAYOUTS"]

OPTIONS: Mapping[str, str] = MappingProxyType(
    {
        "cpu_fast_prefill": "'auto' (default: prompts through a bfloat16 GEMM where the CPU has AMX or AVX512-BF16, "
        "else float32), 'float32' (the exact weights in float32), 'bfloat16' or 'float16'",
        "cpu_fast_small_rows": "rows up to which the decode kernels run (default 64; a mixture's experts 4, or 48 where "
        "prompts run bfloat16 GEMMs)",
        "cpu_fast_head": "'auto' (default: a Q8_0 copy on the compiled kernel where built, else a bfloat16 one "
        "prepacked for oneDNN where it runs fast), 'q8_0', 'bfloat16' or 'dense'; the top 64 logits exact",
        "cpu_fast_tables": "'file' (default: embedding and exact head read from the checkpoint) or 'memory'",
        "cpu_fast_kernel": "'auto' (default: 'gq4' where the compiled block kernel is built and vectorized, else "
        "'torch'), 'gq4' (GPTQ/AWQ 4-bit on the compiled block kernel) or 'torch' (torch's int4 kernel)",
        "cpu_fast_interleave": "True (default: block-kernel weights copied at load into the kernel's interleaved "
        "form) or False (GGUF blocks read in place from the file)",
        "cpu_fast_kv_cache": "'float32' (default: the compute dtype), 'float16' or 'bfloat16' (half the native "
        "decoder's KV cache; decode at long contexts slower)",
        "cpu_fast_weights": "the form of a decoded weight its format lets be rounded again: 'auto' (default: Q8_0 "
        "blocks on the compiled block kernel where it is built and vectorized, else bfloat16), 'q8_0' (re-quantized "
        "per block of 32, 1.06 bytes per weight; refused where the kernel does not run) or 'bfloat16' (prepacked "
        "for oneDNN, 2 bytes)",
        "cpu_fast_activation_passes": "2 (default) or 1: int8 passes over the activations of the compiled "
        "GGUF-block kernel (1: llama.cpp's int8 arithmetic, faster, may flip near-tied greedy tokens)",
    }
)

#: the options that concern only some layouts (accepted where a format offers one of them)
OPTION_LAYOUTS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "cpu_fast_weights": ("int8-blocks",),
        "cpu_fast_activation_passes": ("gguf-blocks",),
    }
)
