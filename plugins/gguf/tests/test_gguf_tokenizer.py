"""anyquant_gguf.tokenizer (built from GGUF metadata) and the fast reader vs their references.

The reference is transformers' own GGUF tokenizer, ``AutoTokenizer.from_pretrained(folder,
gguf_file=...)``, and the stock ``gguf.GGUFReader``.
"""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from anyquant_gguf.reader import open_gguf, tokenizer_from_gguf
from anyquant_gguf.tokenizer import PRE_TOKENIZER_SPLITS, byte_alphabet, tokenizer_from_reader
from anyquant_runtime.tokenizer import SPECIAL_TOKEN_NAMES, LazyTokenizer, encode_text, token_bytes

TEXTS = [
    "Hello, GGUF world!",
    "",
    " ",
    "   leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\r\n  mixed \t\t runs      of whitespace",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어 🤖🚀👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special tokens glued<|endoftext|>to text<|im_end|><|im_start|>",
    "def f(x):\n    return x ** 2  # code\n\n\nclass A:\n\tpass",
    "numbers 1234567890 3.14159 -42 1e-5 0x1F",
    "I'm you're they'll we've she'd IT'S DON'T",
    "<repo_name>anyquant<file_sep>main.py<filename>x",
    "zero\u200bwidth\u00a0nbsp and combining e\u0301",
]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?  Answer with   spaces."},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Ünïcödé? 日本語 🤖"},
]


def _reference(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def _assert_lazy_matches(ours: LazyTokenizer, ref: Any, texts: list[str]) -> None:
    """What a LazyTokenizer answers itself equals transformers' tokenizer, and asking it builds no wrapper."""
    assert ours.__dict__["_real"] is None
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.all_special_tokens == ref.all_special_tokens
    assert ours.all_special_ids == ref.all_special_ids
    assert ours.added_tokens_decoder == ref.added_tokens_decoder
    assert ours.get_added_vocab() == ref.get_added_vocab()
    assert ours.chat_template == ref.chat_template
    assert ours.name_or_path == ref.name_or_path
    for name in SPECIAL_TOKEN_NAMES:
        assert getattr(ours, name) == getattr(ref, name), name
        assert getattr(ours, f"{name}_id") == getattr(ref, f"{name}_id"), name
    assert (ours.add_bos_token, ours.add_eos_token) == (ref.add_bos_token, ref.add_eos_token)
    assert (len(ours), ours.vocab_size, ours.get_vocab()) == (len(ref), ref.vocab_size, ref.get_vocab())
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"] == encode_text(ours, text), text
        plain = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == plain == encode_text(ours, text, add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
            assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == ref.convert_ids_to_tokens(
                ids, skip_special_tokens=skip
            )
        pieces = ref.convert_ids_to_tokens(ids)
        assert ours.convert_tokens_to_ids(pieces) == ref.convert_tokens_to_ids(pieces)
        assert [ours.decode(i) for i in ids] == [ref.decode(i) for i in ids]
        assert [token_bytes(ours, i) for i in ids] == [token_bytes(ref, i) for i in ids]
    assert ours.__dict__["_real"] is None, "a question the lazy tokenizer answers built the transformers wrapper"


def _assert_same_tokenizer(ours: Any, ref: Any, texts: list[str]) -> None:
    if isinstance(ours, LazyTokenizer):
        _assert_lazy_matches(ours, ref, texts)
        ours = ours.as_transformers()
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    assert type(ours) is type(ref)
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.all_special_ids == ref.all_special_ids
    assert ours.added_tokens_decoder == ref.added_tokens_decoder
    assert ours.chat_template == ref.chat_template
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
        ref.unk_token_id,
    )
    assert getattr(ours, "add_bos_token", None) == getattr(ref, "add_bos_token", None)
    assert getattr(ours, "add_eos_token", None) == getattr(ref, "add_eos_token", None)
    assert len(ours) == len(ref)
    for text in texts:
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert ours(text, add_special_tokens=False)["input_ids"] == ref(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    batch = ours(texts[:3], padding=True)["input_ids"] if ours.pad_token_id is not None else None
    if batch is not None:
        assert batch == ref(texts[:3], padding=True)["input_ids"]


# --------------------------------------------------------------------------- real model


@pytest.mark.model
def test_tokenizer_matches_transformers(gguf_path: Path) -> None:
    ours = tokenizer_from_gguf(gguf_path)
    ref = _reference(gguf_path)
    _assert_same_tokenizer(ours, ref, TEXTS)
    assert ours.decode(ours("Hello, GGUF world! 日本語")["input_ids"]) == "Hello, GGUF world! 日本語"
    for generation_prompt in (False, True):
        text = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
        assert text == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours(text)["input_ids"] == ref(text)["input_ids"]
    # the default system prompt comes from the template in the GGUF metadata
    chat = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.model
def test_reader_equals_gguf_reader(gguf_path: Path) -> None:
    _assert_same_reader(gguf_path)


@pytest.mark.model
def test_tokenizer_from_an_open_reader(gguf_path: Path) -> None:
    reader = open_gguf(gguf_path)
    tok = tokenizer_from_gguf(reader)
    assert tok.name_or_path == str(gguf_path.parent)
    assert tok("<|im_start|>hi")["input_ids"][0] == 1


@pytest.mark.model
def test_loading_and_generating_do_not_import_transformers(gguf_path: Path) -> None:
    """``anyquant.load`` of a GGUF and text generation from a plain prompt never import transformers (nor the
    ``gguf`` package, ever: its import is ~0.1 s); a chat prompt builds the wrapper then (its
    ``apply_chat_template`` renders the template)."""
    code = (
        "import sys, json, anyquant\n"
        f"model = anyquant.load({str(gguf_path)!r})\n"
        "ids = model.tokenizer.encode('Hello, GGUF world!')\n"
        "text = model.generate('The capital of France is', max_new_tokens=3)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
        "chat = model.generate([{'role': 'user', 'content': 'hi'}], max_new_tokens=1)\n"
        "print(json.dumps([ids, loaded, 'transformers' in sys.modules, type(model.tokenizer).__name__,\n"
        "                  'gguf' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    ids, loaded, after_chat, kind, gguf_imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [] and kind == "LazyTokenizer" and not gguf_imported
    assert after_chat
    assert ids == _reference(gguf_path)("Hello, GGUF world!")["input_ids"]


# --------------------------------------------------------------------------- tables


def test_merge_pairs() -> None:
    """Merges split into pairs in whole-list operations give what one split per merge gives, also where
    malformed merges balance each other's space count (no space in one, two in another)."""
    from anyquant_gguf.tokenizer import _merge_pairs

    good = ["Ġ t", "h e", "Ġt he", "ĠĠ ĠĠ"] * 30
    assert _merge_pairs(good) == [tuple(m.split(" ")) for m in good]
    assert all(type(p) is tuple for p in _merge_pairs(good))
    odd = ["ab", "a b c", *good]
    assert _merge_pairs(odd) == [tuple(m.split(" ")) for m in odd]
    assert _merge_pairs(["a\0 b", "c d"]) == [("a\0", "b"), ("c", "d")]


def test_byte_alphabet_is_gpt2s() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert dict(enumerate(byte_alphabet())) == bytes_to_unicode()


def test_split_regexes_match_transformers() -> None:
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    theirs = mapping.GGUF_PRE_TOKENIZER_SPLITS
    for pre, regex in PRE_TOKENIZER_SPLITS.items():
        assert theirs.get(pre) == regex, pre


# --------------------------------------------------------------------------- synthetic files


def _byte_level_vocab(plain_control: bool = False) -> tuple[list[str], list[int], list[str]]:
    """A small byte-level BPE: 3 control tokens and a token spelled in plain Unicode (DeepSeek's BOS: a control
    token with ``plain_control``, else a normal one), the 256 byte characters, merged tokens, a user-defined
    ``<think>`` and a token spelled outside the byte alphabet."""
    alphabet = byte_alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<\uff5cbegin\u2581of\u2581sentence\uff5c>"]
    types = [3, 3, 3, 3 if plain_control else 1]
    tokens += list(alphabet)
    types += [1] * 256
    merges = ["Ġ t", "h e", "Ġt he", "l l", "e ll", "h ell", "o r", "Ġ w", "Ġw or", "Ġwor l", "Ġworl d", "Ã ©"]
    for merge in merges:
        tokens.append(merge.replace(" ", ""))
        types.append(1)
    tokens += ["<think>", "€!"]  # "€" is no byte-alphabet character: the token gets re-spelled
    types += [4, 1]
    return tokens, types, merges


def _write_tokenizer_gguf(
    path: Path, *, model: str, pre: str | None, tokens: list[str], types: list[int], **extra: Any
) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "merges" in extra:
        writer.add_token_merges(extra["merges"])
    if "scores" in extra:
        writer.add_token_scores(extra["scores"])
    writer.add_bos_token_id(extra.get("bos", 1))
    writer.add_eos_token_id(extra.get("eos", 2))
    if "unk" in extra:
        writer.add_unk_token_id(extra["unk"])
    if "pad" in extra:
        writer.add_pad_token_id(extra["pad"])
    if "add_bos" in extra:
        writer.add_add_bos_token(extra["add_bos"])
    if "template" in extra:
        writer.add_chat_template(extra["template"])
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_same_reader(path: Path) -> None:
    """:class:`GGUFFile` gives what gguf's own ``GGUFReader`` gives: the same keys in order, values and item
    counts; the same tensors (name, type, sizes, offset, shape) with the same data views."""
    ours, stock = open_gguf(path), GGUFReader(str(path), "c")
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the stock reader's own entries
    assert list(ours.fields) == [key for key in stock.fields if key not in header]
    for key, theirs in stock.fields.items():
        if key in header:
            continue
        mine = ours.fields[key]
        assert mine.name == theirs.name == key
        assert mine.contents() == theirs.contents()
        assert mine.count == (len(theirs.data) if theirs.types[0] == GGUFValueType.ARRAY else 1)
    assert len(ours.tensors) == len(stock.tensors)
    for a, b in zip(ours.tensors, stock.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name,
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        )
        assert a.tensor_type.name == b.tensor_type.name
        assert list(a.shape) == b.shape.tolist() and a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data)


TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYNTH_TEXTS = [
    "the world",
    " the  hello world",
    "hello<think>the<|im_end|>€!",
    "é! é é!! €! €",
    "<|im_start|>user\nthe<|im_end|>\n",
    "<\uff5cbegin\u2581of\u2581sentence\uff5c> world",
    "",
    "  \n\n  the\t\tworld  ",
]


@pytest.mark.parametrize("pre", [None, "smollm", "llama-bpe", "qwen2"])
def test_byte_level_tokenizer_matches_transformers(tmp_path: Path, pre: str | None) -> None:
    tokens, types, merges = _byte_level_vocab()
    path = _write_tokenizer_gguf(
        tmp_path / "bpe.gguf",
        model="gpt2",
        pre=pre,
        tokens=tokens,
        types=types,
        merges=merges,
        pad=0,
        template=TEMPLATE,
    )
    _assert_same_reader(path)
    ours = tokenizer_from_reader(open_gguf(path))
    ref = _reference(path)
    _assert_same_tokenizer(ours, ref, SYNTH_TEXTS)
    respelled = "".join(byte_alphabet()[b] for b in "€!".encode())  # outside the byte alphabet
    assert ours.convert_tokens_to_ids(respelled) == tokens.index("€!")
    assert ours.convert_ids_to_tokens(ours("é", add_special_tokens=False)["input_ids"]) == ["Ã©"]
    text = ours.apply_chat_template(
        [{"role": "user", "content": "the world"}], tokenize=False, add_generation_prompt=True
    )
    assert text == ref.apply_chat_template(
        [{"role": "user", "content": "the world"}], tokenize=False, add_generation_prompt=True
    )
    assert ours(text)["input_ids"] == ref(text)["input_ids"]


def test_a_control_token_in_plain_unicode_is_matched_as_llama_cpp_matches_it(tmp_path: Path) -> None:
    """A control token written in plain Unicode, as llama.cpp's converter copies DeepSeek's added tokens
    (``<｜begin▁of▁sentence｜>``, ``<｜tool▁calls▁begin｜>``, ...): text holding it encodes to its id and decoding
    drops it, as llama.cpp does (llama-cpp-python 0.3.36 on this file: ``tokenize(special=True)`` gave [3, 270] for
    the text below and ``detokenize`` ``b' world'``); transformers' GGUF tokenizer splits it into bytes. Every other
    text encodes as with the token a normal one (transformers agrees there)."""
    tokens, types, merges = _byte_level_vocab(plain_control=True)
    path = _write_tokenizer_gguf(
        tmp_path / "ds.gguf", model="gpt2", pre="smollm", tokens=tokens, types=types, merges=merges
    )
    ours = tokenizer_from_reader(open_gguf(path))
    bos = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    ids = ours(bos + " world", add_special_tokens=False)["input_ids"]
    assert ids == [3, 270]
    assert ours.decode(ids, skip_special_tokens=True) == " world" and ours.decode(ids) == bos + " world"
    assert ours.added_tokens_decoder[3].content == bos and ours.added_tokens_decoder[3].special
    plain = tokenizer_from_reader(
        open_gguf(_write_tokenizer_gguf(tmp_path / "n.gguf", model="gpt2", pre="smollm", tokens=tokens,
                                        types=_byte_level_vocab()[1], merges=merges))
    )  # fmt: skip
    for text in SYNTH_TEXTS:
        if bos not in text:
            assert ours(text)["input_ids"] == plain(text)["input_ids"], text


def test_byte_level_with_bos(tmp_path: Path) -> None:
    tokens, types, merges = _byte_level_vocab()
    path = _write_tokenizer_gguf(
        tmp_path / "bos.gguf", model="gpt2", pre="llama-bpe", tokens=tokens, types=types, merges=merges, add_bos=True
    )
    ours, ref = tokenizer_from_gguf(path), _reference(path)
    _assert_same_tokenizer(ours, ref, SYNTH_TEXTS)
    assert ours("the")["input_ids"][0] == 1


def test_special_tokens_that_are_plain_vocabulary(tmp_path: Path) -> None:
    """EOS and padding naming ordinary tokens (``ll``, ``e``): transformers' wrapper adds them as special tokens,
    which changes how ``hello`` splits; the lazy tokenizer does the same without building the wrapper."""
    tokens, types, merges = _byte_level_vocab()
    eos, pad = tokens.index("ll"), tokens.index("e")
    path = _write_tokenizer_gguf(
        tmp_path / "plain.gguf", model="gpt2", pre="smollm", tokens=tokens, types=types, merges=merges, eos=eos, pad=pad
    )
    ours, ref = tokenizer_from_gguf(path), _reference(path)
    assert isinstance(ours, LazyTokenizer)
    _assert_same_tokenizer(ours, ref, [*SYNTH_TEXTS, "hello", "he ll o", "well, hello there"])
    assert ref.convert_ids_to_tokens(ref("hello")["input_ids"]) == ["h", "e", "ll", "o"]


def test_lazy_tokenizer_hands_over_to_transformers(tmp_path: Path) -> None:
    """A copy or pickle stays lazy; an attribute it does not know, or setting one, builds transformers' tokenizer
    over the same backend, which from then on answers everything (also what the proxy answered before)."""
    tokens, types, merges = _byte_level_vocab()
    path = _write_tokenizer_gguf(
        tmp_path / "lazy.gguf", model="gpt2", pre="qwen2", tokens=tokens, types=types, merges=merges, template=TEMPLATE
    )
    ours = tokenizer_from_gguf(path)
    assert isinstance(ours, LazyTokenizer)
    ids = ours.encode("hello world")
    for clone in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert clone.__dict__["_real"] is None and clone.encode("hello world") == ids
    assert ours.__dict__["_real"] is None
    assert ours.pad_token is None
    ours.pad_token = "<|im_end|>"  # set on transformers' tokenizer
    real = ours.as_transformers()
    assert type(real).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert real.backend_tokenizer is ours.backend_tokenizer or ours.__dict__["_real"] is real
    assert (ours.pad_token, ours.pad_token_id) == (real.pad_token, real.pad_token_id) == ("<|im_end|>", 2)
    assert ours("hello world")["input_ids"] == ids == real.encode("hello world")
    rendered = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


def test_unknown_pre_tokenizer_goes_to_transformers_converter(tmp_path: Path) -> None:
    tokens, types, merges = _byte_level_vocab()
    path = _write_tokenizer_gguf(
        tmp_path / "other.gguf", model="gpt2", pre="gpt-4o", tokens=tokens, types=types, merges=merges
    )
    _assert_same_tokenizer(tokenizer_from_gguf(path), _reference(path), SYNTH_TEXTS)


def test_sentencepiece_vocab_goes_to_transformers_converter(tmp_path: Path) -> None:
    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]]
    words = ["▁", "t", "h", "e", "▁t", "he", "▁the", "w", "o", "r", "l", "d", "▁w", "or", "▁wor", "ld", "▁world"]
    tokens = pieces + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(words))]
    path = _write_tokenizer_gguf(
        tmp_path / "spm.gguf", model="llama", pre="default", tokens=tokens, types=types, scores=scores, unk=0
    )
    texts = ["the world", " the  world", "xyz the", "", "world\nthe"]
    _assert_same_tokenizer(tokenizer_from_gguf(path), _reference(path), texts)


def test_missing_vocabulary(tmp_path: Path) -> None:
    writer = GGUFWriter(str(tmp_path / "novocab.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="no tokenizer"):
        tokenizer_from_gguf(tmp_path / "novocab.gguf")


def test_merges_naming_unknown_tokens_are_a_checkpoint_error(tmp_path: Path) -> None:
    """Issue #27 item 6: tokenizers' bare Exception (a merge of tokens not in the vocabulary) escaped load."""
    from anyquant.errors import CheckpointError

    tokens, types, merges = _byte_level_vocab()
    path = _write_tokenizer_gguf(
        tmp_path / "badmerges.gguf",
        model="gpt2",
        pre="llama-bpe",
        tokens=tokens,
        types=types,
        merges=[*merges, "nosuch token"],
    )
    with pytest.raises(CheckpointError, match=r"badmerges\.gguf: its tokenizer metadata"):
        tokenizer_from_gguf(path)
