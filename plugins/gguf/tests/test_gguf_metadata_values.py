"""Hostile numbers in GGUF metadata (issue #44, item 1): every number the plugin reads from a file's metadata is
checked (type, finiteness, range) where it is read, and the vocabulary against the embedding and head at load.

Each case is a tiny Llama (F32 tensors, a byte-level tokenizer) written with ``gguf.GGUFWriter`` with one value
changed: ``anyquant.load`` raises a typed error (a :class:`~anyquant.errors.CheckpointError`) whose message names the
key and the value, never a bare ``OverflowError`` (``int(inf)``), ``ValueError`` or ``IndexError``; the CLI exits
with the typed-error code (2) and no traceback.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter

import anyquant
from anyquant.cli import main as cli_main
from anyquant.errors import AnyquantError, CheckpointError
from anyquant_gguf.tokenizer import byte_alphabet

HIDDEN, FFN, ROWS = 32, 64, 320

#: (writer method, value) per metadata key (without the ``llama.`` prefix) of a loadable tiny Llama
BASE: dict[str, tuple[str, Any]] = {
    "block_count": ("uint32", 1),
    "context_length": ("uint32", 64),
    "embedding_length": ("uint32", HIDDEN),
    "feed_forward_length": ("uint32", FFN),
    "attention.head_count": ("uint32", 2),
    "attention.head_count_kv": ("uint32", 2),
    "attention.layer_norm_rms_epsilon": ("float32", 1e-5),
    "rope.freq_base": ("float32", 10000.0),
}


def _tokens(count: int) -> list[str]:
    """A byte-level vocabulary of ``count`` tokens: the 256 byte characters, fillers, and ``Ġt`` (" t") last, so
    that the prompt " t" encodes to the last id."""
    return [*byte_alphabet(), *(f"x{i}" for i in range(count - 257)), "Ġt"]


def _write(
    path: Path,
    meta: dict[str, tuple[str, Any]] | None = None,
    *,
    tokens: int = ROWS,
    rows: int = ROWS,
    head_rows: int | None = None,
    tokenizer_meta: dict[str, tuple[str, Any]] | None = None,
) -> Path:
    """A tiny Llama: ``meta`` overrides (or adds) ``llama.*`` keys (``None`` as the value drops the key),
    ``tokenizer_meta`` ``tokenizer.ggml.*`` keys; an untied head of ``head_rows`` rows when given."""
    writer = GGUFWriter(str(path), "llama")
    for key, item in {**BASE, **(meta or {})}.items():
        if item is not None:
            getattr(writer, f"add_{item[0]}")(f"llama.{key}", item[1])
    vocab = _tokens(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * len(vocab))
    writer.add_token_merges(["Ġ t"])
    special = {"bos_token_id": ("uint32", 1), "eos_token_id": ("uint32", 2), **(tokenizer_meta or {})}
    for key, item in special.items():
        if item is not None:
            getattr(writer, f"add_{item[0]}")(f"tokenizer.ggml.{key}", item[1])
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", rows, HIDDEN)
    tensor("output_norm.weight", HIDDEN)
    if head_rows is not None:
        tensor("output.weight", head_rows, HIDDEN)
    for name, shape in {
        "attn_norm": (HIDDEN,),
        "ffn_norm": (HIDDEN,),
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (HIDDEN, HIDDEN),
        "attn_v": (HIDDEN, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }.items():
        tensor(f"blk.0.{name}.weight", *shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load(path: Path, **kwargs: Any) -> Any:
    return anyquant.load(path, device="cpu", **kwargs)


def _config(model: Any) -> dict[str, Any]:
    """The loaded model's config as a dict (transformers' or the native runtime's)."""
    config: dict[str, Any] = model.module.config.to_dict()
    return config


# --------------------------------------------------------------------------- one bad number each

INF, NAN = math.inf, math.nan

#: (key, (writer method, value), text the message shows for the value)
BAD_NUMBERS: list[tuple[str, tuple[str, Any], str]] = [
    ("llama.context_length", ("float32", INF), "inf"),
    ("llama.block_count", ("float32", INF), "inf"),
    ("llama.block_count", ("float64", NAN), "nan"),
    ("llama.block_count", ("bool", True), "True"),
    ("llama.embedding_length", ("float32", 32.5), "32.5"),
    ("llama.embedding_length", ("float32", 32.0), "32.0"),
    ("llama.feed_forward_length", ("string", "64"), "'64'"),
    ("llama.attention.head_count", ("string", "two"), "'two'"),
    ("llama.attention.head_count", ("int64", -2), "-2"),
    ("llama.attention.head_count", ("uint32", 0), "0"),
    ("llama.attention.head_count", ("int64", 2**62), str(2**62)),
    ("llama.attention.head_count_kv", ("float32", -INF), "-inf"),
    ("llama.context_length", ("int64", -5), "-5"),
    ("llama.context_length", ("uint64", 2**64 - 1), str(2**64 - 1)),
    ("llama.feed_forward_length", ("uint64", 2**40), str(2**40)),
    ("llama.attention.layer_norm_rms_epsilon", ("float32", NAN), "nan"),
    ("llama.attention.layer_norm_rms_epsilon", ("float32", -1.0), "-1.0"),
    ("llama.attention.layer_norm_rms_epsilon", ("string", "1e-5"), "'1e-5'"),
    ("llama.rope.freq_base", ("float32", INF), "inf"),
    ("llama.rope.freq_base", ("float32", 0.0), "0.0"),
    ("llama.vocab_size", ("float32", INF), "inf"),
    ("llama.vocab_size", ("int64", -1), "-1"),
    ("llama.rope.dimension_count", ("float32", NAN), "nan"),
    ("llama.attention.key_length", ("int64", -16), "-16"),
    ("llama.expert_count", ("float32", INF), "inf"),
    ("llama.rope.scaling.factor", ("float32", INF), "inf"),  # with rope.scaling.type "linear" (below)
    ("llama.rope.scaling.original_context_length", ("float32", NAN), "nan"),  # with "yarn"
    ("tokenizer.ggml.bos_token_id", ("float32", INF), "inf"),
    ("tokenizer.ggml.eos_token_id", ("string", "2"), "'2'"),
    ("tokenizer.ggml.padding_token_id", ("float64", -1.5), "-1.5"),
]


def _case_file(tmp_path: Path, key: str, item: tuple[str, Any]) -> Path:
    meta: dict[str, tuple[str, Any]] = {}
    tok: dict[str, tuple[str, Any]] = {}
    if key.startswith("tokenizer.ggml."):
        tok[key.removeprefix("tokenizer.ggml.")] = item
    else:
        meta[key.removeprefix("llama.")] = item
    if "scaling.factor" in key:
        meta["rope.scaling.type"] = ("string", "linear")
    elif "original_context_length" in key:
        meta["rope.scaling.type"] = ("string", "yarn")
    return _write(tmp_path / "bad.gguf", meta, tokenizer_meta=tok)


@pytest.mark.parametrize(("key", "item", "shown"), BAD_NUMBERS, ids=[f"{k}={s}" for k, _, s in BAD_NUMBERS])
def test_bad_metadata_number_is_a_typed_error_naming_key_and_value(
    tmp_path: Path, key: str, item: tuple[str, Any], shown: str
) -> None:
    path = _case_file(tmp_path, key, item)
    with pytest.raises(AnyquantError) as caught:
        _load(path)
    assert isinstance(caught.value, CheckpointError), type(caught.value)
    message = str(caught.value)
    assert key in message and shown in message, message


def test_the_reader_refuses_them_too(tmp_path: Path) -> None:
    """The config and permutation helpers (``hf_config_from_gguf``, ``qk_permutation_heads``) read through the same
    check, outside a load."""
    from anyquant_gguf.reader import hf_config_from_gguf, open_gguf, qk_permutation_heads

    reader = open_gguf(_write(tmp_path / "a.gguf", {"attention.head_count": ("float32", INF)}))
    with pytest.raises(CheckpointError, match=r"llama\.attention\.head_count.*inf"):
        hf_config_from_gguf(reader)
    with pytest.raises(CheckpointError, match=r"llama\.attention\.head_count.*inf"):
        qk_permutation_heads(reader, "blk.0.attn_q.weight")
    missing = open_gguf(_write(tmp_path / "b.gguf", {"context_length": None}))
    with pytest.raises(CheckpointError, match=r"llama\.context_length.*missing"):
        hf_config_from_gguf(missing)


def test_good_values_still_load_and_generate(tmp_path: Path) -> None:
    """Integers of every width and float32/float64 where a float is read: the file loads and generates."""
    meta = {
        "context_length": ("uint64", 64),
        "block_count": ("int32", 1),
        "attention.layer_norm_rms_epsilon": ("float64", 1e-5),
        "rope.freq_base": ("uint32", 10000),  # an integer where a float is read: a number all the same
        "vocab_size": ("int64", ROWS),
    }
    model = _load(_write(tmp_path / "ok.gguf", meta))
    config = _config(model)
    assert config["vocab_size"] == ROWS and config["max_position_embeddings"] == 64
    assert isinstance(model.generate(" t", max_new_tokens=2, chat=False), str)


@pytest.mark.parametrize(
    ("key", "item", "shown"),
    [
        ("tokenizer.ggml.scores", ("array", [0.0] * 5 + [NAN] + [0.0] * (ROWS - 6)), "tokenizer.ggml.scores[5] = nan"),
        ("tokenizer.ggml.scores", ("array", [0.0] * (ROWS - 1) + [-INF]), f"tokenizer.ggml.scores[{ROWS - 1}] = -inf"),
        ("tokenizer.ggml.scores", ("array", ["a"] * ROWS), "tokenizer.ggml.scores[0] = 'a'"),
        ("tokenizer.ggml.add_bos_token", ("uint32", 1), "tokenizer.ggml.add_bos_token = 1"),
    ],
    ids=["score-nan", "score-inf", "score-string", "add_bos-int"],
)
def test_bad_tokenizer_numbers_are_typed_errors(tmp_path: Path, key: str, item: tuple[str, Any], shown: str) -> None:
    """The tokenizer's own numbers: scores finite, flags bools."""
    path = _write(tmp_path / "tok.gguf", tokenizer_meta={key.removeprefix("tokenizer.ggml."): item})
    with pytest.raises(CheckpointError) as caught:
        _load(path)
    assert shown in str(caught.value), caught.value


# --------------------------------------------------------------------------- vocabulary against the tensors


def test_tokenizer_larger_than_the_embedding_is_refused_at_load(tmp_path: Path) -> None:
    """400 tokens over a 320-row embedding (``llama.vocab_size`` saying 320): refused at load naming both sizes,
    where it used to load and then fail in ``generate`` with a bare ``IndexError`` (the prompt " t" is token 399)."""
    path = _write(tmp_path / "big.gguf", {"vocab_size": ("uint32", ROWS)}, tokens=400)
    with pytest.raises(CheckpointError) as caught:
        _load(path)
    assert "400" in str(caught.value) and str(ROWS) in str(caught.value), caught.value
    # without llama.vocab_size too
    with pytest.raises(CheckpointError, match=rf"400.*{ROWS}|{ROWS}.*400"):
        _load(_write(tmp_path / "big2.gguf", tokens=400))


def test_a_padded_embedding_loads(tmp_path: Path) -> None:
    """Fewer tokens than embedding rows (a padded embedding) is normal: the model has the embedding's rows."""
    model = _load(_write(tmp_path / "padded.gguf", tokens=300))
    assert _config(model)["vocab_size"] == ROWS
    assert isinstance(model.generate(" t", max_new_tokens=2, chat=False), str)


@pytest.mark.parametrize(
    ("kwargs", "sizes"),
    [
        ({"meta": {"vocab_size": ("uint32", 400)}}, ("400", str(ROWS))),  # vocab_size past the embedding
        ({"meta": {"vocab_size": ("uint32", ROWS)}, "head_rows": 400}, ("400", str(ROWS))),  # a head past it
        ({"meta": {"vocab_size": ("uint32", ROWS)}, "head_rows": 256}, ("256", str(ROWS))),  # a head short of it
    ],
    ids=["vocab_size", "head-larger", "head-smaller"],
)
def test_vocabulary_sizes_that_disagree_are_refused(
    tmp_path: Path, kwargs: dict[str, Any], sizes: tuple[str, str]
) -> None:
    path = _write(tmp_path / "v.gguf", kwargs.get("meta"), head_rows=kwargs.get("head_rows"))
    with pytest.raises(CheckpointError) as caught:
        _load(path)
    assert all(size in str(caught.value) for size in sizes), caught.value


def test_special_token_ids_past_the_vocabulary_are_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A special token id past the vocabulary (``0xFFFFFFFF``, 350 of 320): dropped with a warning, as llama.cpp
    does ("bad special token"), so it can never reach the embedding."""
    tok = {"bos_token_id": ("uint32", 350), "padding_token_id": ("uint32", 2**32 - 1)}
    model = _load(_write(tmp_path / "ids.gguf", tokenizer_meta=tok))
    cfg = _config(model)
    assert cfg.get("bos_token_id") is None and cfg.get("pad_token_id") is None
    assert cfg["eos_token_id"] == 2
    assert "tokenizer.ggml.bos_token_id" in caplog.text and "350" in caplog.text
    assert isinstance(model.generate(" t", max_new_tokens=2, chat=False), str)


# --------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("case", ["inf-context", "big-vocabulary"])
def test_cli_exits_with_the_typed_error_code(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    if case == "inf-context":
        path = _write(tmp_path / "inf.gguf", {"context_length": ("float32", INF)})
    else:
        path = _write(tmp_path / "big.gguf", {"vocab_size": ("uint32", ROWS)}, tokens=400)
    code = cli_main(["generate", str(path), "--prompt", " t", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("anyquant: ") and "Error" in err, err
    assert cli_main(["inspect", str(path)]) in (0, 2)  # inspect reads the header only; either way no traceback
    assert "Traceback" not in capsys.readouterr().err


def test_cli_process_prints_no_traceback(tmp_path: Path) -> None:
    """The same as a process: exit status 2, one ``anyquant: <Error>: ...`` line naming the key."""
    path = _write(tmp_path / "inf.gguf", {"block_count": ("float32", INF)})
    done = subprocess.run(
        [sys.executable, "-m", "anyquant.cli", "generate", str(path), "--prompt", "hi", "--max-new-tokens", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "llama.block_count" in done.stderr, done.stderr[-2000:]
