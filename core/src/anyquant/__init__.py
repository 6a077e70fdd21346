"""anyquant: load any quantized LLM checkpoint with the one loader that owns its format.

    import anyquant as sdk
    model = sdk.load("./Llama-3.1-8B-EXL3-4.0bpw")
    print(model.generate("Hello, my name is", max_new_tokens=64))

Nothing happens at import: no plugin discovery, no torch import. Names are imported lazily. The contract is this
package; ``TransformersLoader`` is anyquant-runtime's, and ``quantize``, ``compare``, ``estimate``, ``advise`` ... are
anyquant-tools' (a ``MissingDependencyError`` names the package where it is not installed).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # api
    "detect": "api",
    "load": "api",
    "inspect": "api",
    "list_plugins": "api",
    "default_model": "api",
    "default_registry": "api",
    "quantize": "anyquant_tools.quantize",
    "export_dense": "anyquant_tools.export",
    "perplexity": "anyquant_tools.evaluate",
    "compare": "anyquant_tools.evaluate",
    "EvalResult": "anyquant_tools.evaluate",
    "EvaluationError": "anyquant_tools.evaluate",
    "estimate": "anyquant_tools.estimate",
    "advise": "anyquant_tools.advise",
    "Estimate": "anyquant_tools.estimate",
    "Advice": "anyquant_tools.advise",
    "SizingError": "shape",
    "CalibrationError": "anyquant_tools.calibration",
    "CalibrationOverlapError": "anyquant_tools.calibration",
    # registry and hooks
    "Registry": "registry",
    "PluginInfo": "registry",
    "hookimpl": "hookspecs",
    "hookspec": "hookspecs",
    "Probe": "probe",
    # protocols
    "Claim": "protocols",
    "Detection": "protocols",
    "FormatSpec": "protocols",
    "LoadOptions": "protocols",
    "GenerationParams": "protocols",
    "GenerationKwargs": "protocols",
    "Prompt": "protocols",
    "GenerationResult": "results",
    "StreamChunk": "results",
    "Report": "report",
    "QuantizeSpec": "protocols",
    "BackendInfo": "protocols",
    "BackendSpec": "protocols",
    "ModuleInfo": "protocols",
    "Loader": "protocols",
    "Quantizer": "protocols",
    "Generator": "protocols",
    "TransformersLoader": "anyquant_runtime.loaders",
    "LoadedModel": "protocols",
    # errors
    "AnyquantError": "errors",
    "ProbeError": "errors",
    "HeaderError": "errors",
    "ConfigError": "errors",
    "UnsafePathError": "errors",
    "RevisionNotFoundError": "errors",
    "DownloadError": "errors",
    "CheckpointError": "errors",
    "NumericalError": "errors",
    "InsufficientMemoryError": "errors",
    "MissingTensorError": "errors",
    "ModelClosedError": "errors",
    "ParameterError": "errors",
    "PickleRefusedError": "errors",
    "UnknownFormatError": "errors",
    "AmbiguousFormatError": "errors",
    "FormatMismatchError": "errors",
    "FormatConflictError": "errors",
    "UnsupportedFormatError": "errors",
    "UnsupportedBackendError": "errors",
    "MissingDependencyError": "errors",
    "PluginError": "errors",
    "QuantizeError": "errors",
    "DestinationLockedError": "errors",
}

__all__ = [  # a literal list: type checkers read it (mypy --strict's re-export rule); a test keeps it = _EXPORTS
    "__version__",
    "detect",
    "load",
    "inspect",
    "list_plugins",
    "default_model",
    "default_registry",
    "quantize",
    "export_dense",
    "perplexity",
    "compare",
    "EvalResult",
    "EvaluationError",
    "estimate",
    "advise",
    "Estimate",
    "Advice",
    "SizingError",
    "CalibrationError",
    "CalibrationOverlapError",
    "Registry",
    "PluginInfo",
    "hookimpl",
    "hookspec",
    "Probe",
    "Claim",
    "Detection",
    "FormatSpec",
    "LoadOptions",
    "GenerationParams",
    "GenerationKwargs",
    "Prompt",
    "GenerationResult",
    "StreamChunk",
    "Report",
    "QuantizeSpec",
    "BackendInfo",
    "BackendSpec",
    "ModuleInfo",
    "Loader",
    "Quantizer",
    "Generator",
    "TransformersLoader",
    "LoadedModel",
    "AnyquantError",
    "ProbeError",
    "HeaderError",
    "ConfigError",
    "UnsafePathError",
    "RevisionNotFoundError",
    "DownloadError",
    "CheckpointError",
    "NumericalError",
    "InsufficientMemoryError",
    "MissingTensorError",
    "ModelClosedError",
    "ParameterError",
    "PickleRefusedError",
    "UnknownFormatError",
    "AmbiguousFormatError",
    "FormatMismatchError",
    "FormatConflictError",
    "UnsupportedFormatError",
    "UnsupportedBackendError",
    "MissingDependencyError",
    "PluginError",
    "QuantizeError",
    "DestinationLockedError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'anyquant' has no attribute {name!r}")
    if module.startswith("anyquant_"):  # another distribution's: a clear error where it is not installed
        from .registry import import_distribution_module

        home = import_distribution_module(module, f"anyquant.{name}")
    else:
        home = importlib.import_module(f".{module}", __name__)
    value = getattr(home, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from anyquant_runtime.loaders import TransformersLoader
    from anyquant_tools.advise import Advice, advise
    from anyquant_tools.calibration import CalibrationError, CalibrationOverlapError
    from anyquant_tools.estimate import Estimate, estimate
    from anyquant_tools.evaluate import EvalResult, EvaluationError, compare, perplexity
    from anyquant_tools.export import export_dense
    from anyquant_tools.quantize import quantize

    from .api import default_model, default_registry, detect, inspect, list_plugins, load
    from .errors import (
        AmbiguousFormatError,
        AnyquantError,
        CheckpointError,
        ConfigError,
        DestinationLockedError,
        DownloadError,
        FormatConflictError,
        FormatMismatchError,
        HeaderError,
        InsufficientMemoryError,
        MissingDependencyError,
        MissingTensorError,
        ModelClosedError,
        NumericalError,
        ParameterError,
        PickleRefusedError,
        PluginError,
        ProbeError,
        QuantizeError,
        RevisionNotFoundError,
        UnknownFormatError,
        UnsafePathError,
        UnsupportedBackendError,
        UnsupportedFormatError,
    )
    from .hookspecs import hookimpl, hookspec
    from .probe import Probe
    from .protocols import (
        BackendInfo,
        BackendSpec,
        Claim,
        Detection,
        FormatSpec,
        GenerationKwargs,
        GenerationParams,
        Generator,
        LoadedModel,
        Loader,
        LoadOptions,
        ModuleInfo,
        Prompt,
        Quantizer,
        QuantizeSpec,
    )
    from .registry import PluginInfo, Registry
    from .report import Report
    from .shape import SizingError
