"""Process memory helpers (standard library only)."""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any


@functools.cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (musl has no malloc_trim)
    except (OSError, AttributeError):
        return None
    return libc


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the operating system (glibc's ``malloc_trim(0)``).

    A load builds and drops many small objects (safetensors headers, skeleton modules, repacking
    temporaries); glibc keeps their freed pages, so they stay in the process's RSS although nothing
    uses them: 46 MiB after loading SmolLM2-135M GPTQ. Trimming takes ~3 ms and changes nothing else.
    Returns whether it ran (glibc on Linux only).
    """
    libc = _libc()
    if libc is None:
        return False
    try:
        libc.malloc_trim(0)
    except OSError:  # pragma: no cover - defensive
        return False
    return True
