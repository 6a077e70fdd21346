"""compressed-tensors' sparse layouts (``sparsity_config``): read from headers, decompressed to the dense weight.

compressed-tensors (<= 0.14, which llm-compressor <= 0.10 saves with) stores a sparse module's weight, after its
quantization compressor has run (``ModelCompressor.compress_model``: quantization first, sparsity second), as

* ``sparse-24-bitmask`` (``Sparse24BitMaskCompressor``): ``<m>.compressed`` [out, in/2], the two kept values of each
  group of four in row order; ``<m>.bitmask`` U8 [out, ceil(in/8)], one bit per dense value (``numpy.packbits``,
  little bit order); ``<m>.shape`` I64 [2, 1], the dense ``[out, in]``;
* ``sparse-bitmask`` (``BitmaskCompressor``): ``<m>.compressed`` 1-D, the nonzero values in row order; the same
  ``bitmask``; ``<m>.shape`` I64 [2]; ``<m>.row_offsets`` I64 [out], where each row's values start.

The values keep the quantized dtype (FP8, int8) beside the quantization's own ``weight_scale`` ...; decompression
is the reverse (``decompress_model``: sparsity first): the dense ``<m>.weight`` is rebuilt (zeros, then the values
at the bitmask's set bits, row-major), then the module decodes as any other. Here that dense weight is a virtual
tensor: :func:`sparse_view` adds its header to the probe, :class:`SparseSource` builds it when the load reads it.
Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from anyquant.plugin import CheckpointError, Probe, TensorInfo

from .scheme import SPARSE_FORMATS, sparse_format

if TYPE_CHECKING:
    import torch

__all__ = ["SPARSE_FORMATS", "SparseSource", "SparseSpec", "decompress", "read_sparse", "sparse_format", "sparse_view"]

_PARTS = {
    "sparse-24-bitmask": ("shape", "compressed", "bitmask"),
    "sparse-bitmask": ("shape", "compressed", "bitmask", "row_offsets"),
}
#: the dtypes a weight is stored in before the sparsity compressor (dense floats, or a quantizer's FP8 / int8)
_VALUE_DTYPES = frozenset({"F32", "F16", "BF16", "F8_E4M3", "I8"})
_INT_DTYPES = frozenset({"I64", "I32"})


@dataclass(frozen=True)
class SparseSpec:
    """One module's sparse tensors, checked against each other from their headers."""

    name: str
    layout: str  # a key of _PARTS
    dtype: str  # the values' safetensors dtype: the dense weight's
    out_features: int
    #: 2:4: exact (twice the values' columns); the general bitmask: its columns times 8, which ``shape`` refines
    in_features: int
    tensors: Mapping[str, str]  # part -> full tensor name
    nbytes: int


def read_sparse(probe: Probe, sparsity: Mapping[str, Any] | None) -> tuple[dict[str, SparseSpec], list[str]]:
    """Every module stored sparse (it has ``bitmask`` or ``compressed`` tensors), and the problems found."""
    from .scheme import _matches, _strings

    names = sorted(set(probe.modules_with("bitmask")) | set(probe.modules_with("compressed")))
    fmt = sparse_format(sparsity)
    if not names:
        return {}, []
    if fmt is None:
        return {}, [
            f"{names[0]} (and {len(names) - 1} more) hold sparse tensors, and sparsity_config has no sparse format"
        ]
    assert sparsity is not None
    targets = _strings(sparsity.get("targets") or [], "sparsity_config.targets")
    ignore = _strings(sparsity.get("ignore") or [], "sparsity_config.ignore")
    specs: dict[str, SparseSpec] = {}
    problems: list[str] = []
    for name in names:
        try:
            if any(_matches(name, t, linear=True) for t in ignore) or not any(
                _matches(name, t, linear=True) for t in targets
            ):
                raise _Problem(
                    f"{fmt} tensors, but sparsity_config does not target it (compressed-tensors would not "
                    "decompress them)"
                )
            specs[name] = _spec(probe, name, fmt)
        except _Problem as p:
            problems.append(f"{name}: {p}")
    return specs, problems


class _Problem(Exception):
    pass


def _spec(probe: Probe, name: str, layout: str) -> SparseSpec:
    t = probe.tensors
    parts = _PARTS[layout]
    missing = [p for p in parts if f"{name}.{p}" not in t]
    if missing:
        raise _Problem(f"{layout} needs {', '.join(parts)}; {', '.join(missing)} missing")
    for clash in ("weight", "weight_packed"):
        if f"{name}.{clash}" in t:
            raise _Problem(f"both {layout} tensors and a {clash}")
    values, bitmask, shape = (t[f"{name}.{p}"] for p in ("compressed", "bitmask", "shape"))
    if values.dtype not in _VALUE_DTYPES:
        raise _Problem(f"compressed is {values.dtype}; expected one of {sorted(_VALUE_DTYPES)}")
    if bitmask.dtype != "U8" or len(bitmask.shape) != 2:
        raise _Problem(f"bitmask is {bitmask.dtype}{list(bitmask.shape)}; expected U8 [out, ceil(in/8)]")
    out, cols = bitmask.shape
    if layout == "sparse-24-bitmask":
        if shape.dtype not in _INT_DTYPES or tuple(shape.shape) not in ((2, 1), (2,)):
            raise _Problem(f"shape is {shape.dtype}{list(shape.shape)}; expected I64 [2, 1]")
        if (
            len(values.shape) != 2
            or values.shape[0] != out
            or values.shape[1] % 2  # 2 of each 4 values: in/2 is even
            or math.ceil(2 * values.shape[1] / 8) != cols
        ):
            raise _Problem(
                f"compressed is {list(values.shape)}, bitmask {list(bitmask.shape)}; 2:4 keeps [out, in/2] values "
                "and [out, ceil(in/8)] mask bytes"
            )
        in_features = 2 * values.shape[1]
    else:
        offsets = t[f"{name}.row_offsets"]
        if shape.dtype not in _INT_DTYPES or tuple(shape.shape) != (2,):
            raise _Problem(f"shape is {shape.dtype}{list(shape.shape)}; expected I64 [2]")
        if offsets.dtype not in _INT_DTYPES or tuple(offsets.shape) != (out,):
            raise _Problem(f"row_offsets is {offsets.dtype}{list(offsets.shape)}; expected I64 [{out}]")
        if len(values.shape) != 1 or values.shape[0] > out * cols * 8:
            raise _Problem(f"compressed is {list(values.shape)}; expected at most {out * cols * 8} values, 1-D")
        in_features = cols * 8
    nbytes = sum(t[f"{name}.{p}"].nbytes for p in parts)
    return SparseSpec(name, layout, values.dtype, out, in_features, {p: f"{name}.{p}" for p in parts}, nbytes)


def sparse_view(probe: Probe, specs: Mapping[str, SparseSpec]) -> Probe:
    """``probe`` with each sparse module's dense ``<m>.weight`` as a header (dtype of the values, ``[out, in]``),
    so that the quantization scheme reads the module as the dense-stored format it decompresses to."""
    if not specs:
        return probe
    tensors = dict(probe.tensors)
    for s in specs.values():
        values = probe.tensors[s.tensors["compressed"]]
        tensors[f"{s.name}.weight"] = TensorInfo(
            f"{s.name}.weight", s.dtype, (s.out_features, s.in_features), values.file, 0, s.nbytes
        )
    by_suffix = dict(probe.by_suffix)
    by_suffix["weight"] = tuple(by_suffix.get("weight", ())) + tuple(specs)
    return dataclasses.replace(probe, tensors=MappingProxyType(tensors), by_suffix=MappingProxyType(by_suffix))


# ----------------------------------------------------------------------------------------- decompression (torch)


def decompress(spec: SparseSpec, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The dense weight, as compressed-tensors' ``sparse24_bitmask_decompress`` / ``bitmask_decompress`` build it:
    zeros, and the stored values at the bitmask's set bits in row-major order, bit for bit in the values' dtype.
    Checked first: ``shape`` names the headers' ``[out, in]``, a 2:4 mask keeps exactly 2 of every 4, the general
    mask's bits count the values and ``row_offsets`` says where each row starts. Work: one pass over the mask."""
    import torch

    where = spec.name
    dims = [int(v) for v in get(spec.tensors["shape"]).reshape(-1).tolist()]
    bitmask = get(spec.tensors["bitmask"])
    values = get(spec.tensors["compressed"])
    out, cols = spec.out_features, bitmask.shape[1]
    if len(dims) != 2 or dims[0] != out or not (cols - 1) * 8 < dims[1] <= cols * 8:
        raise CheckpointError(f"{where}: shape says {dims}; the bitmask is [{out}, {cols}] bytes")
    if spec.layout == "sparse-24-bitmask" and (dims[1] != spec.in_features or dims[1] % 4):
        raise CheckpointError(
            f"{where}: shape says {dims}; 2:4 values of {list(values.shape)} need [{out}, {spec.in_features}]"
        )
    in_features = dims[1]
    bits = torch.arange(8, dtype=torch.uint8)
    mask = ((bitmask.unsqueeze(-1) >> bits) & 1).reshape(out, cols * 8)[:, :in_features].bool()
    if spec.layout == "sparse-24-bitmask":
        kept = mask.reshape(out, in_features // 4, 4).sum(-1)
        bad = (kept != 2).nonzero()
        if len(bad):
            row, group = (int(v) for v in bad[0])
            raise CheckpointError(
                f"{where}: the 2:4 bitmask keeps {int(kept[row, group])} of the 4 values at row {row}, columns "
                f"{4 * group}..{4 * group + 3} (and {len(bad) - 1} more groups); 2:4 keeps exactly 2"
            )
    else:
        counts = mask.sum(-1)
        if int(counts.sum()) != values.numel():
            raise CheckpointError(f"{where}: the bitmask has {int(counts.sum())} set bits for {values.numel()} values")
        offsets = get(spec.tensors["row_offsets"]).reshape(-1).to(torch.int64)
        if not torch.equal(offsets, torch.cumsum(counts, 0) - counts):
            raise CheckpointError(f"{where}: row_offsets do not match the bitmask's row counts")
    raw = _raw(values)
    dense = torch.zeros(out, in_features, dtype=raw.dtype)
    dense[mask] = raw.reshape(-1)
    return dense.view(values.dtype)


def _raw(values: torch.Tensor) -> torch.Tensor:
    """The values as integers of their width: the scatter moves bits, never rounds or canonicalises a float."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[values.element_size()]
    return values.view(width)


class SparseSource:
    """A tensor source that serves each sparse module's dense ``<m>.weight`` (decompressed when read, marking its
    parts used) beside the checkpoint's own tensors."""

    def __init__(self, inner: Any, specs: Mapping[str, SparseSpec]) -> None:
        self.inner = inner
        self.virtual = {f"{s.name}.weight": s for s in specs.values()}

    def keys(self) -> Iterator[str]:
        yield from self.inner.keys()
        yield from self.virtual

    def __contains__(self, name: object) -> bool:
        return name in self.virtual or name in self.inner

    def get(self, name: str) -> torch.Tensor:
        spec = self.virtual.get(name)
        if spec is None:
            out: torch.Tensor = self.inner.get(name)
            return out
        return decompress(spec, self.inner.get)

    def file_rows(self, name: str) -> Any:
        rows = getattr(self.inner, "file_rows", None)
        return None if name in self.virtual or rows is None else rows(name)

    def unused(self) -> list[str]:
        unused = getattr(self.inner, "unused", None)
        return [] if unused is None else list(unused())

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
