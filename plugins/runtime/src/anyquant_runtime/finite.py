"""Finiteness checks at load: a NaN or infinite weight (a scale, a norm, an embedding row) otherwise loads
silently and every forward then gives NaN logits."""

from __future__ import annotations

import torch

from anyquant.errors import NumericalError

__all__ = ["check_finite"]

#: one-byte float dtypes: (mask, code) with ``bits & mask == code`` exactly for their NaN (and inf) encodings
_BYTE_FLOATS = {
    torch.float8_e4m3fn: (0x7F, 0x7F),  # no inf; S.1111.111 is NaN
    torch.float8_e5m2: (0x7C, 0x7C),  # exponent all ones: inf or NaN
    torch.float8_e8m0fnu: (0xFF, 0xFF),  # 0xFF is NaN
}


def check_finite(name: str, value: torch.Tensor, *, source: torch.Tensor | None = None) -> None:
    """:class:`~anyquant.errors.NumericalError` naming tensor ``name`` if floating ``value`` holds NaN or
    ±inf. ``source``: what ``value`` was converted from; when that is finite the message says the conversion
    overflowed (a float32 value past float16's range) rather than that the checkpoint is damaged."""
    if not value.is_floating_point() or value.is_meta or value.numel() == 0:
        return
    if 0 in value.stride():  # an expanded view (a placeholder): each distinct element once, not every repeat
        value = value[tuple(slice(0, 1) if step == 0 else slice(None) for step in value.stride())]
    if value.element_size() == 1:  # FP8 / E8M0: torch has no sum for them; their non-finite codes by bits
        mask, code = _BYTE_FLOATS.get(value.dtype, (0, 1))
        bits = value.contiguous().view(torch.uint8)
        bad = int(((bits & mask) == code).sum()) if mask else 0
        if bad:
            raise NumericalError(
                f"tensor {name!r} holds {bad} NaN/inf of its {value.numel()} values: the checkpoint is damaged or was "
                "quantized/converted wrongly (every output would be NaN). Re-download or re-export it"
            )
        return
    # one pass, no temporary: any NaN or inf element makes the sum NaN or inf (a finite sum past the dtype's
    # range falls through to the exact check), far cheaper than isfinite's full boolean tensor (docs/benchmarks.md).
    if bool(torch.isfinite(value.sum())) or bool(torch.isfinite(value).all()):
        return
    nan = int(torch.isnan(value).sum())
    inf = int(torch.isinf(value).sum())
    found = ", ".join(p for p in (f"{nan} NaN" if nan else "", f"{inf} inf" if inf else "") if p)
    dtype = str(value.dtype).removeprefix("torch.")
    if source is not None and source.dtype != value.dtype and bool(torch.isfinite(source).all()):
        raise NumericalError(
            f"tensor {name!r} overflows {dtype} ({found} after the conversion from "
            f"{str(source.dtype).removeprefix('torch.')}): load it with dtype='float32' or 'bfloat16'"
        )
    raise NumericalError(
        f"tensor {name!r} holds {found} of its {value.numel()} values: the checkpoint is damaged or was "
        "quantized/converted wrongly (every output would be NaN). Re-download or re-export it"
    )
