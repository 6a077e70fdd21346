"""A GGUF model split by llama.cpp's gguf-split (issue #42 §2): ``NAME-0000K-of-0000N.gguf``, each part a whole GGUF
with the ``split.no`` / ``split.count`` / ``split.tensors.count`` keys and its own tensors, the first part holding
the metadata. It loads from its first part, a later part or its directory, as llama.cpp loads it: the metadata from
the first part, every tensor mapped from its own part (nothing merged or copied on disk), every part's header
checked. ``detect``/``inspect`` name the parts.

The split files are written by ``gguf.GGUFWriter``'s own split support (``split_max_tensors``, and
``small_first_shard``: the layout of gguf-split's ``--no-tensor-first-split``, a first part with no tensor), beside
the same model written whole: the split load's weights and logits equal the whole file's bit for bit. Damaged or
hostile sets (a part missing, another split count, a tensor in two parts, a part numbered wrongly, a tensor past its
part's end, a split.count of 0, -1, 10**9 or a string) are typed errors that name the part, with bounded work.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

import anyquant
from anyquant.errors import AnyquantError, CheckpointError, HeaderError, MissingTensorError
from anyquant.testing.fixtures import write_gguf
from anyquant_gguf.metadata import GGUFMetadataError
from anyquant_gguf.reader import hf_state_dict, open_gguf, release_pages
from anyquant_gguf.split import GGUFSplitError, part_name, split_name_parts, split_prefix
from anyquant_gguf.tokenizer import byte_alphabet

Q = GGMLQuantizationType
HIDDEN, FFN, VOCAB, LAYERS = 64, 128, 320, 2
META = {"general.architecture": "llama", "llama.block_count": 1, "llama.embedding_length": 8}


# --------------------------------------------------------------------------- a tiny Llama, whole and split


def _tensors() -> Iterator[tuple[str, np.ndarray, Q]]:
    """The tiny Llama's tensors (the same bytes on every call): Q4_0 attention and gate/up (cpu-fast's int4
    kernel), Q8_0 down and head, F16 embedding, F32 norms."""
    rng = np.random.default_rng(0)

    def value(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    yield "token_embd.weight", value(VOCAB, HIDDEN), Q.F16
    for layer in range(LAYERS):
        yield f"blk.{layer}.attn_norm.weight", 1 + value(HIDDEN), Q.F32
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            yield f"blk.{layer}.{name}.weight", value(HIDDEN, HIDDEN), Q.Q4_0
        yield f"blk.{layer}.ffn_norm.weight", 1 + value(HIDDEN), Q.F32
        yield f"blk.{layer}.ffn_gate.weight", value(FFN, HIDDEN), Q.Q4_0
        yield f"blk.{layer}.ffn_up.weight", value(FFN, HIDDEN), Q.Q4_0
        yield f"blk.{layer}.ffn_down.weight", value(HIDDEN, FFN), Q.Q8_0
    yield "output_norm.weight", 1 + value(HIDDEN), Q.F32
    yield "output.weight", value(VOCAB, HIDDEN), Q.Q8_0


N_TENSORS = 3 + 9 * LAYERS


def _write_model(path: Path, **split: Any) -> Path:
    """The tiny Llama (byte-level tokenizer) at ``path``; ``split``: GGUFWriter's split options (the parts are then
    ``<stem>-0000K-of-0000N.gguf`` beside ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), "llama", **split)
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(2)  # MOSTLY_Q4_0
    vocab = [*byte_alphabet(), *(f"x{i}" for i in range(VOCAB - 257)), "Ġt"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * len(vocab))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, array, qtype in _tensors():
        if qtype == Q.F32:
            writer.add_tensor(name, array)
        elif qtype == Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


#: the split layouts: (name, GGUFWriter options, part count)
LAYOUTS = {
    "2-parts": ({"split_max_tensors": 11}, 2),
    "3-parts": ({"split_max_tensors": 8}, 3),
    "no-tensor-first": ({"split_max_tensors": 11, "small_first_shard": True}, 3),
}


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_model(tmp_path_factory.mktemp("whole") / "tiny.gguf")


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def split(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    options, count = LAYOUTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    _write_model(folder / "tiny.gguf", **options)
    parts = sorted(folder.glob("*.gguf"))
    assert [p.name for p in parts] == [part_name("tiny", i, count) for i in range(count)]
    return parts


def _split_copy(tmp_path: Path, count: int = 3) -> list[Path]:
    options = {2: {"split_max_tensors": 11}, 3: {"split_max_tensors": 8}}[count]
    _write_model(tmp_path / "m" / "tiny.gguf", **options)
    return sorted((tmp_path / "m").glob("*.gguf"))


def _load(path: Path, backend: str, **extra: Any) -> Any:
    return anyquant.load(path, backend=backend, device="cpu", **extra)


_IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 11, 300, 319, 4]])


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.module(_IDS).logits


def _dense_state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


# --------------------------------------------------------------------------- names, as llama.cpp's


def test_part_names_are_llama_cpps() -> None:
    """``llama_split_path`` / ``llama_split_prefix``: ``%s-%05d-of-%05d.gguf``, 1-based; the prefix only when the
    number and count match."""
    assert part_name("/m/ggml-model-q4_0", 1, 4) == "/m/ggml-model-q4_0-00002-of-00004.gguf"
    assert split_prefix("ggml-model-q4_0-00002-of-00004.gguf", 1, 4) == "ggml-model-q4_0"
    assert split_prefix("ggml-model-q4_0-00002-of-00004.gguf", 0, 4) is None
    assert split_prefix("-00001-of-00002.gguf", 0, 2) is None  # no prefix: llama.cpp's size_prefix > 0
    assert split_name_parts("a-b-00003-of-00012.gguf") == ("a-b", 2, 12)
    assert split_name_parts("a-00000-of-00002.gguf") is None and split_name_parts("a.gguf") is None


# --------------------------------------------------------------------------- the split load equals the whole one


def test_split_reader_equals_whole(whole: Path, split: list[Path]) -> None:
    """The reader: the first part's metadata, every part's tensors, each viewing its own part's map (zero-copy),
    bit-identical to the whole file's; opening a later part opens the same model."""
    ours, want = open_gguf(split[0]), open_gguf(whole)
    assert [p.path for p in ours.parts] == [str(p) for p in split]
    assert [t.name for t in ours.tensors] == [t.name for t in want.tensors]
    for key, field in want.fields.items():
        if not key.startswith("split."):
            assert ours.fields[key].contents() == field.contents(), key
    for t, w in zip(ours.tensors, want.tensors, strict=True):
        assert t.tensor_type == w.tensor_type and np.array_equal(t.data.view(np.uint8), w.data.view(np.uint8))
        part = t._file
        assert part.path in {str(p) for p in split}
        base = part.data.ctypes.data
        assert base <= t.data.ctypes.data < base + part.data.nbytes  # in its own part's map
    got, expected = hf_state_dict(ours), hf_state_dict(want)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    later = open_gguf(split[-1])
    assert [p.path for p in later.parts] == [str(p) for p in split]
    release_pages(ours)  # every part's map: no error, values kept
    assert torch.equal(hf_state_dict(ours)["lm_head.weight"], expected["lm_head.weight"])


@pytest.mark.parametrize("backend", ["dequantized", "cpu-fast"])
def test_split_load_equals_whole(whole: Path, split: list[Path], backend: str) -> None:
    """``anyquant.load`` of the first part, and of the directory: the whole file's weights and logits, bit for bit."""
    if backend == "cpu-fast":
        fastcpu = pytest.importorskip("anyquant_cpu.engine")
        ok, reason = fastcpu.fast_cpu_capable()
        if not ok:
            pytest.skip(reason)
    want = _load(whole, backend)
    want_logits, want_state = _logits(want), _dense_state(want)
    for path in (split[0], split[0].parent):
        got = _load(path, backend)
        assert got.backend == backend
        state = _dense_state(got)
        assert state.keys() == want_state.keys()
        for key, value in want_state.items():
            assert torch.equal(state[key], value), (path, key)
        assert torch.equal(_logits(got), want_logits), path
        if backend == "cpu-fast":
            assert got.info["cpu_fast"]["converted"] == want.info["cpu_fast"]["converted"] > 0
        text = got.generate("x t", max_new_tokens=4, temperature=0.0)
        assert text == want.generate("x t", max_new_tokens=4, temperature=0.0)
        got.close()
    want.close()


def test_a_later_part_loads_the_model_from_its_first(whole: Path, split: list[Path]) -> None:
    """A later part asked for: the model of its set (llama.cpp refuses one; the set is unambiguous), the detection
    saying so."""
    detection = anyquant.detect(split[-1])
    assert detection.details["parts"] == [p.name for p in split] and detection.details["problems"] == []
    assert any("is a later part: the model loads from its first part" in e for e in detection.evidence)
    got, want = _load(split[-1], "dequantized"), _load(whole, "dequantized")
    assert torch.equal(_logits(got), _logits(want))


def test_detect_and_inspect_name_the_parts(whole: Path, split: list[Path]) -> None:
    for path in (split[0], split[0].parent):
        detection = anyquant.detect(path)
        assert detection.format == "gguf" and detection.variant == "Q4_0"
        assert detection.details["parts"] == [p.name for p in split]
        assert detection.details["problems"] == []
        assert f"split in {len(split)} parts: {split[0].name}" in " ".join(detection.evidence)
        assert detection.details["tensor_types"] == anyquant.detect(whole).details["tensor_types"]
    rows = anyquant.inspect(split[0]).modules
    whole_rows = anyquant.inspect(whole).modules
    assert [(m.name, m.shape, m.nbytes) for m in rows] == [(m.name, m.shape, m.nbytes) for m in whole_rows]
    assert {m.extra["part"] for m in rows} <= {p.name for p in split}
    assert len({m.extra["part"] for m in rows}) == len(split) - (1 if "no-tensor-first" in str(split[0]) else 0)
    assert "part" not in whole_rows[0].extra


def test_llama_cpp_loads_the_split_fixture(whole: Path, split: list[Path]) -> None:
    """llama.cpp (its python binding, where installed) loads the split set from its first part with the whole
    file's logits."""
    llama_cpp = pytest.importorskip("llama_cpp")

    def logits(path: Path) -> np.ndarray:
        model = llama_cpp.Llama(str(path), n_ctx=32, logits_all=True, verbose=False)
        model.eval(_IDS[0].tolist())
        return np.array(model.scores[: _IDS.shape[1]])

    np.testing.assert_array_equal(logits(split[0]), logits(whole))


# --------------------------------------------------------------------------- damaged and hostile sets


def _raw_parts(root: Path, count: int = 3, **changes: dict[str, Any]) -> list[Path]:
    """Header-only parts written by hand: part ``i`` holds tensor ``blk.0.t{i}.weight``; ``changes``: per part name
    (``p1``, ``p2``...), metadata to set (``None`` drops a key) or ``tensors`` to use."""
    parts = []
    for no in range(count):
        meta: dict[str, Any] = {
            **(META if no == 0 else {}),
            "split.no": no,
            "split.count": count,
            "split.tensors.count": count,
        }
        tensors: dict[str, tuple[int, list[int]]] = {f"blk.0.t{no}.weight": (0, [8, 8])}
        change = dict(changes.get(f"p{no + 1}", {}))
        tensors = change.pop("tensors", tensors)
        meta = {k: v for k, v in {**meta, **change}.items() if v is not None}
        parts.append(write_gguf(root / part_name("tiny", no, count), meta, tensors))
    return parts


def _refused(path: Path, error: type[AnyquantError], match: str) -> None:
    """``load`` raises ``error`` matching ``match``; ``detect`` names the same problem."""
    with pytest.raises(error, match=match):
        anyquant.load(path, device="cpu")
    assert any(re.search(match, p) for p in anyquant.detect(path).details["problems"])


def test_a_missing_part(tmp_path: Path) -> None:
    parts = _split_copy(tmp_path)
    parts[1].unlink()
    _refused(parts[0], GGUFSplitError, r"tiny-00002-of-00003\.gguf is not in .*download every part")
    _refused(parts[2], GGUFSplitError, r"tiny-00002-of-00003\.gguf is not in")
    _refused(parts[0].parent, GGUFSplitError, r"tiny-00002-of-00003\.gguf is not in")
    parts[0].unlink()  # the directory's lowest part is then the third: the error names both missing ones
    _refused(parts[2].parent, GGUFSplitError, r"tiny-00001-of-00003\.gguf, tiny-00002-of-00003\.gguf are not in")


def test_a_part_with_another_split_count(tmp_path: Path) -> None:
    parts = _raw_parts(tmp_path, p2={"split.count": 4})
    _refused(parts[0], GGUFSplitError, r"tiny-00002-of-00003\.gguf: split\.count is 4, not 3")


def test_a_part_numbered_wrongly(tmp_path: Path) -> None:
    parts = _raw_parts(tmp_path, p2={"split.no": 2}, p3={"split.no": 1})
    _refused(
        parts[0], GGUFSplitError, r"tiny-00002-of-00003\.gguf: split\.no is 2 \(part 3\), but its name makes it part 2"
    )
    first = _raw_parts(tmp_path / "b", p1={"split.no": 1})  # the first part says it is the second
    _refused(first[0], GGUFSplitError, "not named as llama.cpp names the parts")


def test_a_tensor_in_two_parts(tmp_path: Path) -> None:
    parts = _raw_parts(tmp_path, p3={"tensors": {"blk.0.t1.weight": (0, [8, 8])}})
    _refused(
        parts[0], GGUFSplitError, r"'blk\.0\.t1\.weight' is in two parts .*tiny-00002-of-00003\.gguf and tiny-00003"
    )


def test_fewer_or_more_tensors_than_split_tensors_count(tmp_path: Path) -> None:
    fewer = _raw_parts(
        tmp_path / "a", p1={"split.tensors.count": 4}, p2={"split.tensors.count": 4}, p3={"split.tensors.count": 4}
    )
    _refused(fewer[0], MissingTensorError, r"hold 3 tensors, but split\.tensors\.count is 4")
    more = _raw_parts(
        tmp_path / "b", p1={"split.tensors.count": 2}, p2={"split.tensors.count": 2}, p3={"split.tensors.count": 2}
    )
    _refused(more[0], GGUFSplitError, r"hold 3 tensors, more than its split\.tensors\.count \(2\)")
    other = _raw_parts(tmp_path / "c", p3={"split.tensors.count": 7})
    _refused(other[0], GGUFSplitError, r"tiny-00003-of-00003\.gguf: split\.tensors\.count is 7, not 3")


def test_a_tensor_past_its_parts_end(tmp_path: Path) -> None:
    """A truncated part: its own header check (the bounded reader) names it."""
    parts = _split_copy(tmp_path)
    with parts[1].open("r+b") as fh:
        fh.truncate(parts[1].stat().st_size - 64)
    _refused(parts[0], HeaderError, r"tiny-00002-of-00003\.gguf: GGUF tensor .* runs past the end of the file")


@pytest.mark.parametrize("count", [0, -1, 10**9, 1025, "3", 2.0, True])
def test_hostile_split_count(tmp_path: Path, count: Any) -> None:
    """A split.count of the wrong type or out of [1, 1024]: refused from the first part's header alone (no other
    part looked for, so no work in the count)."""
    path = write_gguf(
        tmp_path / part_name("tiny", 0, 3), {**META, "split.no": 0, "split.count": count}, {"t.weight": (0, [8])}
    )
    start = time.perf_counter()
    _refused(path, GGUFMetadataError, r"tiny-00001-of-00003\.gguf: GGUF metadata split\.count = ")
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("no", [-1, 3, "0", 1.0])
def test_hostile_split_no(tmp_path: Path, no: Any) -> None:
    path = write_gguf(
        tmp_path / part_name("tiny", 0, 3), {**META, "split.no": no, "split.count": 3}, {"t.weight": (0, [8])}
    )
    _refused(path, GGUFMetadataError, r"GGUF metadata split\.no = ")


def test_the_largest_split_count_is_bounded_work(tmp_path: Path) -> None:
    """split.count 1024 with one part present: the missing parts are looked up (a stat each) and named, no header
    is read."""
    path = write_gguf(
        tmp_path / part_name("tiny", 0, 1024), {**META, "split.no": 0, "split.count": 1024}, {"t.weight": (0, [8])}
    )
    _refused(path, GGUFSplitError, r"tiny-00002-of-01024\.gguf, .* \(1023 in all\) are not in")


def test_a_part_not_named_as_llama_cpp_names_them(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "renamed.gguf", {**META, "split.no": 0, "split.count": 3}, {"t.weight": (0, [8])})
    _refused(path, GGUFSplitError, r"renamed\.gguf is part 1 of a GGUF model split into 3 files, but it is not named")


def test_a_directory_with_two_models(tmp_path: Path) -> None:
    _raw_parts(tmp_path)
    write_gguf(tmp_path / "other.gguf", META, {"t.weight": (0, [8])})
    _refused(tmp_path, CheckpointError, r"holds 2 GGUF models \['other\.gguf', 'tiny-00001-of-00003\.gguf'\]")


# --------------------------------------------------------------------------- what is not a split model


def test_one_file_gguf_with_split_count_one_is_not_a_part(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "one.gguf", {**META, "split.no": 0, "split.count": 1}, {"t.weight": (0, [8])})
    detection = anyquant.detect(path)
    assert detection.format == "gguf" and detection.details["problems"] == [] and "parts" not in detection.details


def test_a_whole_file_named_like_a_part_is_one_file(tmp_path: Path) -> None:
    """A name like a part's, no split keys in the header: one file (llama.cpp reads the header, not the name)."""
    path = write_gguf(tmp_path / part_name("tiny", 0, 2), META, {"t.weight": (0, [8])})
    detection = anyquant.detect(path)
    assert detection.details["problems"] == [] and "parts" not in detection.details


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


def test_a_cached_split_repository_loads_by_model_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole: Path
) -> None:
    """A split quantization in a Hugging Face cache snapshot (its files links to the repository's blobs, in a
    quantization folder): the model id of its first part, or of its folder, loads it."""
    repo = tmp_path / "hub" / "models--org--tiny-GGUF"
    snap = repo / "snapshots" / ("cd" * 20) / "Q4_0"
    _write_model(tmp_path / "w" / "tiny-Q4_0.gguf", split_max_tensors=11)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, part in enumerate(sorted((tmp_path / "w").glob("*.gguf"))):
        blob = repo / "blobs" / f"{i:040x}"
        part.rename(blob)
        (snap / part.name).symlink_to(Path("../../../blobs") / blob.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    want = _logits(_load(whole, "dequantized"))
    for model_id in ("org/tiny-GGUF/Q4_0/tiny-Q4_0-00001-of-00002.gguf", "org/tiny-GGUF/Q4_0"):
        assert anyquant.detect(model_id).details["parts"] == [f"tiny-Q4_0-0000{i}-of-00002.gguf" for i in (1, 2)]
        assert torch.equal(_logits(_load(model_id, "dequantized")), want)  # type: ignore[arg-type]


def test_report_and_estimate_count_every_part(whole: Path, split: list[Path]) -> None:
    """``inspect``'s bytes on disk and ``estimate``'s weight bytes of a split model are every part's, not the first's:
    the tensors' bytes those of the whole file, the files' bytes the parts' sum."""
    report = anyquant.inspect(split[0])
    assert report.totals["bytes_on_disk"] == sum(p.stat().st_size for p in split)
    assert report.totals["tensor_bytes"] == anyquant.inspect(whole).totals["tensor_bytes"]
    got, want = anyquant.estimate(split[0]), anyquant.estimate(whole)
    assert (got.weight_bytes, got.embedding_bytes, got.parameters) == (
        want.weight_bytes,
        want.embedding_bytes,
        want.parameters,
    )
