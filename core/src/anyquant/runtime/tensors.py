"""Tensor sources: where a loader gets tensors by name.

:class:`SafetensorsSource` reads shards through ``safetensors.safe_open`` (memory-mapped; only
the asked-for tensor is materialised), using the probe's headers to know which file holds what.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import MissingTensorError

if TYPE_CHECKING:
    import torch

    from ..probe import Probe

__all__ = ["DictSource", "SafetensorsSource", "TensorSource"]


class TensorSource(Protocol):
    def keys(self) -> Iterable[str]: ...

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...


class SafetensorsSource:
    """Tensors of a probed checkpoint, read lazily from its safetensors shards."""

    def __init__(self, probe: Probe) -> None:
        self._probe = probe
        self._handles: dict[str, Any] = {}
        self.used: set[str] = set()

    def keys(self) -> Iterator[str]:
        return iter(self._probe.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._probe.tensors

    def _handle(self, file: str) -> Any:
        h = self._handles.get(file)
        if h is None:
            from safetensors import safe_open

            h = safe_open(str(self._probe.root / file), framework="pt", device="cpu")
            self._handles[file] = h
        return h

    def get(self, name: str) -> torch.Tensor:
        info = self._probe.tensors.get(name)
        if info is None:
            raise MissingTensorError(
                f"tensor {name!r} is in none of the {len(self._probe.safetensors)} safetensors file(s) of "
                f"{self._probe.root}"
            )
        self.used.add(name)
        return self._handle(info.file).get_tensor(name)

    def unused(self) -> list[str]:
        return sorted(set(self._probe.tensors) - self.used)

    def close(self) -> None:
        self._handles.clear()


class DictSource:
    """Tensors held in a dict (tests, converted formats)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._t = tensors
        self.used: set[str] = set()

    def keys(self) -> Iterator[str]:
        return iter(self._t)

    def __contains__(self, name: object) -> bool:
        return name in self._t

    def get(self, name: str) -> torch.Tensor:
        if name not in self._t:
            raise MissingTensorError(f"tensor {name!r} is missing")
        self.used.add(name)
        return self._t[name]

    def unused(self) -> list[str]:
        return sorted(set(self._t) - self.used)
