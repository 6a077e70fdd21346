"""The plugin API: everything a format plugin may import from anyquant's core, in one place.

    from anyquant.plugin import Claim, FormatSpec, Probe, hookimpl

A plugin imports from here, from :mod:`anyquant.int4` (the shared int4 loader base), from the runtime's
modules (``anyquant.runtime.*``) and from :mod:`anyquant.testing`; nothing else of core (the tool modules
``sizing``, ``calibration``, ``evaluate``, ``cli`` ... are not an API and may change). A plugin that is an
application of anyquant rather than a format (anyquant-serve, the server) may also use the top-level public API
(``anyquant.load``, ``anyquant.detect``), as any app does; what it needs of core beyond that is here too (a
command's shared flags, the vLLM command plan, ``TokenLogprob``, ``MIN_TEMPERATURE``). What is here is kept
stable. Names are imported lazily, as in :mod:`anyquant`: importing this module imports neither torch nor
any tool module, and a name costs only its own module. Each name is the object of its home module.
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
    # loaders: the transformers-skeleton base and its option declarations
    "TransformersLoader": "loaders",
    "LoadContext": "loaders",
    "LoadPlan": "loaders",
    "require_dtypes": "loaders",
    "CPU_FAST_OPTIONS": "loaders",
    "FLOAT_SCALE_DTYPES": "loaders",
    "RUNTIME_OPTIONS": "loaders",
    # a command's shared flags (a plugin's ``anyquant_register_commands``: the load flags, ``-o KEY=VALUE``)
    "add_load_flags": "console",
    "add_option_flag": "console",
    "options_from": "console",
    # the vLLM command line a detected checkpoint implies (``advise`` writes it, anyquant-serve's --engine vllm runs it)
    "VllmPlan": "tools.engines",
    "vllm_plan": "tools.engines",
    # inspect rows
    "dense_rows": "tools.report",
    "tensors_by_module": "tools.report",
    # header tables, and the bounded GGUF header parser (a reader built on it parses each file once)
    "GGUF_TYPE_SIZES": "headers",
    "GGUFHeader": "headers",
    "GGUFSkippedArray": "headers",
    "GGUFTensorInfo": "headers",
    "read_gguf_header": "headers",
    "release_free_heap": "_memory",
    "SAFETENSORS_DTYPE_BITS": "headers",
    "TensorInfo": "headers",
    # quantizers: calibration, backend routing, worker subprocesses
    "calibration_texts": "tools.quantize",
    "calibration_batch": "tools.quantize",
    "route_backend": "tools.quantize",
    "run_worker": "tools.quantize",
    "emit_progress": "tools.quantize",
    "emit_result": "tools.quantize",
    "watch_parent": "tools.quantize",
    # a decoder's shape from its config
    "model_shape": "tools.estimate",
    "SizingError": "tools.estimate",
}

__all__ = [  # a literal, sorted list (type checkers read it; core/tests/test_imports.py pins it)
    "AnyquantError",
    "BackendInfo",
    "BackendSpec",
    "CPU_FAST_OPTIONS",
    "CalibrationRegistrar",
    "CheckpointError",
    "Claim",
    "CommandRegistrar",
    "ConfigError",
    "Detection",
    "FLOAT_SCALE_DTYPES",
    "FormatConflictError",
    "FormatSpec",
    "GGUFHeader",
    "GGUFSkippedArray",
    "GGUFTensorInfo",
    "GGUF_TYPE_SIZES",
    "GenerationParams",
    "Generator",
    "LoadContext",
    "LoadOptions",
    "LoadPlan",
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
    "RUNTIME_OPTIONS",
    "SAFETENSORS_DTYPE_BITS",
    "SizingError",
    "TOKENIZER_FILES",
    "TensorInfo",
    "TokenLogprob",
    "TransformersLoader",
    "UnsupportedBackendError",
    "UnsupportedFormatError",
    "VllmPlan",
    "__version__",
    "add_load_flags",
    "add_option_flag",
    "calibration_batch",
    "calibration_texts",
    "choose_backend",
    "dense_rows",
    "display_name",
    "emit_progress",
    "emit_result",
    "hookimpl",
    "model_shape",
    "options_from",
    "parse_model_id",
    "read_gguf_header",
    "release_free_heap",
    "require_dtypes",
    "route_backend",
    "run_worker",
    "tensors_by_module",
    "thaw",
    "vllm_plan",
    "watch_parent",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'anyquant.plugin' has no attribute {name!r}")
    # looked up in its home module each time, never copied here: a test that patches the home module
    # (``anyquant.tools.quantize.run_worker``) patches what plugins get from here too
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
    from .loaders import (
        CPU_FAST_OPTIONS,
        FLOAT_SCALE_DTYPES,
        RUNTIME_OPTIONS,
        LoadContext,
        LoadPlan,
        TransformersLoader,
        require_dtypes,
    )
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
    from .results import TokenLogprob
    from .tools.engines import VllmPlan, vllm_plan
    from .tools.estimate import SizingError, model_shape
    from .tools.quantize import (
        calibration_batch,
        calibration_texts,
        emit_progress,
        emit_result,
        route_backend,
        run_worker,
        watch_parent,
    )
    from .tools.report import dense_rows, tensors_by_module
