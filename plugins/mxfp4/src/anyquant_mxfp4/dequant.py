"""MXFP4 to float, as transformers decodes it (``integrations/mxfp4.py: _convert_moe_packed_tensors``), and the
tensor source that serves the decoded expert parameters under the model's names.

Decoding: the E2M1 table in the target dtype indexed by each byte's low nibble (even element) and high nibble (odd
element), then ``torch.ldexp`` by the block's exponent ``s - 127``: the same operations in the same dtypes as
transformers, so the values are its own bit for bit (every E2M1 value times a power of two is exact in bfloat16 and
float32 while the exponent stays in range). Only the output is laid out differently: one expert at a time, written
straight into the transposed ``[E, in, out]`` parameter (transformers decodes all experts, then copies the transpose).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from anyquant.plugin import CheckpointError, MissingTensorError

from .scheme import BLOCK, BLOCK_BYTES, MXFP4Scheme, MXFP4Tensor

if TYPE_CHECKING:
    import torch

    from anyquant_runtime.tensors import FileRows, SafetensorsSource

__all__ = ["FP4_VALUES", "MXFP4Source", "check_scales", "dequantize", "dequantize_tensor"]

#: E2M1 code -> value (transformers' ``FP4_VALUES``, the OCP MX spec's table)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: the E8M0 code that means NaN (no scale)
E8M0_NAN = 0xFF


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One matrix: ``blocks`` U8 ``[out, in/32, 16]`` and ``scales`` U8 ``[out, in/32]`` -> ``[out, in]`` in
    ``dtype``, transformers' values."""
    import torch

    out_features, groups, width = blocks.shape
    if width != BLOCK_BYTES or tuple(scales.shape) != (out_features, groups):
        raise CheckpointError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} disagree")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    rows = out_features * groups
    blk = blocks.reshape(rows, width)
    exp = scales.reshape(rows, 1).to(torch.int32) - 127
    out = torch.empty(rows, BLOCK, dtype=dtype)
    out[:, 0::2] = lut[(blk & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(blk >> 4).to(torch.int)]
    torch.ldexp(out, exp, out=out)
    return out.view(out_features, groups * BLOCK)


def check_scales(spec: MXFP4Tensor, scales: torch.Tensor) -> None:
    """A NaN scale (E8M0 ``0xFF``, in ``scales`` U8) is a :class:`~anyquant.errors.NumericalError` naming the scales
    tensor, counted as any NaN weight is (float8_e8m0fnu needs torch 2.7)."""
    import torch

    from anyquant_runtime.finite import check_finite

    nan = scales == E8M0_NAN
    if bool(nan.any()):
        check_finite(spec.scales, torch.where(nan, float("nan"), 0.0))


def dequantize_tensor(
    spec: MXFP4Tensor, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The model's parameter ``[E, in, out]`` (``GptOssExperts``' layout) from the stored ``[E, out, in/32, 16]``
    blocks and ``[E, out, in/32]`` scales. A NaN scale (E8M0 ``0xFF``) or a value past ``dtype``'s range is a
    :class:`~anyquant.errors.NumericalError` naming the tensor."""
    import torch

    from anyquant_runtime.finite import check_finite

    want_blocks = (spec.experts, spec.out_features, spec.in_features // BLOCK, BLOCK_BYTES)
    if tuple(blocks.shape) != want_blocks or tuple(scales.shape) != want_blocks[:-1]:
        raise CheckpointError(
            f"{spec.blocks} {list(blocks.shape)} / {spec.scales} {list(scales.shape)}: expected "
            f"{list(want_blocks)} / {list(want_blocks[:-1])} (the file changed after it was probed)"
        )
    blocks, scales = blocks.view(torch.uint8), scales.view(torch.uint8)
    check_scales(spec, scales)
    out = torch.empty(spec.shape, dtype=dtype)
    for e in range(spec.experts):
        out[e].copy_(dequantize(blocks[e], scales[e], dtype).t())
    check_finite(spec.name, out)  # a large exponent times 6 past the dtype's range
    return out


class MXFP4Source:
    """A :class:`~anyquant_runtime.tensors.SafetensorsSource` that serves each packed weight decoded, under the model's
    parameter name (``...mlp.experts.gate_up_proj``), and hides its ``_blocks``/``_scales`` pair: the build fills
    transformers' own experts module from it as from any dense checkpoint, and nothing packed is reported unused."""

    def __init__(self, inner: SafetensorsSource, scheme: MXFP4Scheme) -> None:
        import torch

        self._inner = inner
        self._packed = {t.name: t for t in scheme.tensors}
        self._hidden = {n for t in scheme.tensors for n in (t.blocks, t.scales)}
        self._dtype: torch.dtype = getattr(torch, scheme.dtype)
        #: the decoded names served so far
        self.used: set[str] = set()

    def keys(self) -> Iterator[str]:
        yield from (n for n in self._inner.keys() if n not in self._hidden)
        yield from self._packed

    def __contains__(self, name: object) -> bool:
        return name in self._packed or (name not in self._hidden and name in self._inner)

    def get(self, name: str) -> torch.Tensor:
        spec = self._packed.get(name)
        if spec is None:
            if name in self._hidden:
                raise MissingTensorError(f"tensor {name!r} is read decoded, as {name.rpartition('_')[0]!r}")
            return self._inner.get(name)
        value = dequantize_tensor(spec, self._inner.get(spec.blocks), self._inner.get(spec.scales), self._dtype)
        self.used.add(name)
        return value

    def packed(self, name: str) -> MXFP4Tensor | None:
        """The packed weight served as ``name``, counted as used (its reader takes the ``_blocks``/``_scales``
        pair from :meth:`raw`), or ``None``."""
        spec = self._packed.get(name)
        if spec is not None:
            self.used.add(name)
        return spec

    def raw(self, name: str) -> torch.Tensor:
        """A stored tensor as it is in the file (a ``_blocks`` or ``_scales`` one included)."""
        return self._inner.get(name)

    def file_rows(self, name: str) -> FileRows | None:
        return None if name in self._packed or name in self._hidden else self._inner.file_rows(name)

    def unused(self) -> list[str]:
        left = set(self._inner.unused()) - self._hidden
        return sorted(left | (set(self._packed) - self.used))

    def close(self) -> None:
        self._inner.close()
