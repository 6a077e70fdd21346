"""Numbers read from a GGUF file's metadata, checked where they are read.

A GGUF value has the type its writer chose: a float ``inf`` where a layer count belongs, a string where a head
count does, a negative or 2**64 - 1 size. :func:`metadata_number` is the one check every numeric read of the plugin
goes through (the config, the Q/K permutation, the tokenizer's ids): the type (an integer where llama.cpp reads
an integer, any finite number where it reads a float; never a bool), finiteness and range, raising
:class:`GGUFMetadataError` naming the key and the value instead of ``int(inf)``'s bare ``OverflowError``.

Importing this module imports neither torch nor numpy (the tokenizer reads through it too).
"""

from __future__ import annotations

import math
from typing import Any

from anyquant.plugin import CheckpointError

__all__ = ["MAX_SIZE", "GGUFMetadataError", "metadata_float", "metadata_int", "metadata_number"]

#: the largest count or size (layers, heads, widths, context, vocabulary, token id) a metadata key may hold:
#: int32's, as llama.cpp holds them (and as core's config checks bound them)
MAX_SIZE = 2**31 - 1


class GGUFMetadataError(CheckpointError, ValueError):
    """A GGUF metadata value is missing where it is required, of the wrong type (a string, a bool, a float where an
    integer is read), not finite, or out of its range; the message names the key and the value. Also a
    ``ValueError``, as the plugin's earlier "key is missing" error was."""


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)} values"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _kind(value: Any) -> str:
    return "a bool" if isinstance(value, bool) else f"a {type(value).__name__}"


def _wanted(integer: bool, minimum: float | None, maximum: float | None, above: bool) -> str:
    what = "an integer" if integer else "a finite number"
    if minimum is not None and maximum is not None and not above:
        return f"{what} in [{minimum}, {maximum}]"
    parts = []
    if minimum is not None:
        parts.append(f"{'>' if above else '>='} {minimum}")
    if maximum is not None:
        parts.append(f"<= {maximum}")
    return f"{what} {' and '.join(parts)}" if parts else what


def metadata_number(
    key: str,
    value: Any,
    *,
    integer: bool = True,
    minimum: float | None = None,
    maximum: float | None = None,
    above: bool = False,
    required: bool = False,
) -> int | float | None:
    """``value`` (GGUF key ``key``'s) as an ``int`` (``integer``) or a ``float``, checked: never a bool, a string or
    a list; an integer key takes an integer only (``32.0`` and ``inf`` are refused, as llama.cpp refuses a key of
    the wrong type), a float key any finite number; ``minimum`` (exclusive with ``above``) and ``maximum`` bound it.
    ``None`` (the key is absent) is returned as it is, or refused when ``required``. Raises
    :class:`GGUFMetadataError` naming the key and the value."""
    if value is None:
        if required:
            raise GGUFMetadataError(
                f"GGUF metadata key {key} is missing; the file is incomplete or was written wrongly"
            )
        return None
    wanted = _wanted(integer, minimum, maximum, above)
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        raise GGUFMetadataError(
            f"GGUF metadata {key} = {_shown(value)} is {_kind(value)}, not {wanted}; the file is damaged or was "
            "written wrongly (re-download or re-convert it)"
        )
    number: int | float = value if integer else float(value)
    low_ok = minimum is None or (number > minimum if above else number >= minimum)
    if not math.isfinite(number) or not low_ok or (maximum is not None and number > maximum):
        raise GGUFMetadataError(
            f"GGUF metadata {key} = {_shown(value)} is not {wanted}; the file is damaged or was written wrongly "
            "(re-download or re-convert it)"
        )
    return number


def metadata_int(
    key: str, value: Any, *, minimum: int | None = 0, maximum: int | None = MAX_SIZE, required: bool = False
) -> int | None:
    """:func:`metadata_number` for a key llama.cpp reads as an integer (a count, a size, a token id)."""
    number = metadata_number(key, value, integer=True, minimum=minimum, maximum=maximum, required=required)
    return None if number is None else int(number)


def metadata_float(
    key: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: bool = False,
    required: bool = False,
) -> float | None:
    """:func:`metadata_number` for a key llama.cpp reads as a float (an epsilon, a RoPE base, a factor)."""
    number = metadata_number(
        key, value, integer=False, minimum=minimum, maximum=maximum, above=above, required=required
    )
    return None if number is None else float(number)
