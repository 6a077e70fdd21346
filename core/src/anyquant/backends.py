"""Backends: what runs a format's layers, and the one place a backend is chosen.

Two kinds of backend run a checkpoint. A format's *exact* backends are its own (:data:`EXACT_BACKENDS`:
``reference`` decodes on every forward, ``dequantized`` once at load, GGUF's ``packed`` reads its blocks), and
every format has them. The *fast* backends are shared: a plugin registers one with the
``anyquant_register_backends`` hook (:class:`~anyquant.protocols.BackendSpec`: its name, the devices and packed
layouts it runs), and a format whose layers come in one of those layouts offers it. anyquant's own:
``cpu-fast`` (the CPU engine, the anyquant-cpu distribution: :mod:`anyquant_cpu`), ``gptqmodel``
(GPTQModel's CUDA kernels), ``exllamav3`` (exllamav3's CUDA kernels and generator).

:func:`choose_backend` decides for every loader: a backend asked for by name is checked (known to the format,
runs on this device, available here, not refused for this checkpoint), and ``auto`` takes the first of the
format's order that runs here and that this checkpoint does not rule out. Importing this module imports
neither torch nor any backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import UnsupportedBackendError
from .protocols import BackendInfo

__all__ = ["EXACT_BACKENDS", "backend_status", "choose_backend", "runs_on"]

#: the backends every format loader has of its own, whatever plugins register
EXACT_BACKENDS = ("reference", "dequantized", "packed")

_PLACES = {"cpu": "the CPU", "cuda": "CUDA GPUs only", "mps": "Apple GPUs only"}


def runs_on(info: BackendInfo, device: Any) -> bool:
    """Whether ``info``'s backend runs on ``device`` (a ``torch.device``, or anything with a ``type``; a plain
    string is a device type)."""
    kind = device if isinstance(device, str) else getattr(device, "type", "cpu")
    return not info.devices or kind in info.devices


def choose_backend(
    fmt: str,
    backends: Sequence[BackendInfo],
    order: Sequence[str],
    requested: str,
    device: Any,
    *,
    skip: Mapping[str, str] | None = None,
    refuse: Mapping[str, str] | None = None,
) -> str:
    """The backend that runs format ``fmt`` on ``device`` for ``requested`` (a backend's name or ``"auto"``).

    ``backends``: the format's (its loader's ``backends()``); ``order``: its preference for ``auto``; ``skip``:
    backends ``auto`` passes by for this checkpoint, with why (no layer takes its kernel, the dense weights do
    not fit in memory; one asked for by name still runs); ``refuse``: names this format does not run, with what
    to do instead (a typed error when asked for). Errors are :class:`~anyquant.errors.UnsupportedBackendError`.
    """
    skip = skip or {}
    refuse = refuse or {}
    known = {b.name: b for b in backends}
    kind = getattr(device, "type", None) or str(device)
    if requested in refuse:
        raise UnsupportedBackendError(refuse[requested])
    if requested != "auto":
        info = known.get(requested)
        if info is None:
            raise UnsupportedBackendError(
                f"backend {requested!r} is not a {fmt} backend; choose one of {sorted(known)}"
            )
        if not runs_on(info, device):
            places = " or ".join(_PLACES.get(d, d) for d in info.devices)
            raise UnsupportedBackendError(f"backend {requested!r} runs on {places}, not on {device}")
        if not info.available:
            raise UnsupportedBackendError(f"{fmt} backend {requested!r} cannot run here: {info.reason}")
        return requested
    passed: list[str] = []
    for name in order:
        info = known.get(name)
        if info is None:
            continue
        if not info.available:
            passed.append(f"{name}: {info.reason}")
        elif not runs_on(info, device):
            passed.append(f"{name}: not on {kind}")
        elif name in skip:
            passed.append(f"{name}: {skip[name]}")
        else:
            return name
    raise UnsupportedBackendError(f"no {fmt} backend can run here: " + "; ".join(passed or ["none is declared"]))


def backend_status(ref: str | None) -> tuple[bool, str]:
    """A registered backend's availability here, from its ``status`` reference (``"module:function"``, imported
    now); ``(True, "")`` when it declares none, ``(False, why)`` when the check cannot be imported or fails."""
    if ref is None:
        return True, ""
    module, _, attr = ref.partition(":")
    try:
        ok, reason = getattr(importlib.import_module(module), attr)()
    except Exception as exc:  # a missing dependency, a broken plugin: the backend does not run here
        return False, f"{type(exc).__name__}: {exc}"
    return bool(ok), str(reason)
