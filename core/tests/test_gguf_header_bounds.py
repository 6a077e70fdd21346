"""Reading a GGUF header stays bounded by the header budget, whatever counts and lengths the file claims.

The files are sparse (``truncate``): hundreds of MiB on paper, nothing on disk. What is bounded is
measured as bytes read through a counting file, never as wall time.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import Any

import pytest

from anyquant.errors import HeaderError
from anyquant.headers import MAX_GGUF_ARRAY, MAX_GGUF_HEADER, _parse_gguf, _Reader, read_gguf_header

MiB = 1024 * 1024
#: a reader that reads more than this for a header of a few bytes is walking the file.
READ_BOUND = 4 * MiB


class CountingFile(io.RawIOBase):
    """A file that counts the bytes read through it, and fails the test once they pass a bound."""

    def __init__(self, fh: Any, bound: int) -> None:
        self.fh, self.bound, self.bytes_read = fh, bound, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        return int(self.fh.seek(pos, whence))

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.fh.read(n)
        self.bytes_read += len(data)
        assert self.bytes_read <= self.bound, f"read {self.bytes_read} bytes of a header declared in a few"
        return data


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def _sparse_gguf(path: Path, head: bytes, size: int) -> Path:
    path.write_bytes(head)
    with path.open("r+b") as fh:
        fh.truncate(size)  # the rest is a hole: zeros that take no disk
    return path


def _parse_counting(path: Path) -> tuple[Exception | None, int]:
    size = path.stat().st_size
    with path.open("rb") as raw:
        fh = CountingFile(raw, READ_BOUND)
        try:
            _parse_gguf(_Reader(fh, size, path.name), path.name, size)  # type: ignore[arg-type]
        except HeaderError as exc:
            return exc, fh.bytes_read
    return None, fh.bytes_read


def test_huge_string_array_is_refused_before_walking_it(tmp_path: Path) -> None:
    """The issue's case: a 400 MiB sparse file whose one key is a string array of 50M (empty) strings."""
    count = 50_000_000
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _key("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, count)
    path = _sparse_gguf(tmp_path / "big.gguf", head, 400 * MiB)
    exc, read = _parse_counting(path)
    assert isinstance(exc, HeaderError)
    assert "tokenizer.ggml.tokens" in str(exc) and str(MAX_GGUF_ARRAY) in str(exc)
    assert read <= READ_BOUND
    with pytest.raises(HeaderError, match=r"tokenizer\.ggml\.tokens"):
        read_gguf_header(path, path.name)


def test_string_array_within_count_limit_stops_at_the_header_budget(tmp_path: Path) -> None:
    """Strings that each claim a few MiB: the walk stops at the header budget, naming the key."""
    count = 1000
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _key("tokenizer.ggml.merges") + struct.pack("<IIQ", 9, 8, count)
    # each string claims 1 MiB (the zeros after the length are its bytes); the lengths sit at every
    # 1 MiB + 8: write them sparsely, so the walk would otherwise span 1000 MiB.
    path = tmp_path / "long.gguf"
    path.write_bytes(head)
    with path.open("r+b") as fh:
        pos = len(head)
        for _ in range(count):
            fh.seek(pos)
            fh.write(struct.pack("<Q", MiB))
            pos += 8 + MiB
        fh.truncate(pos + 64)
    with pytest.raises(HeaderError, match=r"tokenizer\.ggml\.merges.*" + str(MAX_GGUF_HEADER)):
        read_gguf_header(path, path.name)


def test_numeric_array_is_skipped_not_read(tmp_path: Path) -> None:
    """A long numeric array (scores, token types) is summarised by its length: its bytes are not read."""
    count = MAX_GGUF_ARRAY  # 16 MiB of int64: allowed, but never read
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + _key("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 11, count)
    tail_at = len(head) + 8 * count
    path = _sparse_gguf(tmp_path / "scores.gguf", head, tail_at)
    with path.open("r+b") as fh:
        fh.seek(tail_at)
        fh.write(_key("general.architecture") + struct.pack("<I", 8) + _key("llama"))
    exc, read = _parse_counting(path)
    assert exc is None
    assert read <= READ_BOUND
    header = read_gguf_header(path, path.name)
    assert header.array_lengths == {"tokenizer.ggml.scores": count}
    assert header.architecture == "llama"


@pytest.mark.parametrize("bad", ["overlong", "past_end"])
def test_long_string_array_with_a_bad_string_names_it(tmp_path: Path, bad: str) -> None:
    """A vocabulary walked without decoding (over GGUF_KEEP_ARRAY strings): a string longer than a GGUF string
    may be, or one running past the end of the file, is a HeaderError naming the key and the byte."""
    count = 100
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _key("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, count)
    strings = [struct.pack("<Q", 3) + b"abc" for _ in range(count)]
    at = len(head) + sum(len(s) for s in strings[:70])
    claim = 17 * MiB if bad == "overlong" else 10 * MiB
    strings[70] = struct.pack("<Q", claim) + b"abc"
    path = tmp_path / "bad.gguf"
    path.write_bytes(head + b"".join(strings))
    pattern = f"string of {claim} bytes at byte {at + 8}" if bad == "overlong" else f"end of the file at byte {at}"
    with pytest.raises(HeaderError, match=pattern + r".*tokenizer\.ggml\.tokens|" + pattern):
        read_gguf_header(path, path.name)
