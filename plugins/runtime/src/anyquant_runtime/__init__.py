"""anyquant-runtime: the torch runtime the format plugins share, a declared and pinned API.

What a format plugin that loads through torch builds on: the load lifecycle (:class:`TransformersLoader`, its
:class:`LoadContext` and :class:`LoadPlan`, the option declarations), the meta skeleton and module replacement
(:mod:`.build`), the reference linears (:mod:`.qlinear`, :mod:`.layers`), the packed layouts a backend may run
(:mod:`.layouts`, :mod:`.packing`), MoE experts (:mod:`.experts`), checkpoint tensors read on demand
(:mod:`.tensors`, :mod:`.parts`), the native decoder (:mod:`.native`), the generator (:mod:`.generate`), the
tokenizer and chat template (:mod:`.tokenizer`, :mod:`.chat`), the CPU engine's seam (:mod:`.cpu`), the int4
group formats' loader base (:mod:`.int4`), and the ``dense`` format's loader (:mod:`.dense`).

Those modules are the API (plugins pin ``anyquant-runtime`` to a minor version); names with a leading underscore
are not. It builds on the contract (:mod:`anyquant.plugin`) and never imports a format plugin, the CPU engine
(reached through the registry, :mod:`.cpu`), the tools or the server. Importing this package imports neither torch
nor transformers: the names below are imported lazily, each from its home module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "TransformersLoader": "loaders",
    "LoadContext": "loaders",
    "LoadPlan": "loaders",
    "require_dtypes": "loaders",
    "FLOAT_SCALE_DTYPES": "loaders",
    "RUNTIME_OPTIONS": "loaders",
}

__all__ = [  # a literal, sorted list (type checkers read it)
    "FLOAT_SCALE_DTYPES",
    "LoadContext",
    "LoadPlan",
    "RUNTIME_OPTIONS",
    "TransformersLoader",
    "__version__",
    "require_dtypes",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'anyquant_runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"anyquant_runtime.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from .loaders import (
        FLOAT_SCALE_DTYPES,
        RUNTIME_OPTIONS,
        LoadContext,
        LoadPlan,
        TransformersLoader,
        require_dtypes,
    )
