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
    "read_checkpoint_json": "probe",
    "require_inside": "probe",
    "resolve_checkpoint": "probe",
    "with_revision": "probe",
    "looks_dense": "builtin",
    # the contract's types
    "Claim": "protocols",
    "Detection": "protocols",
    "FormatSpec": "protocols",
    "BackendInfo": "protocols",
    "BackendSpec": "protocols",
    "LAYOUT_KINDS": "protocols",
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
    "undeclared_options": "protocols",
    # a generator's results
    "TokenLogprob": "results",
    "GenerationResult": "results",
    "StreamChunk": "results",
    "Usage": "results",
    "Timings": "results",
    "Cap": "results",
    "collect": "results",
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
    "EXACT_BACKENDS": "backends",
    # the registry: the loaded plugins' objects (a tool that runs a format's quantizer or inspect)
    "import_object": "registry",
    "load_spec_object": "registry",
    "strict_plugins": "registry",
    "report_of": "api",
    # a command's shared flags (a plugin's ``anyquant_register_commands``: the load flags, ``-o KEY=VALUE``)
    "add_load_flags": "console",
    "add_option_flag": "console",
    "options_from": "console",
    # a command's output: JSON lines, progress, the --json flag's help
    "JSON_HELP": "console",
    "emit": "console",
    "json_line": "console",
    "on_off": "console",
    "progress_bar": "console",
    # inspect rows
    # a decoder's shape from its config
    "model_shape": "shape",
    "SizingError": "shape",
    "ModelShape": "shape",
    "bits_per_weight": "report",
    "dense_rows": "report",
    "tensors_by_module": "report",
    # header tables, and the bounded GGUF header parser (a reader built on it parses each file once)
    "GGUF_TYPE_SIZES": "headers",
    "GGUFHeader": "headers",
    "GGUFSkippedArray": "headers",
    "GGUFTensorInfo": "headers",
    "read_gguf_header": "headers",
    "loads_json": "headers",
    "release_free_heap": "_memory",
    "SAFETENSORS_DTYPE_BITS": "headers",
    "TensorInfo": "headers",
}

__all__ = [  # a literal, sorted list (type checkers read it; core/tests/test_imports.py pins it)
    "AnyquantError",
    "BackendInfo",
    "BackendSpec",
    "CalibrationRegistrar",
    "Cap",
    "CheckpointError",
    "Claim",
    "CommandRegistrar",
    "ConfigError",
    "Detection",
    "EXACT_BACKENDS",
    "FormatConflictError",
    "FormatSpec",
    "GGUFHeader",
    "GGUFSkippedArray",
    "GGUFTensorInfo",
    "GGUF_TYPE_SIZES",
    "GenerationParams",
    "GenerationResult",
    "Generator",
    "JSON_HELP",
    "LAYOUT_KINDS",
    "LoadOptions",
    "LoadedModel",
    "Loader",
    "MIN_TEMPERATURE",
    "MissingDependencyError",
    "MissingTensorError",
    "ModelClosedError",
    "ModelShape",
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
    "StreamChunk",
    "TOKENIZER_FILES",
    "TensorInfo",
    "Timings",
    "TokenLogprob",
    "UnsupportedBackendError",
    "UnsupportedFormatError",
    "Usage",
    "__version__",
    "add_load_flags",
    "add_option_flag",
    "bits_per_weight",
    "choose_backend",
    "collect",
    "dense_rows",
    "display_name",
    "emit",
    "hookimpl",
    "import_object",
    "json_line",
    "load_spec_object",
    "loads_json",
    "looks_dense",
    "model_shape",
    "on_off",
    "options_from",
    "parse_model_id",
    "progress_bar",
    "read_checkpoint_json",
    "read_gguf_header",
    "release_free_heap",
    "report_of",
    "require_inside",
    "resolve_checkpoint",
    "strict_plugins",
    "tensors_by_module",
    "thaw",
    "undeclared_options",
    "with_revision",
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
    from .api import report_of
    from .backends import EXACT_BACKENDS, choose_backend
    from .builtin import looks_dense
    from .console import JSON_HELP, add_load_flags, add_option_flag, emit, json_line, on_off, options_from, progress_bar
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
        loads_json,
        read_gguf_header,
    )
    from .hookspecs import CalibrationRegistrar, CommandRegistrar, hookimpl
    from .params import MIN_TEMPERATURE
    from .probe import (
        TOKENIZER_FILES,
        Probe,
        display_name,
        parse_model_id,
        read_checkpoint_json,
        require_inside,
        resolve_checkpoint,
        thaw,
        with_revision,
    )
    from .protocols import (
        LAYOUT_KINDS,
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
        undeclared_options,
    )
    from .registry import import_object, load_spec_object, strict_plugins
    from .report import bits_per_weight, dense_rows, tensors_by_module
    from .results import Cap, GenerationResult, StreamChunk, Timings, TokenLogprob, Usage, collect
    from .shape import ModelShape, SizingError, model_shape
