"""The CPU engine as the runtime sees it: the module the registered ``cpu-fast`` backend names
(:attr:`~anyquant.protocols.BackendSpec.engine`: anyquant-cpu's :mod:`anyquant_cpu.backend`: the fast CPU
linears, the compiled decode step; the kernel built at install), and what every caller does without it. The
runtime, the int4 loader and the format plugins ask here; where no plugin registers ``cpu-fast`` (anyquant-cpu not
installed, or disabled with ``ANYQUANT_DISABLE_PLUGINS=anyquant-cpu``) ``cpu-fast`` is unavailable with
:data:`MISSING` as the reason and every format loads and generates on its exact backends."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from anyquant.errors import MissingDependencyError
from anyquant.protocols import LAYOUT_KINDS, BackendSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .layouts import Layout

__all__ = [
    "MISSING",
    "NOT_INSTALLED",
    "block_kernel_is_fast",
    "decode_step",
    "engine",
    "engine_of",
    "fast_cpu_capable",
    "fast_module",
    "fast_reasons",
    "kv_cache_dtype",
    "layout_kinds_run",
    "layouts_run",
    "require",
    "require_engine",
]

#: the reason ``cpu-fast`` gives where the engine is not installed
MISSING = "the CPU engine is not installed (pip install anyquant-cpu; in the repository, make install) or is disabled"
#: ``cpu-fast`` as the loaders offer it where no plugin registers it (anyquant-cpu not installed, or disabled): listed,
#: never available, saying what to install (it runs every layout but EXL3's trellis, as anyquant-cpu registers it)
NOT_INSTALLED = BackendSpec(
    "cpu-fast",
    "anyquant's CPU engine (anyquant-cpu)",
    devices=("cpu",),
    layouts=tuple(k for k in LAYOUT_KINDS if k != "exl3-trellis"),
)


@functools.cache
def engine_of(backend: str) -> ModuleType | None:
    """The engine module of registered backend ``backend`` (imported once per process); ``None`` where no plugin
    registers that backend with an engine. An engine offers ``plan(options)`` (one load's plan: ``convert``,
    ``finish``, ``summary``, ``kv_cache_dtype``, ``keeps_embedding_dtype``, ``file_tables``), ``layouts_run`` and
    ``layout_kinds_run``, as :mod:`anyquant_cpu.backend` does."""
    from anyquant.api import default_registry

    spec = default_registry().backends().get(backend)
    if spec is None or spec.engine is None:
        return None
    return importlib.import_module(spec.engine)


def require_engine(backend: str) -> ModuleType:
    """:func:`engine_of`, or :class:`~anyquant.errors.MissingDependencyError` saying what to install."""
    found = engine_of(backend)
    if found is None:
        raise MissingDependencyError(MISSING if backend == "cpu-fast" else f"backend {backend!r} has no engine here")
    return found


def engine() -> ModuleType | None:
    """The ``cpu-fast`` backend's engine module; ``None`` where no plugin registers one."""
    return engine_of("cpu-fast")


def require() -> ModuleType:
    """:func:`engine`, or :class:`~anyquant.errors.MissingDependencyError` saying what to install."""
    return require_engine("cpu-fast")


def fast_cpu_capable() -> tuple[bool, str]:
    """Whether torch's int4 CPU kernel runs here (the engine's check); ``(False, MISSING)`` without the engine."""
    found = engine()
    return (False, MISSING) if found is None else found.fast_cpu_capable()


def layouts_run(layers: Iterable[Sequence[Layout] | str]) -> int:
    """How many of ``layers`` (each its offered layouts, or why it offers none) the engine would convert here: what
    ``auto`` counts before anything is read; 0 without the engine."""
    found = engine()
    return 0 if found is None else int(found.layouts_run(layers))


def layout_kinds_run(*kinds: type[Layout]) -> tuple[bool, str]:
    """Whether the kernel of one of ``kinds`` runs here, with why not; ``(False, MISSING)`` without the engine."""
    found = engine()
    return (False, MISSING) if found is None else found.layout_kinds_run(*kinds)


def block_kernel_is_fast() -> bool:
    """Whether the engine's compiled block kernel loads here with a vector path; ``False`` without the engine."""
    found = engine()
    return found is not None and bool(found.block_kernel_is_fast())


def kv_cache_dtype(extra: Mapping[str, Any], compute_dtype: torch.dtype) -> torch.dtype | None:
    """The KV cache dtype cpu-fast's options ask for (checked before anything is read)."""
    return require().kv_cache_dtype(extra, compute_dtype)  # type: ignore[no-any-return]


def fast_module(layer: nn.Module, *, small_rows: int | None, prefill_dtype: torch.dtype | None) -> nn.Module | str:
    """``layer`` (a format's reference linear) as the engine runs it, or why it cannot."""
    found = engine()
    if found is None:
        return MISSING
    rows = found.DEFAULT_SMALL_ROWS if small_rows is None else small_rows
    return found.fast_cpu_module(layer, small_rows=rows, prefill_dtype=prefill_dtype)  # type: ignore[no-any-return]


def fast_reasons(layer: nn.Module) -> str | None:
    """Why the engine cannot run ``layer`` here (``None`` when it can)."""
    found = engine()
    return MISSING if found is None else found.fast_cpu_reasons(layer)


def decode_step(model: nn.Module) -> Any:
    """The native decoder's compiled decode step (:class:`anyquant_cpu.step.DecodeStep`) for ``model``, or ``None``
    (no engine, or nothing in ``model`` it compiles)."""
    found = engine()
    if found is None:
        return None
    return found.decode_step(model)
