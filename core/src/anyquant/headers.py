"""Header parsers for safetensors and GGUF files. Standard library only, never tensor data.

Both parsers read a bounded number of bytes, check every offset against the file size, and
raise :class:`~anyquant.errors.HeaderError` (never a bare ``ValueError``/``struct.error``) on bad
input.
"""

from __future__ import annotations

import json
import math
import operator
import struct
from array import array
from dataclasses import dataclass, field
from itertools import chain, pairwise, repeat
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from .errors import HeaderError

__all__ = [
    "GGUF_TYPE_SIZES",
    "GGUFHeader",
    "GGUFTensorInfo",
    "MAX_GGUF_ARRAY",
    "MAX_GGUF_HEADER",
    "MAX_JSON_BYTES",
    "MAX_SAFETENSORS_HEADER",
    "SAFETENSORS_DTYPE_BITS",
    "SafetensorsHeader",
    "TensorInfo",
    "loads_json",
    "read_gguf_header",
    "read_safetensors_header",
]

#: safetensors' own reader refuses headers over 100 MB; so do we.
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
#: config files and indexes larger than this are not configs.
MAX_JSON_BYTES = 64 * 1024 * 1024

SAFETENSORS_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "U16": 16,
    "I16": 16,
    "F16": 16,
    "BF16": 16,
    "U32": 32,
    "I32": 32,
    "F32": 32,
    "U64": 64,
    "I64": 64,
    "F64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}

FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


class TensorInfo(NamedTuple):
    """One tensor as a safetensors header describes it (immutable)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # file name relative to the checkpoint root
    begin: int  # byte offset in the file's data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


@dataclass(frozen=True)
class SafetensorsHeader:
    file: str
    size: int
    header_len: int
    metadata: dict[str, str]
    tensors: tuple[TensorInfo, ...]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json``'s ``object_pairs_hook``: the object, or :class:`_DuplicateKey` when two of its keys are
    equal once parsed (``"data_offsets"`` and ``"data\\u005foffsets"`` are the same key)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


class _DuplicateKey(ValueError):
    pass


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-standard JSON constant {name}")


def loads_json(data: bytes, what: str, *, error: type[Exception] = HeaderError, strict_keys: bool = True) -> Any:
    """Decode untrusted JSON: UTF-8 only, no duplicate keys, no NaN/Infinity, bounded nesting.

    With ``strict_keys`` every object is checked for duplicate keys (slower); callers that can
    detect duplicates more cheaply (see :func:`read_safetensors_header`) pass ``False``.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        if strict_keys:
            return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
        return json.loads(text, parse_constant=_reject_constant)
    except _DuplicateKey as exc:
        raise error(f"{what}: duplicate key {exc.args[0]!r}") from None
    except RecursionError:
        raise error(f"{what}: JSON nested too deeply") from None
    except ValueError as exc:
        raise error(f"{what}: not valid JSON ({exc})") from None


def read_safetensors_header(path: Path, rel_name: str) -> SafetensorsHeader:
    """Parse a safetensors header: 8-byte little-endian length, then that many bytes of JSON."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) < 8:
                raise HeaderError(f"{rel_name}: file is {size} bytes, too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_SAFETENSORS_HEADER:
                raise HeaderError(
                    f"{rel_name}: header length {header_len} exceeds the {MAX_SAFETENSORS_HEADER}-byte cap"
                )
            if 8 + header_len > size:
                raise HeaderError(
                    f"{rel_name}: header claims {header_len} bytes but the file has only {size - 8} after the length"
                )
            blob = fh.read(header_len)
    except OSError as exc:
        raise HeaderError(f"{rel_name}: cannot read ({exc.strerror})") from None
    if len(blob) != header_len:
        raise HeaderError(f"{rel_name}: truncated header")
    parsed = loads_json(blob, f"{rel_name} header", strict_keys=False)
    if not isinstance(parsed, dict):
        raise HeaderError(f"{rel_name}: header is a JSON {type(parsed).__name__}, expected an object")
    if not _no_duplicate_keys(blob, parsed):
        # perhaps a duplicate key (at any level, spelled with escapes or not) that json.loads collapsed:
        # the strict parse, on the parsed keys, decides
        loads_json(blob, f"{rel_name} header")
    data_size = size - 8 - header_len
    metadata: dict[str, str] = {}
    raw_meta = parsed.pop("__metadata__", None)
    if raw_meta is not None:
        if not isinstance(raw_meta, dict) or not all(isinstance(v, str) for v in raw_meta.values()):
            raise HeaderError(f"{rel_name}: __metadata__ must map strings to strings")
        metadata = dict(raw_meta)
    tensors = _tensor_infos(parsed, rel_name, data_size)
    _check_overlaps(tensors, rel_name)
    return SafetensorsHeader(rel_name, size, header_len, metadata, tuple(tensors))


def _no_duplicate_keys(blob: bytes, parsed: dict[str, Any]) -> bool:
    """True when the parse of ``blob`` (``parsed``, by a plain ``json.loads``) provably collapsed no
    duplicate key; False when it may have (the strict parse then decides).

    Every key in the text is followed by exactly one ``:`` byte outside any string, and no other byte
    outside strings is one (a ``:`` inside a string only adds to the count; an escape such as
    ``\\u003a`` is no ``:`` byte; UTF-8 never puts 0x3A inside a character), so the count of ``:`` bytes
    is at least the number of keys written, whatever the escapes. The keys of the top-level object and
    of its objects one level down (the tensors' entries, ``__metadata__``) are at most the keys parsed,
    which are the keys written less those a duplicate collapsed. Equal counts leave no room for a
    duplicate at any level (keys of objects deeper down are in the first count only, so any such object
    sends the header to the strict parse). Cheaper than ``object_pairs_hook`` on every object of every
    header, which the strict parse runs when the counts differ."""
    entries = list(parsed.values())
    if not set(map(type, entries)) <= {dict}:
        return False
    return blob.count(b":") == len(parsed) + sum(map(len, entries))


def _tensor_info(name: str, entry: Any, rel_name: str, data_size: int) -> TensorInfo:
    where = f"{rel_name}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise HeaderError(f"{where}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPE_BITS:
        raise HeaderError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**53 for d in shape
    ):
        raise HeaderError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise HeaderError(f"{where}: data_offsets must be [begin, end], got {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise HeaderError(f"{where}: data_offsets {offsets} are not 0 <= begin <= end")
    if end > data_size:
        raise HeaderError(f"{where}: data ends at byte {end}, past the end of the file's data ({data_size} bytes)")
    bits = SAFETENSORS_DTYPE_BITS[dtype] * math.prod(shape)
    if (bits + 7) // 8 != end - begin:
        raise HeaderError(f"{where}: {dtype}{shape} needs {(bits + 7) // 8} bytes but data_offsets span {end - begin}")
    return TensorInfo(name, dtype, tuple(shape), rel_name, begin, end)


def _tensor_infos(parsed: dict[str, Any], rel_name: str, data_size: int) -> list[TensorInfo]:
    """Validate every entry with column-wise C-level checks; on any doubt, fall back to
    :func:`_tensor_info` per entry, which raises the precise error."""
    names = list(parsed)
    entries = list(parsed.values())
    try:
        dtypes = list(map(_get_dtype, entries))
        shapes = list(map(_get_shape, entries))
        offsets = list(map(_get_offsets, entries))
        dims = list(chain.from_iterable(shapes))
        if (
            set(map(type, shapes)) <= {list}
            and set(map(type, offsets)) <= {list}
            and set(map(len, offsets)) <= {2}
            and set(map(type, dims)) <= {int}
            and min(dims, default=0) >= 0
            and set(dtypes) <= _KNOWN_DTYPES
        ):
            begins = list(map(_first, offsets))
            ends = list(map(_second, offsets))
            bits = list(map(operator.mul, map(SAFETENSORS_DTYPE_BITS.__getitem__, dtypes), map(math.prod, shapes)))
            if (
                set(map(type, begins)) | set(map(type, ends)) <= {int}
                and min(begins, default=0) >= 0
                and max(ends, default=0) <= data_size
                and list(map(operator.sub, ends, begins))
                == list(
                    map(operator.floordiv, bits, repeat(8))
                    if _WHOLE_BYTES.issuperset(dtypes)
                    else map(_ceil_bytes, bits)
                )
            ):
                rows = zip(names, dtypes, map(tuple, shapes), repeat(rel_name), begins, ends)
                return list(map(_new_info, repeat(TensorInfo), rows))
    except (KeyError, TypeError, ValueError):
        pass
    return [_tensor_info(name, entry, rel_name, data_size) for name, entry in zip(names, entries, strict=False)]


_KNOWN_DTYPES = frozenset(SAFETENSORS_DTYPE_BITS)
_WHOLE_BYTES = frozenset(k for k, v in SAFETENSORS_DTYPE_BITS.items() if v % 8 == 0)
_get_dtype = operator.itemgetter("dtype")
_get_shape = operator.itemgetter("shape")
_get_offsets = operator.itemgetter("data_offsets")
_new_info = tuple.__new__  # TensorInfo from a row tuple, without NamedTuple._make's Python frame
_first = operator.itemgetter(0)
_second = operator.itemgetter(1)


def _ceil_bytes(bits: int) -> int:
    return (bits + 7) >> 3


def _check_overlaps(tensors: list[TensorInfo], rel_name: str) -> None:
    begins = list(map(_begin, tensors))
    ends = list(map(_end, tensors))
    if all(map(operator.le, begins, begins[1:])) and all(map(operator.le, ends, begins[1:])):
        return  # the usual layout: data in header order, no gaps needed
    spans = sorted(zip(begins, ends, strict=True))
    if all(map(operator.le, [e for _, e in spans[:-1]], [b for b, _ in spans[1:]])):
        return
    nonempty = sorted((t.begin, t.end, t.name) for t in tensors if t.end > t.begin)
    for (_b0, e0, n0), (b1, _e1, n1) in pairwise(nonempty):
        if b1 < e0:
            raise HeaderError(f"{rel_name}: tensors {n0!r} and {n1!r} overlap")


_begin = operator.attrgetter("begin")
_end = operator.attrgetter("end")


# --------------------------------------------------------------------------------------- GGUF

GGUF_MAGIC = b"GGUF"
MAX_GGUF_STRING = 16 * 1024 * 1024
MAX_GGUF_DIMS = 8
#: the most bytes a GGUF header (magic to the end of the tensor infos) may span; real headers,
#: vocabulary and merges included, are under 20 MiB. Reading a header never goes past it,
#: whatever counts and lengths the file declares.
MAX_GGUF_HEADER = 128 * 1024 * 1024
#: the most items one GGUF metadata array may hold (real vocabularies and merges: under 1M).
MAX_GGUF_ARRAY = 2 * 1024 * 1024
#: metadata arrays longer than this are summarised (length only) rather than kept.
GGUF_KEEP_ARRAY = 64

#: ggml type id -> (name, elements per block, bytes per block). From llama.cpp's ggml.h.
GGUF_TYPE_SIZES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}

_GGUF_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne[0] (fastest) first
    type_id: int
    offset: int  # relative to the data section

    @property
    def type_name(self) -> str:
        return GGUF_TYPE_SIZES.get(self.type_id, (f"type{self.type_id}", 0, 0))[0]


class GGUFSkippedArray(NamedTuple):
    """A GGUF metadata array the header parser walked but did not keep."""

    item_type: int
    offset: int  # of the first item, in the file
    n_items: int
    starts: array[int] | None  # strings: each one's offset (its uint64 length), then where the last one ends


@dataclass(frozen=True)
class GGUFHeader:
    file: str
    size: int
    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[GGUFTensorInfo, ...]
    data_offset: int = field(default=0)
    #: the arrays summarised rather than kept (longer than ``GGUF_KEEP_ARRAY``), where they are in the file, for
    #: a reader that decodes them when asked
    skipped_arrays: dict[str, GGUFSkippedArray] = field(default_factory=dict)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None


class _Reader:
    """Bounded sequential reader over a file: every read is checked against the file size."""

    def __init__(self, fh: BinaryIO, size: int, name: str) -> None:
        self.fh, self.size, self.name = fh, size, name
        self.pos = 0
        self.key = ""  # the metadata key (or tensor) being read, for errors
        self._buf = b""
        self._buf_start = 0
        self.skipped: dict[str, GGUFSkippedArray] = {}

    def _check(self, n: int) -> None:
        """``n`` more bytes fit in the file and in the header budget (checked before reading)."""
        where = f" (in {self.key!r})" if self.key else ""
        if n < 0 or self.pos + n > self.size:
            raise HeaderError(f"{self.name}: GGUF header runs past the end of the file at byte {self.pos}{where}")
        if self.pos + n > MAX_GGUF_HEADER:
            raise HeaderError(
                f"{self.name}: GGUF header{where} runs past {MAX_GGUF_HEADER} bytes, "
                f"the most a header may span (the file claims more than any real header holds)"
            )

    def read(self, n: int) -> bytes:
        self._check(n)
        end_in_buf = self.pos - self._buf_start + n
        if self.pos < self._buf_start or end_in_buf > len(self._buf):
            self.fh.seek(self.pos)
            self._buf = self.fh.read(max(n, 1 << 20))
            self._buf_start = self.pos
        start = self.pos - self._buf_start
        out = self._buf[start : start + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, n: int) -> Any:
        return struct.unpack(fmt, self.read(n))[0]

    def string(self) -> str:
        length = self.unpack("<Q", 8)
        if length > MAX_GGUF_STRING:
            raise HeaderError(f"{self.name}: GGUF string of {length} bytes at byte {self.pos}")
        raw = self.read(length)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise HeaderError(f"{self.name}: GGUF string at byte {self.pos - length} is not UTF-8") from None

    def skip_strings(self, count: int) -> array[int]:
        """Move past ``count`` strings, not decoded (their bytes are never looked at), in one tight loop (a
        vocabulary has 100k-250k) over local variables: each length read from the buffer, bounds and budget
        checked as it goes. Returns where each string (its length) starts, then where the last one ends."""
        starts = array("q", bytes(8 * (count + 1)))
        unpack_from = _U64.unpack_from
        limit = min(self.size, MAX_GGUF_HEADER)
        buf, buf_start, pos = self._buf, self._buf_start, self.pos
        buf_end = buf_start + len(buf)
        for i in range(count):
            if pos + 8 > buf_end or pos < buf_start:
                self.pos = pos
                self._check(8)
                self.fh.seek(pos)
                buf = self._buf = self.fh.read(1 << 20)
                buf_start = self._buf_start = pos
                buf_end = pos + len(buf)
            (length,) = unpack_from(buf, pos - buf_start)
            if length > MAX_GGUF_STRING:
                self.pos = pos
                raise HeaderError(f"{self.name}: GGUF string of {length} bytes at byte {pos + 8} (in {self.key!r})")
            if pos + 8 + length > limit:
                self.pos = pos
                self._check(8 + length)  # raises, naming the key and which bound
            starts[i] = pos
            pos += 8 + length
        starts[count] = self.pos = pos
        return starts

    def skip(self, n: int) -> None:
        """Move past ``n`` bytes without reading them (bounds and budget checked)."""
        self._check(n)
        self.pos += n

    def value(self, vtype: int, key: str, lengths: dict[str, int]) -> Any:
        if vtype in _GGUF_SCALARS:
            fmt, n = _GGUF_SCALARS[vtype]
            return self.unpack(fmt, n)
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            item_type = self.unpack("<I", 4)
            count = self.unpack("<Q", 8)
            min_item = 8 if item_type == _GGUF_STRING else _GGUF_SCALARS.get(item_type, ("", 1))[1]
            if item_type == _GGUF_ARRAY or (item_type not in _GGUF_SCALARS and item_type != _GGUF_STRING):
                raise HeaderError(f"{self.name}: GGUF key {key!r} has an array of unsupported type {item_type}")
            if count * min_item > self.size - self.pos:
                raise HeaderError(f"{self.name}: GGUF array {key!r} claims {count} items, more than the file holds")
            if count > MAX_GGUF_ARRAY:
                raise HeaderError(
                    f"{self.name}: GGUF array {key!r} claims {count} items, more than the {MAX_GGUF_ARRAY} "
                    f"a header array may hold"
                )
            self._check(count * min_item)  # the budget, before walking it
            lengths[key] = count
            if item_type in _GGUF_SCALARS and item_type != _GGUF_STRING:
                fmt, n = _GGUF_SCALARS[item_type]
                if count > GGUF_KEEP_ARRAY:  # only summarised: skipped, never read
                    self.skipped[key] = GGUFSkippedArray(item_type, self.pos, count, None)
                    self.skip(n * count)
                    return None
                raw = self.read(n * count)
                return list(struct.unpack("<" + fmt[1] * count, raw))
            if count <= GGUF_KEEP_ARRAY:
                return [self.string() for _ in range(count)]
            start = self.pos  # a vocabulary or merges list: only summarised, so not decoded
            self.skipped[key] = GGUFSkippedArray(item_type, start, count, self.skip_strings(count))
            return None
        raise HeaderError(f"{self.name}: GGUF key {key!r} has unknown value type {vtype}")


def read_gguf_header(path: Path, rel_name: str) -> GGUFHeader:
    """Parse a GGUF file's header: magic, version, metadata and tensor infos (no tensor data).

    Large metadata arrays (the tokenizer's vocabulary) are walked to find the header's end but
    only their lengths are kept.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            return _parse_gguf(_Reader(fh, size, rel_name), rel_name, size)
    except OSError as exc:
        raise HeaderError(f"{rel_name}: cannot read ({exc.strerror})") from None
    except struct.error as exc:  # pragma: no cover - _Reader checks lengths first
        raise HeaderError(f"{rel_name}: malformed GGUF header ({exc})") from None


def _parse_gguf(r: _Reader, rel_name: str, size: int) -> GGUFHeader:
    if r.read(4) != GGUF_MAGIC:
        raise HeaderError(f"{rel_name}: not a GGUF file (bad magic)")
    version = r.unpack("<I", 4)
    if version not in (2, 3):
        raise HeaderError(f"{rel_name}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = r.unpack("<Q", 8)
    n_kv = r.unpack("<Q", 8)
    if n_tensors > size // 24 or n_kv > size // 12:
        raise HeaderError(f"{rel_name}: GGUF header claims {n_tensors} tensors and {n_kv} keys; the file is too small")
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(n_kv):
        r.key = ""
        key = r.string()
        r.key = key
        vtype = r.unpack("<I", 4)
        if key in metadata:
            raise HeaderError(f"{rel_name}: duplicate GGUF key {key!r}")
        metadata[key] = r.value(vtype, key, lengths)
    tensors: list[GGUFTensorInfo] = []
    seen: set[str] = set()
    for _ in range(n_tensors):
        r.key = ""
        name = r.string()
        r.key = name
        if name in seen:
            raise HeaderError(f"{rel_name}: duplicate GGUF tensor {name!r}")
        seen.add(name)
        n_dims = r.unpack("<I", 4)
        if n_dims > MAX_GGUF_DIMS:
            raise HeaderError(f"{rel_name}: GGUF tensor {name!r} has {n_dims} dimensions")
        shape = tuple(r.unpack("<Q", 8) for _ in range(n_dims))
        type_id = r.unpack("<I", 4)
        offset = r.unpack("<Q", 8)
        tensors.append(GGUFTensorInfo(name, shape, type_id, offset))
    r.key = ""
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise HeaderError(f"{rel_name}: general.alignment {alignment!r} is not a power of two")
    data_offset = -(-r.pos // alignment) * alignment
    expected: int | None = 0
    for t in tensors:
        nbytes = _check_gguf_tensor(t, rel_name, size, data_offset)
        if expected is not None and t.offset != expected:
            # llama.cpp's rule (gguf_init_from_file): tensor data in declaration order, each padded
            # to the alignment, no gaps. Anything else can alias another tensor's bytes.
            raise HeaderError(
                f"{rel_name}: GGUF tensor {t.name!r} has data offset {t.offset}, expected {expected} "
                f"(tensors must follow each other in order, padded to {alignment} bytes)"
            )
        if expected is not None and nbytes is not None:
            expected += -(-nbytes // alignment) * alignment
        else:
            expected = None
    return GGUFHeader(rel_name, size, version, metadata, lengths, tuple(tensors), data_offset, r.skipped)


def _check_gguf_tensor(t: GGUFTensorInfo, rel_name: str, size: int, data_offset: int) -> int | None:
    """The tensor's data size in bytes, checked against the file; None for a type it cannot size."""
    info = GGUF_TYPE_SIZES.get(t.type_id)
    if info is None:
        return None  # unknown type: the loader names it; the probe cannot size it
    _name, block, block_bytes = info
    numel = math.prod(t.shape)
    if t.shape and t.shape[0] % block:
        raise HeaderError(f"{rel_name}: GGUF tensor {t.name!r} row of {t.shape[0]} is not a multiple of {block}")
    nbytes = numel // block * block_bytes
    if data_offset + t.offset + nbytes > size:
        raise HeaderError(f"{rel_name}: GGUF tensor {t.name!r} data runs past the end of the file")
    return nbytes
