"""Tensor sources: where a loader gets tensors by name.

:class:`SafetensorsSource` reads shards through ``safetensors.safe_open`` (memory-mapped; only
the asked-for tensor is materialised), using the probe's headers to know which file holds what.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from anyquant.errors import CheckpointError, MissingTensorError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from anyquant.probe import Probe

__all__ = [
    "LAYER_PREFIX",
    "DictSource",
    "FileRows",
    "PackedRows",
    "SafetensorsSource",
    "TensorSource",
    "fill_file_tables",
]

#: a tensor's or module's decoder layer: the stack's prefix (``model.layers``, GGUF's ``blk``, GPT-2's ``h``) and the
#: layer's number; the whole match (``model.layers.3.``) names the layer
LAYER_PREFIX = re.compile(r"^(.*?(?:layers|blk|h))\.(\d+)\.")


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
            raw: torch.Tensor = self._handle(info.file).get_tensor(name)
            return raw
        out = torch.empty(info.end - info.begin, dtype=torch.uint8)
        self._read_into(info.file, self._data_start[info.file] + info.begin, out.numpy(), name)
        return out.view(dtype).reshape(info.shape)

    def _read_into(self, file: str, offset: int, buffer: Any, name: str) -> None:
        fh = self._files.get(file)
        if fh is None:
            fh = self._files[file] = open(self._probe.root / file, "rb")  # closed in close()
        _pread_into(fh, offset, buffer, f"{file}: tensor {name!r}")

    def file_rows(self, name: str) -> FileRows | None:
        """``name`` as a :class:`FileRows` (rows read from the file when asked), or ``None`` when it is not
        a 2-D float16/bfloat16/float32 tensor. Marks it used."""
        info = self._probe.tensors.get(name)
        if info is None or info.dtype not in ("F16", "BF16", "F32") or len(info.shape) != 2:
            return None
        import torch

        self.used.add(name)
        path = self._probe.root / info.file
        return FileRows(
            path, self._data_start[info.file] + info.begin, tuple(info.shape), getattr(torch, _TORCH_DTYPES[info.dtype])
        )

    def unused(self) -> list[str]:
        return sorted(set(self._probe.tensors) - self.used)

    def close(self) -> None:
        self._handles.clear()
        for fh in self._files.values():
            fh.close()
        self._files.clear()


def _pread_into(fh: Any, offset: int, buffer: Any, what: str) -> None:
    """Fill ``buffer`` from ``fh`` at ``offset`` (``os.preadv``: no shared file position, so threads may share
    ``fh``); a short file is a :class:`CheckpointError`."""
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        part = view[done : done + _READ_CHUNK]
        try:
            if _HAS_PREADV:
                got = os.preadv(fh.fileno(), [part], offset + done)
            else:  # pragma: no cover - Windows
                with _SEEK_LOCK:
                    fh.seek(offset + done)
                    got = fh.readinto(part)
        except OSError as exc:
            raise CheckpointError(f"{what}: cannot read ({exc.strerror})") from None
        if got == 0:
            raise CheckpointError(f"{what}: the file ends early (it changed or was truncated after it was probed)")
        done += got


_SEEK_LOCK = threading.Lock()


class PackedRows:
    """A ``[rows, dim]`` table a format keeps packed and decodes a few rows at a time (what a fast backend's head reads
    as its exact table and a looked-up embedding reads, as it reads a :class:`FileRows`): the format supplies
    :meth:`decode` of a row range or of row indices, its rows as the whole table's decode gives them."""

    shape: tuple[int, int]
    dtype: torch.dtype

    def decode(self, index: slice | torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (a slice, or a 1-D tensor of row numbers) decoded, ``[n, dim]``."""
        raise NotImplementedError

    def __len__(self) -> int:
        return self.shape[0]

    def slice(self, start: int, count: int) -> torch.Tensor:
        """Rows ``start .. start + count`` (clipped to the table)."""
        start = max(0, int(start))
        return self.decode(slice(start, max(start, min(start + int(count), self.shape[0]))))

    def read_all(self) -> torch.Tensor:
        return self.decode(slice(0, self.shape[0]))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``table[ids]``, ``[*ids.shape, dim]``."""
        return self.decode(ids.reshape(-1)).reshape(*ids.shape, self.shape[1])


class FileRows:
    """A 2-D tensor left in its safetensors file and read a few rows at a time (``os.preadv`` into fresh
    tensors): an embedding table whose lookups need a handful of rows per step, or an LM head read one
    slice at a time. Nothing of it stays in the process's memory between calls; the file's pages stay in
    the OS page cache, shared and reclaimable, as with a memory map, but a file cut short gives a
    :class:`~anyquant.errors.CheckpointError` instead of a crash. The file must not be rewritten in place
    while the model is loaded (deleting or replacing it is fine: the open handle keeps the data)."""

    #: closed by :meth:`anyquant.LoadedModel.close` (which finds it among the module's attributes)
    closes_with_model = True

    def __init__(self, path: os.PathLike[str] | str, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if len(shape) != 2:
            raise ValueError(f"FileRows holds 2-D tensors, not {tuple(shape)}")
        self.path, self.offset = os.fspath(path), int(offset)
        self.shape: tuple[int, int] = (int(shape[0]), int(shape[1]))
        self.dtype = dtype
        self.row_bytes = self.shape[1] * dtype.itemsize
        self._fh = open(self.path, "rb")  # held for the object's life: closed by close() or GC

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def __len__(self) -> int:
        return self.shape[0]

    @functools.cached_property
    def _what(self) -> str:
        """The table, as read errors name it (built once, not on every lookup)."""
        return f"{os.path.basename(self.path)}: table {list(self.shape)} at byte {self.offset}"

    def slice(self, start: int, count: int) -> torch.Tensor:
        """Rows ``start .. start + count`` (clipped to the table), a new ``[n, dim]`` tensor."""
        import torch

        start = max(0, int(start))
        count = max(0, min(int(count), self.shape[0] - start))
        out = torch.empty(count, self.shape[1], dtype=self.dtype)
        if count:
            _pread_into(self._fh, self.offset + start * self.row_bytes, out.view(torch.uint8).numpy(), self._what)
        return out

    def read_all(self) -> torch.Tensor:
        return self.slice(0, self.shape[0])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``table[ids]``: ``ids`` of any shape, result ``[*ids.shape, dim]``; an id outside the table is an
        ``IndexError``, as ``F.embedding`` raises."""
        import torch

        flat = ids.reshape(-1).tolist()
        n = self.shape[0]
        if flat and (min(flat) < 0 or max(flat) >= n):
            raise IndexError(f"index out of range: ids must lie in [0, {n}) for this {n}-row table")
        out = torch.empty(len(flat), self.shape[1], dtype=self.dtype)
        raw = out.view(torch.uint8).numpy()
        base, size = self.offset, self.row_bytes
        # a row per preadv call, without _pread_into's per-call work (a decode step's exact head logits read 64 rows:
        # ~2 us a row less); a short read or an error, and Windows, go through _pread_into
        fd = self._fh.fileno() if _HAS_PREADV and size <= _READ_CHUNK else -1
        for i, row in enumerate(flat):
            if fd >= 0:
                try:
                    if os.preadv(fd, [raw[i]], base + row * size) == size:
                        continue
                except OSError:
                    pass
            _pread_into(self._fh, base + row * size, raw[i], self._what)
        return out.view(*ids.shape, self.shape[1])

    def close(self) -> None:
        self._fh.close()

    def __del__(self) -> None:  # closed with the object, without an "unclosed file" ResourceWarning
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()

    def __getstate__(self) -> dict[str, Any]:  # pickle / deepcopy: reopen the file by path
        return {"path": self.path, "offset": self.offset, "shape": self.shape, "dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["offset"], state["shape"], state["dtype"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"FileRows({self.path!r}, offset={self.offset}, shape={list(self.shape)}, dtype={self.dtype})"


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


def fill_file_tables(model: nn.Module, tables: Mapping[str, FileRows], dtype: torch.dtype | None) -> None:
    """Read into memory the parameters ``build_model`` left in the file (``file_tables``) that are still on
    the meta device, in ``dtype`` (``None``: the file's), keeping tied parameters tied. (Here, beside
    :class:`FileRows`, so that the cpu-fast plan needs no import of the build: an import circle.)"""
    from torch import nn

    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), (p, []))[1].append(name)
    for param, names in groups.values():
        if not param.is_meta:
            continue
        table = next((tables[n] for n in names if n in tables), None)
        if table is None:
            continue
        value = table.read_all()
        filled = nn.Parameter(value if dtype is None else value.to(dtype), requires_grad=False)
        for name in names:
            mod_name, _, attr = name.rpartition(".")
            (model.get_submodule(mod_name) if mod_name else model)._parameters[attr] = filled
