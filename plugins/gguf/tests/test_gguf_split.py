"""A GGUF model split by llama.cpp's gguf-split (``split.no`` / ``split.count`` / ``split.tensors.count``
metadata, each part holding some of the tensors): detected as GGUF, and refused at load with what to do,
whether the directory, one part or the first part is given (it used to say "pass the path of one", and one
part then failed on the tensors held by the others)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import anyquant
from anyquant.testing.fixtures import write_gguf

META = {"general.architecture": "llama", "llama.block_count": 1, "llama.embedding_length": 8}


def _split(root: Path, count: int = 3) -> list[Path]:
    parts = []
    for no in range(count):
        meta = {**(META if no == 0 else {}), "split.no": no, "split.count": count, "split.tensors.count": count}
        name = f"tiny-{no + 1:05d}-of-{count:05d}.gguf"
        parts.append(write_gguf(root / name, meta, {f"blk.0.t{no}.weight": (0, [8, 8])}))
    return parts


def test_split_parts_are_detected_and_refused_with_the_merge_command(tmp_path: Path) -> None:
    parts = _split(tmp_path / "m")
    for path, number in ((tmp_path / "m", 1), (parts[0], 1), (parts[2], 3)):
        detection = anyquant.detect(path)
        assert detection.format == "gguf"
        problem = f"is part {number} of a GGUF model split into 3 files"
        assert any(problem in p for p in detection.details["problems"])
        with pytest.raises(anyquant.CheckpointError, match=f"{problem}.*llama-gguf-split --merge"):
            anyquant.load(path)


def test_one_file_gguf_with_split_count_one_is_not_a_part(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "one.gguf", {**META, "split.no": 0, "split.count": 1}, {"t.weight": (0, [8])})
    detection = anyquant.detect(path)
    assert detection.format == "gguf" and detection.details["problems"] == []


def test_a_cached_repository_with_several_ggufs_is_named_by_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF repository in the Hugging Face cache holds one file per quantization: the error names the
    model-id form of one file, and that form detects the file alone."""
    snap = tmp_path / "hub" / "models--org--tiny-GGUF" / "snapshots" / ("ab" * 20)
    for name in ("tiny.Q4_0.gguf", "tiny.Q8_0.gguf"):
        write_gguf(snap / name, META, {"t.weight": (0, [8])})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    hint = "(or by model id: org/tiny-GGUF/tiny.Q4_0.gguf)"
    assert any(hint in p for p in anyquant.detect("org/tiny-GGUF").details["problems"])
    with pytest.raises(anyquant.CheckpointError, match=re.escape(hint)):
        anyquant.load("org/tiny-GGUF")
    one = anyquant.detect("org/tiny-GGUF/tiny.Q8_0.gguf")
    assert one.details["files"] == ["tiny.Q8_0.gguf"] and one.details["problems"] == []
