"""The plugin API: everything a format plugin may import from anyquant's core, in one place.

    from .plugin import Claim, FormatSpec, Probe, hookimpl

This is the contract: hooks, detection, the contract's types and errors, backend choice, header tables, a command's
shared flags, inspect's rows. A format plugin that loads through torch also imports the runtime's declared API
(:mod:`anyquant_runtime`, the anyquant-runtime distribution: the loader base ``TransformersLoader``, reference
linears, the native decoder ...), and one that quantizes imports the tools' (:mod:`anyquant_tools`, anyquant-tools:
calibration texts, the worker protocol); tests use :mod:`anyquant.testing`. Nothing else of core is an API (``cli``,
``console`` internals ... may change). An application of anyquant (anyquant-serve) also uses the top-level public API
(``anyquant.load``, ``anyquant.detect``), as any app does. What is here is kept stable. Names are imported lazily,
as in :mod:`anyquant`: importing this module imports neither torch nor any other distribution, and a name costs only
its own module. Each name is the object of its home module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import __version__

_EXPORTS: dict[str, str] = {
    # the hooks
    "hookimpl": "hookspecs",
    "CalibrationRegistrar": "hookspecs",
    "CommandRegistrar": "hookspecs",
    # detection
    "Probe": "probe",
    "TOKENIZER_FILES": "probe",
    "display_name": "probe",
    "thaw": "probe",
    "parse_model_id": "probe",
    # the contract's types
    "Claim": "protocols",
    "Detection": "protocols",
    "FormatSpec": "protocols",
    "BackendInfo": "protocols",
    "BackendSpec": "protocols",
    "ModuleInfo": "protocols",
    "LoadOptions": "protocols",
    "QuantizeSpec": "protocols",
    "QuantizeFlag": "protocols",
    "GenerationParams": "protocols",
    "Prompt": "protocols",
    "LoadedModel": "protocols",
    "Loader": "protocols",
    "Quantizer": "protocols",
    "Generator": "protocols",
    "MIN_TEMPERATURE": "params",
    "TokenLogprob": "results",
    # errors
    "AnyquantError": "errors",
    "CheckpointError": "errors",
    "ConfigError": "errors",
    "MissingDependencyError": "errors",
    "MissingTensorError": "errors",
    "NumericalError": "errors",
    "ModelClosedError": "errors",
    "ParameterError": "errors",
    "PickleRefusedError": "errors",
    "QuantizeError": "errors",
    "UnsupportedBackendError": "errors",
    "UnsupportedFormatError": "errors",
    "FormatConflictError": "errors",
    # backends: the one choice among a format's backends
    "choose_backend": "backends",
    # a command's shared flags (a plugin's ``anyquant_register_commands``: the load flags, ``-o KEY=VALUE``)
    "add_load_flags": "console",
    "add_option_flag": "console",
    "options_from": "console",
    # inspect rows
    # a decoder's shape from its config
    "model_shape": "shape",
    "SizingError": "shape",
    "dense_rows": "report",
    "tensors_by_module": "report",
    # header tables, and the bounded GGUF header parser (a reader built on it parses each file once)
    "GGUF_TYPE_SIZES": "headers",
    "GGUFHeader": "headers",
    "GGUFSkippedArray": "headers",
    "GGUFTensorInfo": "headers",
    "read_gguf_header": "headers",
    "release_free_heap": "_memory",
    "SAFETENSORS_DTYPE_BITS": "headers",
    "TensorInfo": "headers",
}

__all__ = [  # a literal, sorted list (type checkers read it; core/tests/test_imports.py pins it)
    "AnyquantError",
    "BackendInfo",
    "BackendSpec",
    "CalibrationRegistrar",
    "CheckpointError",
    "Claim",
    "CommandRegistrar",
    "ConfigError",
    "Detection",
    "FormatConflictError",
    "FormatSpec",
    "GGUFHeader",
    "GGUFSkippedArray",
    "GGUFTensorInfo",
    "GGUF_TYPE_SIZES",
    "GenerationParams",
    "Generator",
    "LoadOptions",
    "LoadedModel",
    "Loader",
    "MIN_TEMPERATURE",
    "MissingDependencyError",
    "MissingTensorError",
    "ModelClosedError",
    "ModuleInfo",
    "NumericalError",
    "ParameterError",
    "PickleRefusedError",
    "Probe",
    "Prompt",
    "QuantizeError",
    "QuantizeFlag",
    "QuantizeSpec",
    "Quantizer",
    "SAFETENSORS_DTYPE_BITS",
    "SizingError",
    "TOKENIZER_FILES",
    "TensorInfo",
    "TokenLogprob",
    "UnsupportedBackendError",
    "UnsupportedFormatError",
    "__version__",
    "add_load_flags",
    "add_option_flag",
    "choose_backend",
    "dense_rows",
    "display_name",
    "hookimpl",
    "model_shape",
    "options_from",
    "parse_model_id",
    "read_gguf_header",
    "release_free_heap",
    "tensors_by_module",
    "thaw",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'anyquant.plugin' has no attribute {name!r}")
    # looked up in its home module each time, never copied here: a test that patches the home module
    # (``anyquant.probe.thaw``) patches what plugins get from here too
    return getattr(importlib.import_module(f"anyquant.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from ._memory import release_free_heap
    from .backends import choose_backend
    from .console import add_load_flags, add_option_flag, options_from
    from .errors import (
        AnyquantError,
        CheckpointError,
        ConfigError,
        FormatConflictError,
        MissingDependencyError,
        MissingTensorError,
        ModelClosedError,
        NumericalError,
        ParameterError,
        PickleRefusedError,
        QuantizeError,
        UnsupportedBackendError,
        UnsupportedFormatError,
    )
    from .headers import (
        GGUF_TYPE_SIZES,
        SAFETENSORS_DTYPE_BITS,
        GGUFHeader,
        GGUFSkippedArray,
        GGUFTensorInfo,
        TensorInfo,
        read_gguf_header,
    )
    from .hookspecs import CalibrationRegistrar, CommandRegistrar, hookimpl
    from .params import MIN_TEMPERATURE
    from .probe import TOKENIZER_FILES, Probe, display_name, parse_model_id, thaw
    from .protocols import (
        BackendInfo,
        BackendSpec,
        Claim,
        Detection,
        FormatSpec,
        GenerationParams,
        Generator,
        LoadedModel,
        Loader,
        LoadOptions,
        ModuleInfo,
        Prompt,
        QuantizeFlag,
        Quantizer,
        QuantizeSpec,
    )
    from .report import dense_rows, tensors_by_module
    from .results import TokenLogprob
    from .shape import SizingError, model_shape
