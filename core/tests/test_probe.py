"""Probe and header parsing: real headers, and every kind of bad input as a typed error."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest

from anyquant import Probe
from anyquant.errors import ConfigError, HeaderError, ProbeError, UnsafePathError
from anyquant.headers import read_gguf_header, read_safetensors_header
from anyquant.testing.fixtures import FIXTURES, write_gguf, write_safetensors


def _raw_st(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def test_header_matches_safetensors_library(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {"a": torch.zeros(3, 4, dtype=torch.float16), "b": torch.ones(7, dtype=torch.int32)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    h = read_safetensors_header(tmp_path / "x.safetensors", "x.safetensors")
    got = {t.name: (t.dtype, t.shape, t.nbytes) for t in h.tensors}
    assert got == {"a": ("F16", (3, 4), 24), "b": ("I32", (7,), 28)}
    assert h.metadata == {"format": "pt"}


def test_probe_reads_configs_and_tokenizer_names(tmp_path: Path) -> None:
    root = FIXTURES["gptq_v2"].build(tmp_path / "m")
    (root / "tokenizer.json").write_text("{}")
    probe = Probe.open(root)
    assert probe.quant_method == "gptq"
    assert probe.quantization_config is not None and probe.quantization_config["checkpoint_format"] == "gptq_v2"
    assert "tokenizer.json" in probe.tokenizer_files
    assert probe.suffixes()["qweight"] == 2
    with pytest.raises(TypeError):
        probe.config["x"] = 1  # type: ignore[index]  # immutable


def test_lone_quantize_config_declares_gptq(tmp_path: Path) -> None:
    probe = Probe.open(FIXTURES["gptq_autogptq"].build(tmp_path / "m"))
    assert probe.quant_method == "gptq"


@pytest.mark.parametrize(
    ("header", "length", "message"),
    [
        (b"{", None, "not valid JSON"),
        (b"\xff\xfe", None, "not UTF-8"),
        (b"[]", None, "expected an object"),
        (b'{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}', 2**40, "exceeds"),
        (b'{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}', 10_000, "only"),
        (b'{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 400]}}', None, "past the end"),
        (b'{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 2]}}', None, "needs 4 bytes"),
        (b'{"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 4]}}', None, "unknown dtype"),
        (b'{"a": {"dtype": "F16", "shape": [-2], "data_offsets": [0, 4]}}', None, "non-negative"),
        (b'{"a": {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}}', None, "begin <= end"),
        (
            b'{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},'
            b' "a": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}}',
            None,
            "duplicate",
        ),
        (  # issue #27 item 9: the count shortcut must not count __metadata__ as a tensor
            b'{"__metadata__": {"format": "pt"},'
            b' "a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},'
            b' "a": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}}',
            None,
            "duplicate",
        ),
        (
            b'{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},'
            b' "b": {"dtype": "F16", "shape": [2], "data_offsets": [2, 6]}}',
            None,
            "overlap",
        ),
        (b'{"__metadata__": {"k": 1}}', None, "__metadata__"),
        (b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
        (b'{"a": NaN}', None, "JSON"),
    ],
)
@pytest.mark.parametrize("compact", [False, True], ids=["spaced", "compact"])
def test_bad_safetensors_headers_are_typed_errors(
    tmp_path: Path, header: bytes, length: int | None, message: str, compact: bool
) -> None:
    # compact: the layout the safetensors library writes
    if compact:
        header = header.replace(b": ", b":").replace(b", ", b",")
    path = _raw_st(tmp_path / "bad.safetensors", header, b"\0" * 8, length)
    with pytest.raises(HeaderError, match=message):
        read_safetensors_header(path, "bad.safetensors")


def test_truncated_file(tmp_path: Path) -> None:
    (tmp_path / "t.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(HeaderError, match="too short"):
        Probe.open(tmp_path)


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"w": ("F16", [2])})
    write_safetensors(tmp_path / "b.safetensors", {"w": ("F16", [2])})
    with pytest.raises(HeaderError, match="both"):
        Probe.open(tmp_path)


def test_stale_index_is_a_note(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "output.safetensors", {"w": ("F16", [2])})
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    probe = Probe.open(tmp_path)
    assert "w" in probe.tensors
    assert any("do not exist" in n for n in probe.notes)


@pytest.mark.parametrize("entry", ["../evil.safetensors", "/etc/passwd", "C:\\x.safetensors"])
def test_index_escaping_paths_are_refused(tmp_path: Path, entry: str) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"w": ("F16", [2])})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": entry}}))
    with pytest.raises(UnsafePathError):
        Probe.open(tmp_path)


def test_symlink_leaving_directory_is_refused(tmp_path: Path) -> None:
    outside = write_safetensors(tmp_path / "outside.safetensors", {"w": ("F16", [2])})
    model = tmp_path / "model"
    model.mkdir()
    os.symlink(outside, model / "model.safetensors")
    with pytest.raises(UnsafePathError, match="outside"):
        Probe.open(model)


def test_bad_config_json(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"w": ("F16", [2])})
    (tmp_path / "config.json").write_text('{"quantization_config": 3}')
    with pytest.raises(ConfigError, match="quantization_config"):
        Probe.open(tmp_path)
    (tmp_path / "config.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(ConfigError, match="duplicate"):
        Probe.open(tmp_path)


def test_missing_path() -> None:
    with pytest.raises(ProbeError, match="no such file"):
        Probe.open("/nonexistent/model")


def test_gguf_header_roundtrip(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "m.gguf",
        {"general.architecture": "llama", "llama.block_count": 2, "x.f": 0.5},
        {"a.weight": (0, [4, 2]), "b.weight": (1, [64])},
    )
    h = read_gguf_header(path, "m.gguf")
    assert h.version == 3 and h.architecture == "llama"
    assert h.metadata["llama.block_count"] == 2
    assert [(t.name, t.shape, t.type_name) for t in h.tensors] == [
        ("a.weight", (4, 2), "F32"),
        ("b.weight", (64,), "F16"),
    ]


def test_gguf_header_matches_gguf_library(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "llama")
    w.add_uint32("llama.block_count", 3)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(100)])
    w.add_tensor("tok.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = read_gguf_header(tmp_path / "g.gguf", "g.gguf")
    theirs = gguf.GGUFReader(str(tmp_path / "g.gguf"))
    assert ours.metadata["llama.block_count"] == 3
    assert ours.array_lengths["tokenizer.ggml.tokens"] == 100
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert ours.data_offset == theirs.data_offset
    assert ours.tensors[0].shape == tuple(int(x) for x in theirs.tensors[0].shape)


def _string_array(key: bytes, items: list[bytes]) -> bytes:
    """One GGUF key/value: an array (type 9) of strings (type 8)."""
    body = b"".join(struct.pack("<Q", len(i)) + i for i in items)
    return struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, len(items)) + body


def test_long_string_arrays_are_skipped_but_bounded(tmp_path: Path) -> None:
    """Vocabularies are summarised (length only), not decoded; a string running past the file still is an error."""
    items = [b"\xff\xfe not utf-8"] * 100  # never decoded: more than GGUF_KEEP_ARRAY items
    blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string_array(b"tokenizer.ggml.tokens", items)
    (tmp_path / "v.gguf").write_bytes(blob + b"\0" * 64)
    h = read_gguf_header(tmp_path / "v.gguf", "v.gguf")
    assert h.array_lengths["tokenizer.ggml.tokens"] == 100 and h.metadata["tokenizer.ggml.tokens"] is None
    cut = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string_array(b"t", [*items[:99], b""])
    cut = cut[:-8] + struct.pack("<Q", 10**6)  # the last (empty) string now claims a megabyte the file lacks
    (tmp_path / "cut.gguf").write_bytes(cut)
    with pytest.raises(HeaderError, match="past the end"):
        read_gguf_header(tmp_path / "cut.gguf", "cut.gguf")
    short = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string_array(b"t", [b"\xff"] * 3)
    (tmp_path / "short.gguf").write_bytes(short + b"\0" * 64)
    with pytest.raises(HeaderError, match="not UTF-8"):  # short arrays are kept, so decoded
        read_gguf_header(tmp_path / "short.gguf", "short.gguf")


@pytest.mark.parametrize(
    "blob",
    [
        b"GGUF" + struct.pack("<I", 7),  # bad version
        b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0),  # tensor count beyond file
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**40),  # key length beyond file
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99),  # bad type
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 4, 2**50),
        b"GGJT",
        b"GG",
    ],
)
def test_bad_gguf_headers_are_typed_errors(tmp_path: Path, blob: bytes) -> None:
    (tmp_path / "bad.gguf").write_bytes(blob + b"\0" * 64)
    with pytest.raises(HeaderError):
        read_gguf_header(tmp_path / "bad.gguf", "bad.gguf")


def test_gguf_tensor_past_end(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, {"a": (0, [1024])})
    with path.open("r+b") as fh:
        fh.truncate(path.stat().st_size - 100)
    with pytest.raises(HeaderError, match="past the end"):
        read_gguf_header(path, "m.gguf")


def _rewrite_gguf_offset(path: Path, tensor: str, offset: int) -> None:
    """Point ``tensor``'s data offset (the u64 after its name, dims and type) at ``offset``."""
    blob = bytearray(path.read_bytes())
    name = struct.pack("<Q", len(tensor)) + tensor.encode()
    at = blob.index(name) + len(name)
    (n_dims,) = struct.unpack_from("<I", blob, at)
    at += 4 + 8 * n_dims + 4
    struct.pack_into("<Q", blob, at, offset)
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize(
    ("offset", "why"),
    [(0, "aliases the first tensor's data"), (64, "overlaps it"), (4096 + 32, "leaves a gap"), (4100, "unaligned")],
)
def test_gguf_tensor_offsets_follow_llama_cpp_layout(tmp_path: Path, offset: int, why: str) -> None:
    # llama.cpp refuses a tensor whose data does not start where the previous one's padded data
    # ends; such offsets let one tensor read another's bytes (here "b" would alias "a").
    tensors = {"a": (0, [1024]), "b": (0, [1024]), "c": (1, [64])}
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, tensors)
    assert [t.offset for t in read_gguf_header(path, "m.gguf").tensors] == [0, 4096, 8192]
    _rewrite_gguf_offset(path, "b", offset)
    with pytest.raises(HeaderError, match=r"'b' has data offset \d+, expected 4096"):
        read_gguf_header(path, "m.gguf")


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_snapshot(tmp_path: Path, model: Path, repo: str = "models--org--tiny", rev: str = COMMIT) -> Path:
    """``model``'s files moved into a Hugging Face hub cache layout: ``<repo>/blobs/<hash>`` holds the
    bytes, ``<repo>/snapshots/<rev>/<name>`` is a relative link to it (what ``snapshot_download`` makes)."""
    import hashlib

    blobs = tmp_path / "hub" / repo / "blobs"
    snap = tmp_path / "hub" / repo / "snapshots" / rev
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(model.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(blobs / digest)
        (snap / f.name).symlink_to(Path("../../blobs") / digest)
    return snap


def test_hub_cache_snapshot_links_into_its_own_blobs_are_read(tmp_path: Path) -> None:
    root = FIXTURES["gptq_v2"].build(tmp_path / "m")
    (root / "tokenizer.json").write_text("{}")
    expected = Probe.open(root)
    snap = _hub_snapshot(tmp_path, root)
    assert all((snap / n).is_symlink() for n in ("config.json", "model.safetensors", "tokenizer.json"))
    probe = Probe.open(snap)
    assert probe.root == snap.resolve() and probe.tokenizer_files == ("tokenizer.json",)
    assert probe.quant_method == "gptq" and dict(probe.tensors) == dict(expected.tensors)
    assert Probe.open(snap / "model.safetensors").tensors == probe.tensors  # one file of the snapshot


@pytest.mark.parametrize(
    "target",
    [
        "../../../models--other--repo/blobs/x",  # another repository's blobs
        "../../refs/main",  # the repository, but not its blobs
        "../../blobs/sub/x",  # below blobs, not a blob
    ],
)
def test_hub_cache_links_anywhere_else_are_refused(tmp_path: Path, target: str) -> None:
    snap = _hub_snapshot(tmp_path, FIXTURES["gptq_v2"].build(tmp_path / "m"))
    link = snap / "config.json"
    real = (snap / target).resolve()
    real.parent.mkdir(parents=True, exist_ok=True)
    real.write_bytes(link.resolve().read_bytes())
    link.unlink()
    link.symlink_to(target)
    with pytest.raises(UnsafePathError, match=r"config\.json: is a link to"):
        Probe.open(snap)


def test_blobs_are_only_trusted_in_a_models_repository_snapshot(tmp_path: Path) -> None:
    """The same layout under a directory not named ``models--...``, or a snapshot's folder named otherwise,
    is an ordinary directory: its links leave it."""
    snap = _hub_snapshot(tmp_path, FIXTURES["gptq_v2"].build(tmp_path / "m"), repo="weights")
    with pytest.raises(UnsafePathError, match="outside the model directory"):
        Probe.open(snap)


@pytest.mark.parametrize(
    "name", ["config.json", "quantize_config.json", "tokenizer.json", "model.safetensors.index.json", "m.gguf"]
)
def test_every_file_the_probe_reads_may_not_link_outside(tmp_path: Path, name: str) -> None:
    model = tmp_path / "model"
    write_safetensors(model / "model.safetensors", {"w": ("F16", [2])})
    outside = tmp_path / f"outside-{name}"
    if name.endswith(".gguf"):
        write_gguf(outside, {"general.architecture": "llama"}, {"a.weight": (0, [4])})
    else:
        outside.write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    (model / name).symlink_to(outside)
    with pytest.raises(UnsafePathError, match=re.escape(f"{name}: is a link to")):
        Probe.open(model)
    (model / name).unlink()
    (model / "sub").mkdir()
    (model / "sub" / name).symlink_to(outside)
    (model / name).symlink_to(Path("sub") / name)  # a link to a link: resolved to the end
    with pytest.raises(UnsafePathError, match=re.escape(f"{name}: is a link to")):
        Probe.open(model)


def test_links_inside_the_directory_and_file_listing(tmp_path: Path) -> None:
    """Links that stay inside are read; names are matched as ``*.safetensors``, ``*.gguf`` and by
    pickle suffix, files only (a directory or a dangling link with such a name is not a file)."""
    model = tmp_path / "model"
    write_safetensors(model / "store" / "real.safetensors", {"w": ("F16", [2])})
    (model / "a.safetensors").symlink_to(Path("store") / "real.safetensors")
    (model / "dir.safetensors").mkdir()
    (model / "dangling.safetensors").symlink_to(model / "nowhere")
    (model / "weights.bin").write_bytes(b"x")
    (model / ".bin").write_bytes(b"x")  # no suffix, as pathlib sees it
    (model / "b.pt.txt").write_bytes(b"x")
    probe = Probe.open(model)
    assert [h.file for h in probe.safetensors] == ["a.safetensors"]
    assert probe.pickle_files == ("weights.bin",)
    assert list(probe.tensors) == ["w"]


@pytest.fixture
def hub_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hub"


def test_hub_cache_dir_follows_huggingface_hubs_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from anyquant.probe import hub_cache_dir

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", "~/hf")
    assert hub_cache_dir() == tmp_path / "home" / "hf" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert hub_cache_dir() == tmp_path / "legacy"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert hub_cache_dir() == tmp_path / "new"


def test_a_model_id_reads_its_snapshot_in_the_hub_cache(tmp_path: Path, hub_env: Path) -> None:
    old = _hub_snapshot(tmp_path, FIXTURES["awq_gemm"].build(tmp_path / "old"), rev="f" * 40)
    snap = _hub_snapshot(tmp_path, FIXTURES["gptq_v2"].build(tmp_path / "m"))
    repo = snap.parent.parent
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)  # huggingface_hub writes the hash without a newline
    probe = Probe.open("org/tiny")
    assert probe.root == snap.resolve() and probe.quant_method == "gptq"
    assert any("Hugging Face cache" in n for n in probe.notes)
    from anyquant.probe import display_name, resolve_checkpoint

    assert resolve_checkpoint("org/tiny") == snap
    assert display_name("org/tiny") == display_name(snap) == "org/tiny"
    assert display_name(snap / "model.safetensors") == "org/tiny/model.safetensors"
    assert Probe.open(repo).root == snap.resolve() and display_name(repo) == "org/tiny"  # the repository's folder
    one = Probe.open("org/tiny/model.safetensors")  # a path inside the repository: one file of it
    assert one.path == snap / "model.safetensors" and dict(one.tensors) == dict(probe.tensors)
    assert display_name("org/tiny/model.safetensors") == "org/tiny/model.safetensors"
    with pytest.raises(ProbeError, match=r"in the Hugging Face cache's snapshot of org/tiny: it has no 'q4\.gguf'"):
        Probe.open("org/tiny/q4.gguf")
    assert display_name("org/missing") == "missing" and display_name(tmp_path / "m") == "m"
    (repo / "refs" / "main").write_text("f" * 40 + "\n")
    assert Probe.open("org/tiny").quant_method == "awq" and Probe.open("org/tiny").root == old.resolve()
    (repo / "refs" / "main").unlink()  # no ref: two snapshots are ambiguous, one is not
    with pytest.raises(ProbeError, match="no refs/main and 2 snapshots"):
        Probe.open("org/tiny")
    for f in old.iterdir():
        f.unlink()
    old.rmdir()
    assert Probe.open("org/tiny").root == snap.resolve()


def test_a_revision_is_a_ref_or_a_commit_of_the_cache(tmp_path: Path, hub_env: Path) -> None:
    from anyquant.errors import RevisionNotFoundError
    from anyquant.probe import parse_model_id, resolve_checkpoint

    awq = _hub_snapshot(tmp_path, FIXTURES["awq_gemm"].build(tmp_path / "a"), rev="f" * 40)
    gptq = _hub_snapshot(tmp_path, FIXTURES["gptq_v2"].build(tmp_path / "m"))
    refs = awq.parent.parent / "refs"
    (refs / "exl3" / "4.0bpw").parent.mkdir(parents=True)
    (refs / "exl3" / "4.0bpw").write_text("f" * 40)  # a branch name with "/": a file under refs/
    (refs / "v1").write_text(COMMIT)
    assert Probe.open("org/tiny@exl3/4.0bpw").quant_method == "awq"
    assert Probe.open("org/tiny", revision="exl3/4.0bpw").root == awq.resolve()
    assert Probe.open("org/tiny@v1").quant_method == "gptq"
    assert Probe.open("org/tiny@" + COMMIT).root == gptq.resolve()
    assert Probe.open("org/tiny@0123456").root == gptq.resolve()  # a unique prefix of 7+ hex digits
    from anyquant import estimate, inspect

    assert estimate("org/tiny", revision="exl3/4.0bpw").format == "awq"
    assert inspect("org/tiny", revision="v1").detection.format == "gptq"
    from anyquant.probe import display_name

    assert display_name("org/tiny@v1") == "org/tiny@v1"  # two branches of one model, told apart in tables
    assert display_name("org/tiny/model.safetensors@v1") == "org/tiny/model.safetensors@v1"
    assert display_name(gptq) == "org/tiny"
    assert resolve_checkpoint("org/tiny/model.safetensors@fffffff") == awq / "model.safetensors"
    with pytest.raises(RevisionNotFoundError) as err:
        Probe.open("org/tiny@main")
    text = str(err.value)
    assert "exl3/4.0bpw -> ffffffffffff" in text and "v1 -> 0123456789ab" in text and COMMIT in text
    assert "`hf download org/tiny --revision main`" in text
    with pytest.raises(RevisionNotFoundError, match=r"no refs/main and 2 snapshots.*Pick one"):
        Probe.open("org/tiny")
    with pytest.raises(ProbeError, match="names revision 'v1' and revision='v2' was passed"):
        Probe.open("org/tiny@v1", revision="v2")
    for bad in ("org/tiny@../x", "org/tiny@", "org/tiny@a//b"):
        with pytest.raises(ProbeError, match="is not a revision"):
            Probe.open(bad)
    with pytest.raises(ProbeError, match="applies to a Hugging Face model id"):
        Probe.open(tmp_path / "hub", revision="v1")
    mid = parse_model_id("org/tiny/q.gguf@exl3/4.0bpw")
    assert mid is not None and (mid.repo_id, mid.inside, mid.revision) == ("org/tiny", "q.gguf", "exl3/4.0bpw")
    for f in awq.iterdir():
        f.unlink()
    awq.rmdir()
    (refs / "v1").unlink()  # one snapshot, named by another branch only: not taken for main
    (refs / "exl3" / "4.0bpw").write_text(COMMIT)
    with pytest.raises(RevisionNotFoundError, match=r"revision 'main' is not in .*refs \[exl3/4.0bpw"):
        Probe.open("org/tiny")


@pytest.mark.parametrize(
    ("ref", "message"),
    [("../../../../etc", "expected a commit hash"), ("a" * 40, "has no such snapshot"), ("", "expected a commit")],
)
def test_a_bad_ref_is_a_probe_error(tmp_path: Path, hub_env: Path, ref: str, message: str) -> None:
    snap = _hub_snapshot(tmp_path, FIXTURES["gptq_v2"].build(tmp_path / "m"))
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(ref)
    with pytest.raises(ProbeError, match=message):
        Probe.open("org/tiny")


def test_a_local_directory_wins_and_other_names_are_paths(tmp_path: Path, hub_env: Path) -> None:
    _hub_snapshot(tmp_path, FIXTURES["gptq_v2"].build(tmp_path / "m"))
    FIXTURES["awq_gemm"].build(tmp_path / "org" / "tiny")  # ./org/tiny, relative to the working directory
    assert Probe.open("org/tiny").quant_method == "awq"
    with pytest.raises(ProbeError, match=r"nor a model in the Hugging Face cache .*`hf download org/other`"):
        Probe.open("org/other")
    for name in ("org/../tiny", "org--x/tiny", "./org/nothing", "org/tiny/../../x", "org/tiny//x", "org/tiny/a\\b"):
        with pytest.raises(ProbeError, match=r"no such file or directory$"):
            Probe.open(name)


def _with_index(root: Path, weight_map: dict[str, str]) -> None:
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_file_the_complete_index_does_not_name_is_ignored(tmp_path: Path) -> None:
    """Mistral's uploads: transformers shards named by the index, and consolidated.safetensors (the same
    weights under other names) beside them. Only the index's shards are read, as transformers does."""
    hf = {"model.embed_tokens.weight": ("F16", [8, 4]), "lm_head.weight": ("F16", [8, 4])}
    write_safetensors(tmp_path / "model-00001-of-00001.safetensors", hf)
    write_safetensors(tmp_path / "consolidated.safetensors", {"tok_embeddings.weight": ("F16", [8, 4])})
    _with_index(tmp_path, dict.fromkeys(hf, "model-00001-of-00001.safetensors"))
    probe = Probe.open(tmp_path)
    assert [h.file for h in probe.safetensors] == ["model-00001-of-00001.safetensors"]
    assert sorted(probe.tensors) == sorted(hf)
    assert any(n.startswith("consolidated.safetensors: not named by") for n in probe.notes)


def test_a_stale_or_partial_index_keeps_every_file(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"x": ("F16", [2]), "y": ("F16", [2])})
    write_safetensors(tmp_path / "b.safetensors", {"z": ("F16", [2])})
    _with_index(tmp_path, {"x": "a.safetensors", "w": "gone.safetensors"})  # stale (EXL2 uploads): ignored
    probe = Probe.open(tmp_path)
    assert sorted(probe.tensors) == ["x", "y", "z"] and probe.missing_shards == ("gone.safetensors",)
    _with_index(tmp_path, {"x": "a.safetensors", "z": "b.safetensors"})  # names both files, not every tensor
    probe = Probe.open(tmp_path)
    assert sorted(probe.tensors) == ["x", "y", "z"] and probe.missing_shards == ()
    assert any("does not list 1 tensor(s)" in n for n in probe.notes)
