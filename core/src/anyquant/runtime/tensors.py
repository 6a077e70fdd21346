"""Tensor sources: where a loader gets tensors by name.

:class:`SafetensorsSource` reads shards through ``safetensors.safe_open`` (memory-mapped; only
the asked-for tensor is materialised), using the probe's headers to know which file holds what.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import CheckpointError, MissingTensorError

if TYPE_CHECKING:
    import torch

    from ..probe import Probe

__all__ = ["DictSource", "SafetensorsSource", "TensorSource"]


class TensorSource(Protocol):
    def keys(self) -> Iterable[str]: ...

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...


#: safetensors dtype -> torch dtype attribute name (the ones read with pread)
_TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
}
#: bytes per ``os.preadv`` call (Linux moves at most ~2 GiB per read)
_READ_CHUNK = 1 << 30
_HAS_PREADV = hasattr(os, "preadv")


class SafetensorsSource:
    """Tensors of a probed checkpoint, read lazily from its safetensors shards."""

    def __init__(self, probe: Probe) -> None:
        self._probe = probe
        self._handles: dict[str, Any] = {}
        self._files: dict[str, Any] = {}
        self._data_start = {h.file: 8 + h.header_len for h in probe.safetensors}
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
        import torch

        dtype = getattr(torch, _TORCH_DTYPES.get(info.dtype, "-"), None)
        if dtype is None:
            return self._handle(info.file).get_tensor(name)
        out = torch.empty(info.end - info.begin, dtype=torch.uint8)
        self._read_into(info.file, self._data_start[info.file] + info.begin, out.numpy(), name)
        return out.view(dtype).reshape(info.shape)

    def _read_into(self, file: str, offset: int, buffer: Any, name: str) -> None:
        fh = self._files.get(file)
        if fh is None:
            fh = self._files[file] = open(self._probe.root / file, "rb")  # closed in close()
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view):
            part = view[done : done + _READ_CHUNK]
            try:
                if _HAS_PREADV:
                    got = os.preadv(fh.fileno(), [part], offset + done)
                else:  # pragma: no cover - Windows
                    fh.seek(offset + done)
                    got = fh.readinto(part)
            except OSError as exc:
                raise CheckpointError(f"{file}: cannot read tensor {name!r} ({exc.strerror})") from None
            if got == 0:
                raise CheckpointError(
                    f"{file}: ends before tensor {name!r} does (the file changed or was truncated after it was probed)"
                )
            done += got

    def unused(self) -> list[str]:
        return sorted(set(self._probe.tensors) - self.used)

    def close(self) -> None:
        self._handles.clear()
        for fh in self._files.values():
            fh.close()
        self._files.clear()


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
