"""Typed errors. Every error anyquant raises on purpose subclasses :class:`AnyquantError`.

Each message says what was seen, what is installed and what to do next.
"""

from __future__ import annotations

__all__ = [
    "AmbiguousFormatError",
    "AnyquantError",
    "CheckpointError",
    "DownloadError",
    "ConfigError",
    "DestinationLockedError",
    "FormatConflictError",
    "FormatMismatchError",
    "HeaderError",
    "InsufficientMemoryError",
    "MissingDependencyError",
    "MissingTensorError",
    "ModelClosedError",
    "NumericalError",
    "ParameterError",
    "PickleRefusedError",
    "PluginError",
    "ProbeError",
    "QuantizeError",
    "RevisionNotFoundError",
    "UnknownFormatError",
    "UnsafePathError",
    "UnsupportedBackendError",
    "UnsupportedFormatError",
]


class AnyquantError(Exception):
    """Base class of every error anyquant raises on purpose."""


class ProbeError(AnyquantError):
    """A checkpoint's files could not be read as a checkpoint."""


class RevisionNotFoundError(ProbeError):
    """A model id's revision (branch, tag or commit) is not in the local Hugging Face cache."""


class DownloadError(ProbeError):
    """An explicit download from the Hugging Face Hub failed, was refused (offline mode), or would fetch
    more than one quantization of a repository."""


class HeaderError(ProbeError):
    """A safetensors or GGUF header is truncated, oversized, not UTF-8 / JSON, or inconsistent."""


class ConfigError(ProbeError):
    """``config.json`` or a quantization config file is not valid JSON of the expected shape."""


class UnsafePathError(ProbeError):
    """A path leaves the model directory (``..``, absolute index entries, escaping symlinks)."""


class CheckpointError(AnyquantError):
    """The checkpoint is readable but not loadable as it is (missing shards, no weights...)."""


class MissingTensorError(CheckpointError):
    """A tensor the model needs is in no shard."""


class PickleRefusedError(CheckpointError):
    """Only pickle (``.bin``/``.pt``) weights were found and ``allow_pickle`` was not given."""


class UnknownFormatError(AnyquantError):
    """No installed plugin claimed the checkpoint."""


class AmbiguousFormatError(AnyquantError):
    """More than one plugin claimed the checkpoint."""


class FormatMismatchError(AnyquantError):
    """The caller's ``format=`` disagrees with what the tensors show."""


class FormatConflictError(AnyquantError):
    """The config's ``quant_method`` disagrees with what the tensors show."""


class UnsupportedFormatError(AnyquantError):
    """The format is recognised, but nothing installed can load it (here)."""


class UnsupportedBackendError(AnyquantError):
    """The requested backend cannot run this format on this machine."""


class MissingDependencyError(AnyquantError):
    """A package a format or backend needs is missing or too old."""


class PluginError(AnyquantError):
    """A plugin is broken or violates the plugin contract."""


class QuantizeError(AnyquantError):
    """Quantization was refused or failed; nothing was written at the destination."""


class DestinationLockedError(AnyquantError):
    """Another ``quantize`` or ``export_dense`` job (named in the message: its process and host) is writing
    the same destination; nothing was written. Wait for it to finish, or choose another destination."""


class ModelClosedError(AnyquantError):
    """The model was closed (:meth:`~anyquant.LoadedModel.close`) before or while it was used."""


class ParameterError(AnyquantError, ValueError):
    """An argument is out of range or of the wrong type (a generation parameter, a load option's value,
    a device torch cannot use). Also a ``ValueError``, as Python's own argument checks raise."""


class InsufficientMemoryError(AnyquantError, MemoryError):
    """Loading needed more memory (RAM, or the device's) than was free. The checkpoint itself is not at fault.
    Also a ``MemoryError``, as an allocation failure in Python is."""


class NumericalError(CheckpointError):
    """A weight (scale, norm, embedding) is NaN or infinite, or the model produced non-finite logits."""
