"""Option declarations that a loader or quantizer shares with its backend or worker module, kept here so that
each imports them without importing the other (``exllamav3_kernels`` read the loader's ``EXLLAMAV3_OPTIONS`` and
the loader imports ``exllamav3_kernels``; ``exllamav3_convert`` read ``quantize.embed_bits`` and the quantizer
imports ``exllamav3_convert``: two import circles)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from anyquant.plugin import QuantizeError, QuantizeSpec

__all__ = ["EXLLAMAV3_OPTIONS", "embed_bits"]

#: the ``exllamav3`` backend's load options (read in :mod:`anyquant_exl3.exllamav3_kernels`)
EXLLAMAV3_OPTIONS: Mapping[str, str] = MappingProxyType(
    {
        "tensor_parallel": "exllamav3's tensor-parallel load over every visible GPU (2 or more; default False)",
        "tp_backend": "with tensor_parallel: exllamav3's tp_backend, passed through",
        "autosplit": "split the layers over the visible GPUs (exllamav3's autosplit loader)",
        "cache_tokens": "KV-cache size in tokens, shared by the jobs of a batch (default 8192)",
        "max_chunk_size": "prompt tokens per forward (default 2048)",
        "max_batch_size": "the generator's batch size (default 16)",
    }
)


def embed_bits(spec: QuantizeSpec) -> int:
    """Option ``embed_bits``: 16 (the default: the embedding stays unquantized) or a whole K in 1..8."""
    value = spec.options.get("embed_bits", 16)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value not in (16, *range(1, 9)):
        raise QuantizeError(f"embed_bits must be a whole number of bits in 1..8, or 16 (unquantized), got {value!r}")
    return int(value)
