"""Issue #44 item 7: a duplicate key written through a JSON escape (``"data\\u005foffsets"``, a tensor
name spelled ``"\\u0061"``) is a duplicate: the check runs on the parsed keys, at every level of a
safetensors header, as the safetensors library's does, and is a typed ``HeaderError``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from anyquant import Probe
from anyquant.errors import HeaderError
from anyquant.headers import read_safetensors_header

A = '{"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}'
B = '{"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}'

DUPLICATES = {
    # the first [0, 4] was silently dropped: the tensor read bytes 4..8
    "offsets by escape": '{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4], "data\\u005foffsets": [4, 8]}}',
    "dtype by escape": '{"a": {"dtype": "F32", "\\u0064type": "F16", "shape": [2], "data_offsets": [0, 4]}}',
    "shape": '{"a": {"dtype": "F16", "shape": [1], "shape": [2], "data_offsets": [0, 4]}}',
    "tensor name by escape": f'{{"a": {A}, "\\u0061": {B}}}',
    # the escape on both the name and the offsets: the raw count of "data_offsets" saw one tensor
    "name and offsets by escape": (
        '{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},'
        ' "\\u0061": {"dtype": "F16", "shape": [2], "data\\u005foffsets": [4, 8]}}'
    ),
    "__metadata__ twice": f'{{"__metadata__": {{"format": "pt"}}, "__metadata__": {{"format": "np"}}, "a": {A}}}',
    "__metadata__ by escape": f'{{"__metadata__": {{"format": "pt"}}, "__meta\\u0064ata__": {{}}, "a": {A}}}',
    "a metadata key": f'{{"__metadata__": {{"format": "pt", "format": "np"}}, "a": {A}}}',
    "a metadata key by escape": f'{{"__metadata__": {{"format": "pt", "\\u0066ormat": "np"}}, "a": {A}}}',
    "deeper, in an extra field": (
        '{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4], "x": [{"k": 1, "\\u006b": 2}]}}'
    ),
}


def _file(path: Path, header: str, data: bytes = b"\0" * 8) -> Path:
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("compact", [False, True], ids=["spaced", "compact"])
@pytest.mark.parametrize("header", list(DUPLICATES.values()), ids=list(DUPLICATES))
def test_a_key_duplicated_through_an_escape_is_a_header_error(tmp_path: Path, header: str, compact: bool) -> None:
    if compact:  # the layout the safetensors library writes
        header = header.replace(": ", ":").replace(", ", ",")
    json.loads(header)  # valid JSON: only the duplicate is wrong
    path = _file(tmp_path / "model.safetensors", header)
    with pytest.raises(HeaderError, match="duplicate key"):
        read_safetensors_header(path, "model.safetensors")
    with pytest.raises(HeaderError, match="duplicate key"):
        Probe.open(tmp_path)


def test_the_safetensors_library_refuses_the_escaped_duplicate_too(tmp_path: Path) -> None:
    from safetensors import safe_open

    path = _file(tmp_path / "model.safetensors", DUPLICATES["offsets by escape"])
    with pytest.raises(Exception, match="duplicate field"), safe_open(path, "np"):
        pass


@pytest.mark.parametrize(
    "header",
    [
        # escapes and colons inside strings are not keys: these headers are valid and read as before
        f'{{"__metadata__": {{"url": "https://x.org/a:b", "t": "12:00:00", "q": "\\":\\""}}, "a": {A}}}',
        '{"\\u0061": {"dtype": "F16", "shape": [2], "data\\u005foffsets": [0, 4]}, "b:c": ' + B + "}",
        f'{{"a" : {A} ,\n "b"\t:\n{B}}}',
    ],
    ids=["colons in metadata", "escaped names, colon in a name", "whitespace before colons"],
)
def test_valid_headers_with_escapes_and_colons_still_read(tmp_path: Path, header: str) -> None:
    path = _file(tmp_path / "model.safetensors", header)
    h = read_safetensors_header(path, "model.safetensors")
    assert {t.name: (t.begin, t.end) for t in h.tensors} == dict(
        (name, (e["data_offsets"][0], e["data_offsets"][1])) for name, e in json.loads(header).items() if name[0] != "_"
    )
