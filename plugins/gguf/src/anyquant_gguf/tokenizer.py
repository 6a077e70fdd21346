"""A transformers tokenizer built straight from a GGUF file's ``tokenizer.*`` metadata.

llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``), the token types (``token_type``:
3 = control, 4 = user-defined), the BPE merges, the special-token ids and the chat template
as metadata. For a byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``) the
``tokenizers`` objects are built here directly from the reader's fields:

* model: ``BPE(vocab, merges)`` with no unknown token, no prefix/suffix, no byte fallback;
  a token whose characters are not all in the GPT-2 byte alphabet is re-spelled through it
  (its UTF-8 bytes, one alphabet character each);
* pre-tokenizer: ``ByteLevel`` (GPT-2's split regex), or, for the ``tokenizer.ggml.pre``
  values listed in :data:`PRE_TOKENIZER_SPLITS`, that regex (isolated) followed by a
  regex-less ``ByteLevel``; decoder: ``ByteLevel``;
* control tokens (spelled in the byte alphabet) become special added tokens, user-defined
  tokens present in the vocabulary plain added tokens;
* the wrapper (``PreTrainedTokenizerFast``) gets bos/eos/unk/pad from the token ids,
  ``add_bos_token``/``add_eos_token`` and ``tokenizer.chat_template``; it is built only when first
  needed: the load returns a :class:`~anyquant_runtime.tokenizer.LazyTokenizer`, which answers
  encoding, decoding and the special tokens from the backend itself (no ``import transformers``).

This is what transformers' own GGUF path (``AutoTokenizer.from_pretrained(folder,
gguf_file=...)``) builds -- tests compare the two -- without reading the file a second time
or going through ``GGUFReader`` again (~4-6 s for a 49k vocabulary). Other vocabularies
(SentencePiece ``llama``, ``t5``, ...), a ``gpt2`` file without merges, or a ``pre`` value
not known here are handed to transformers' converter with the metadata already read, or, on
a transformers without it, to ``AutoTokenizer`` on the file.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from anyquant_runtime.tokenizer import LazyTokenizer

from .metadata import GGUFMetadataError, metadata_int

__all__ = [
    "PLAIN_BYTE_LEVEL_PRE",
    "PRE_TOKENIZER_SPLITS",
    "byte_alphabet",
    "tokenizer_config_from_metadata",
    "tokenizer_from_reader",
    "tokenizer_metadata",
]

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4

#: ``tokenizer.ggml.pre`` values for which transformers keeps GPT-2's own ``ByteLevel`` split.
PLAIN_BYTE_LEVEL_PRE: frozenset[str | None] = frozenset({None, "default", "gpt-2", "gpt2", "smollm"})

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: ``tokenizer.ggml.pre`` -> the split regex applied before a regex-less ``ByteLevel``.
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}

# tokenizer.* metadata -> the names transformers' GGUF path uses for them
_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.precompiled_charsmap": "precompiled_charsmap",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}
_CONFIG_KEYS = {
    "tokenizer.chat_template": "chat_template",
    "tokenizer.ggml.add_bos_token": "add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_eos_token",
}
_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@lru_cache(maxsize=1)
def byte_alphabet() -> tuple[str, ...]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the
    other 68 bytes take the characters from U+0100 on, in byte order."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = [], 0
    for byte in range(256):
        if byte in keep:
            table.append(chr(byte))
        else:
            table.append(chr(0x100 + extra))
            extra += 1
    return tuple(table)


def tokenizer_metadata(reader: Any) -> dict[str, Any]:
    """The ``tokenizer.*`` values of an open :class:`~anyquant_gguf.reader.GGUFFile` (plus ``general.architecture``
    and ``general.name``)."""
    keys = ("general.architecture", "general.name", *_TOKENIZER_KEYS, *_CONFIG_KEYS)
    out = {}
    for key in keys:
        field = reader.fields.get(key)
        if field is not None:
            out[key] = field.contents()
    _check_numbers(out)
    return out


#: flags llama.cpp reads as bools
_BOOL_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix")


def _check_numbers(meta: dict[str, Any]) -> None:
    """The numbers of the tokenizer metadata, checked as they are read (in place): a special token id is an
    integer (else :class:`~anyquant_gguf.metadata.GGUFMetadataError`) and one of the vocabulary's, or it is left out
    with a warning, as llama.cpp ignores it ("bad special token"); the flags are bools; the scores finite numbers,
    the token types integers."""
    tokens = meta.get("tokenizer.ggml.tokens")
    count = len(tokens) if isinstance(tokens, list) else None
    for key in _SPECIAL_IDS.values():
        if key not in meta:
            continue
        token_id = metadata_int(key, meta[key], minimum=None, maximum=None)
        if count is not None and not 0 <= (token_id or 0) < count:
            log.warning("GGUF metadata %s = %s is not one of the %d token ids: ignored", key, token_id, count)
            del meta[key]
        else:
            meta[key] = token_id
    for key in _BOOL_KEYS:
        if key in meta and not isinstance(meta[key], bool):
            raise GGUFMetadataError(f"GGUF metadata {key} = {meta[key]!r:.80} is not a bool; the file is damaged")
    for key, finite in (("tokenizer.ggml.scores", True), ("tokenizer.ggml.token_type", False)):
        values = meta.get(key)
        if values is None:
            continue
        if not isinstance(values, list):
            raise GGUFMetadataError(f"GGUF metadata {key} = {values!r:.80} is not an array; the file is damaged")
        types = set(map(type, values))  # whole-array checks first (a vocabulary's 150k scores: milliseconds)
        if types <= ({float, int} if finite else {int}) and (not finite or all(map(math.isfinite, values))):
            continue
        for index, value in enumerate(values):
            good = type(value) in (float, int) and math.isfinite(value) if finite else type(value) is int
            if not good:
                what = "a finite number" if finite else "an integer"
                raise GGUFMetadataError(
                    f"GGUF metadata {key}[{index}] = {value!r:.80} is not {what}; the file is damaged or was written "
                    "wrongly (re-download or re-convert it)"
                )


def tokenizer_config_from_metadata(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The wrapper's keyword arguments: chat template, add_bos/eos flags, special tokens."""
    config = {name: meta[key] for key, name in _CONFIG_KEYS.items() if key in meta}
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":  # llama.cpp adds BOS to a SentencePiece vocabulary unless told not to
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # the chat template writes <bos> itself
        config["add_bos_token"] = False
    tokens = meta.get("tokenizer.ggml.tokens") or []
    for name, key in _SPECIAL_IDS.items():
        token_id = metadata_int(key, meta.get(key), minimum=None, maximum=None)
        config[name] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    return config


def _merge_pairs(merges: list[str]) -> list[Any]:
    """``"a b"`` -> ``("a", "b")`` for every merge: in a few whole-list string operations when every merge is
    one space between two parts (checked exactly: the pairs put back together give the same text), else one
    merge at a time (a malformed merge then reaches the BPE model as it is, which refuses it)."""
    joined = "\0".join(merges)
    flat = joined.replace("\0", " ").split(" ")
    if len(flat) == 2 * len(merges):
        halves = iter(flat)
        pairs = list(zip(halves, halves, strict=True))
        if "\0".join(map(" ".join, pairs)) == joined:
            return pairs
    return [tuple(merge.split(" ")) for merge in merges]


def _byte_level_backend(meta: Mapping[str, Any]) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = byte_alphabet()
    spelled = frozenset(alphabet)
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if spelled.issuperset("".join(tokens)):  # every token spelled in the byte alphabet already (the usual case)
        vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    else:
        vocab = {}
        for index, token in enumerate(tokens):
            if not spelled.issuperset(token):
                token = "".join(alphabet[b] for b in token.encode("utf-8"))
            vocab[token] = index
    types = meta.get("tokenizer.ggml.token_type") or ()
    # a control token written in plain Unicode (DeepSeek's <｜begin▁of▁sentence｜>, <｜tool▁calls▁begin｜>, ...: what
    # the converter copies from the model's added tokens): matched in text by that spelling, as llama.cpp matches it,
    # at its own id (its plain spelling joins the vocabulary beside its byte spelling; the merges never reach it)
    plain = {
        token: index
        for index, (token, kind) in enumerate(zip(tokens, types, strict=False))
        if kind == CONTROL and not spelled.issuperset(token) and token not in vocab
    }
    merges = _merge_pairs(meta["tokenizer.ggml.merges"])
    backend = Tokenizer(
        BPE(
            vocab={**vocab, **plain} if plain else vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))  # type: ignore[arg-type]
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, types, strict=False)
        if kind == CONTROL and spelled.issuperset(token)
    ]
    control += [AddedToken(token, normalized=False, special=True) for token in plain]
    if control:
        backend.add_special_tokens(control)
    # what backend.get_vocab() would give (the control tokens added above are spelled as in the vocabulary),
    # without copying the vocabulary back out of the backend
    known = vocab
    user = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, types, strict=False)
        if kind == USER_DEFINED and token in known
    ]
    if user:
        backend.add_tokens(user)
    return backend


def _llama_cpp_token_attributes(backend: Any, meta: Mapping[str, Any]) -> Any:
    """Token attributes llama.cpp sets by model name (``llama_vocab::load``), which a GGUF does not store.

    Phi-3 (``general.name`` containing "phi-3" or "phi3"): its control, user-defined and unknown tokens
    and ``</s>`` strip the whitespace on their right (``<|user|>\nHi`` is ``<|user|>``, ``▁Hi``), all but
    ``<unk>``, ``<s>`` and ``<|endoftext|>`` -- what Phi-3's own ``tokenizer.json`` says with
    ``rstrip: true``. The added tokens are re-added with ``rstrip`` (same ids).
    """
    from tokenizers import AddedToken

    name = str(meta.get("general.name") or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return backend
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or ()
    known = backend.get_vocab()
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    strip = [
        token
        for token, kind in zip(tokens, types, strict=False)
        if (kind in (2, CONTROL, USER_DEFINED) or token == "</s>") and token not in keep and token in known
    ]
    specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    if strip:
        backend.add_special_tokens(
            [AddedToken(t, rstrip=True, normalized=False, special=True) for t in strip if t in specials]
        )
        backend.add_tokens([AddedToken(t, rstrip=True, normalized=False) for t in strip if t not in specials])
    return backend


def _wrap(backend: Any, config: Mapping[str, Any], name_or_path: str | None) -> Any:
    """``PreTrainedTokenizerFast`` around ``backend`` (which it takes over).

    ``tokenizer_object=`` deep-copies the backend (a JSON round trip: ~0.1 s and ~20 MiB of
    transient, fragmenting allocations for a 49k vocabulary); transformers 5 also adopts a
    backend already set on the instance, which is tried first.
    """
    from transformers import PreTrainedTokenizerFast

    kwargs = dict(config)
    if name_or_path is not None:
        kwargs["name_or_path"] = name_or_path
    if getattr(PreTrainedTokenizerFast, "_tokenizer", False) is None:  # transformers 5: a class default
        tok = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
        tok._tokenizer = backend
        try:
            tok.__init__(**kwargs)  # type: ignore[misc]
        except (TypeError, ValueError):
            pass
        else:
            if tok.backend_tokenizer is backend:
                return tok
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)  # type: ignore[no-untyped-call]


def _lazy(backend: Any, config: Mapping[str, Any], name_or_path: str | None) -> LazyTokenizer:
    """A :class:`~anyquant_runtime.tokenizer.LazyTokenizer` over ``backend`` whose transformers wrapper is
    :func:`_wrap`'s (built when first needed)."""
    return LazyTokenizer(
        backend,
        functools.partial(_wrap, config=dict(config), name_or_path=name_or_path),
        special_tokens={name: config.get(name) for name in _SPECIAL_IDS},
        add_bos_token=bool(config.get("add_bos_token", False)),
        add_eos_token=bool(config.get("add_eos_token", False)),
        chat_template=config.get("chat_template"),
        name_or_path=name_or_path or "",
    )


def _builds_here(meta: Mapping[str, Any]) -> bool:
    pre = meta.get("tokenizer.ggml.pre")
    return (
        meta.get("tokenizer.ggml.model") == "gpt2"
        and bool(meta.get("tokenizer.ggml.merges"))
        and (pre in PLAIN_BYTE_LEVEL_PRE or pre in PRE_TOKENIZER_SPLITS)
    )


def _transformers_converter(meta: Mapping[str, Any], name_or_path: str | None, path: str | None) -> Any:
    """transformers' own GGUF tokenizer converter, fed the metadata already read."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer  # type: ignore[attr-defined]
    except ImportError:  # an older transformers: its GGUF path reads the file itself
        if path is None:
            raise
        from transformers import AutoTokenizer

        folder, filename = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=filename, local_files_only=True)
    tokenizer_dict = {name: meta[key] for key, name in _TOKENIZER_KEYS.items() if key in meta}
    backend, additional = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    backend = _llama_cpp_token_attributes(backend, meta)
    return _wrap(backend, {**tokenizer_config_from_metadata(meta), **additional}, name_or_path)


def tokenizer_from_metadata(
    meta: Mapping[str, Any], *, name_or_path: str | None = None, path: str | None = None
) -> Any:
    """The tokenizer of :func:`tokenizer_metadata`'s dict: a ``LazyTokenizer`` where it is built here, else a
    ``PreTrainedTokenizerFast`` (see module doc)."""
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens: it carries no tokenizer")
    try:
        if _builds_here(meta):
            backend = _llama_cpp_token_attributes(_byte_level_backend(meta), meta)
            return _lazy(backend, tokenizer_config_from_metadata(meta), name_or_path)
        return _transformers_converter(meta, name_or_path, path)
    except (ImportError, MemoryError):
        raise
    except Exception as exc:  # tokenizers raises a bare Exception (a merge naming a token not in the vocabulary)
        from anyquant.plugin import AnyquantError, CheckpointError

        if isinstance(exc, AnyquantError):
            raise
        where = os.path.basename(path) if path else (name_or_path or "the GGUF file")
        raise CheckpointError(
            f"{where}: its tokenizer metadata (tokenizer.ggml.*) cannot be built into a tokenizer: "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}. The file is damaged or was written "
            "wrongly; re-download or re-convert it"
        ) from exc


def tokenizer_from_reader(reader: Any) -> Any:
    """The tokenizer of an open :class:`~anyquant_gguf.reader.GGUFFile` (its metadata is not read again)."""
    path = getattr(reader, "path", None)
    folder = None if path is None else os.path.dirname(os.path.abspath(path))
    return tokenizer_from_metadata(tokenizer_metadata(reader), name_or_path=folder, path=path)
