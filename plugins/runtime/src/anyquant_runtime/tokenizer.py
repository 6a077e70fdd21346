"""Tokenizer loading from a checkpoint directory, offline and without remote code."""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from anyquant.probe import Probe

__all__ = ["LazyTokenizer", "encode_text", "load_tokenizer", "token_bytes"]

log = logging.getLogger(__name__)


#: tokenizer files larger than this are refused before parsing
MAX_TOKENIZER_FILE_BYTES = 256 << 20


def load_tokenizer(probe: Probe, *, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer, or ``None`` (logged) when it ships none.

    Tokenizer files that cannot be loaded (truncated or malformed ``tokenizer.json``, a class that needs
    remote code, a missing vocabulary file) are a :class:`~anyquant.errors.CheckpointError` naming the
    library's own complaint: the tokenizer libraries raise anything from ``JSONDecodeError`` to the Rust
    binding's bare ``Exception``."""
    from anyquant.errors import AnyquantError, CheckpointError

    if not any(n.startswith(("tokenizer", "vocab")) for n in probe.tokenizer_files):
        log.warning("%s has no tokenizer files: text generation needs one", probe.root)
        return None
    for name in probe.tokenizer_files:
        size = (probe.root / name).stat().st_size
        if size > MAX_TOKENIZER_FILE_BYTES:
            raise CheckpointError(
                f"{probe.root / name}: {size / 2**20:.0f} MiB, over the {MAX_TOKENIZER_FILE_BYTES >> 20} MiB a "
                "tokenizer file may have (the largest real ones are tens of MiB; parsing peaks at ~3x the file)"
            )
    try:
        return _load(probe, trust_remote_code)
    except AnyquantError:
        raise
    except Exception as exc:
        detail = " ".join(str(exc).split())[:300]
        try:
            os.fsencode(probe.root).decode("utf-8")
        except UnicodeError:
            # the Rust tokenizer library takes paths as UTF-8 strings; the files may be fine
            raise CheckpointError(
                f"{probe.root!s}: the tokenizer library cannot open files under a path that is not valid UTF-8 "
                f"({type(exc).__name__}); rename the directory (or a parent) or link it from a UTF-8 path"
            ) from exc
        raise CheckpointError(
            f"{probe.root}: its tokenizer files ({', '.join(probe.tokenizer_files)}) cannot be loaded: "
            f"{type(exc).__name__}: {detail}"
        ) from exc


#: what the tokenizer libraries never read: left out of the vetted directory (no need to link gigabytes)
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".npz", ".h5", ".msgpack")
#: the subdirectories transformers' tokenizer loading reads (``additional_chat_templates/*.jinja``)
_TOKENIZER_SUBDIRS = ("additional_chat_templates",)


def _vetted_dir(probe: Probe, into: str) -> None:
    """Fill ``into`` with links to the checkpoint's files that the tokenizer libraries may read, each link
    pointing at its file's real path, vetted: a regular file inside the checkpoint directory (or, for a
    Hugging Face cache snapshot, a blob of the same repository). A file that resolves elsewhere (a link
    leaving the directory) or is no regular file is left out, so its content never reaches the tokenizer:
    transformers reads files the probe does not list (``added_tokens.json``, ``additional_chat_templates/``,
    a tokenizer class's own vocabulary names), and this covers every one of them."""
    from anyquant.errors import UnsafePathError
    from anyquant.probe import require_inside

    root = probe.root

    def link(src: os.DirEntry[str], dest_dir: str) -> None:
        try:
            require_inside(root, root / os.path.relpath(src.path, root), probe.allow_symlinks)
            real = os.path.realpath(src.path)
            if not os.path.isfile(real) or os.path.getsize(real) > MAX_TOKENIZER_FILE_BYTES:
                raise UnsafePathError(f"{src.name}: not a regular file of a size a tokenizer file may have")
        except (UnsafePathError, OSError) as exc:
            log.warning("%s: left out of what the tokenizer may read (%s)", src.path, exc)
            return
        try:
            os.symlink(real, os.path.join(dest_dir, src.name))
        except OSError:  # no symlinks here (Windows without the privilege): a copy of the vetted file
            import shutil

            shutil.copyfile(real, os.path.join(dest_dir, src.name))

    with os.scandir(root) as it:
        entries = list(it)
    for e in entries:
        if e.name in _TOKENIZER_SUBDIRS:
            try:
                require_inside(root, root / e.name, probe.allow_symlinks)
            except UnsafePathError as exc:
                log.warning("%s: left out of what the tokenizer may read (%s)", e.path, exc)
                continue
            if e.is_dir():
                sub = os.path.join(into, e.name)
                os.mkdir(sub)
                with os.scandir(e.path) as it:
                    for f in it:
                        link(f, sub)
        elif not e.name.endswith(_WEIGHT_SUFFIXES) and e.is_file():
            link(e, into)


def _load(probe: Probe, trust_remote_code: bool) -> Any:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="anyquant-tokenizer-") as vetted:
        _vetted_dir(probe, vetted)
        tokenizer = _from_pretrained(probe, vetted, trust_remote_code)
    try:  # the name it was loaded by is the checkpoint's, not the vetted directory's
        tokenizer.name_or_path = str(probe.root)
        tokenizer.init_kwargs["name_or_path"] = str(probe.root)
    except (AttributeError, TypeError):  # pragma: no cover - a remote-code tokenizer without the attribute
        pass
    return tokenizer


def _from_pretrained(probe: Probe, path: str, trust_remote_code: bool) -> Any:
    if not trust_remote_code and _generic_fast(probe):
        # what AutoTokenizer would build, without its AutoConfig round trip (which imports the model's
        # configuration module and, through it, torch.distributed.tensor: ~1 s of a ~2 s load)
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)


#: ``tokenizer_class`` values AutoTokenizer (transformers 5) resolves to the generic ``TokenizersBackend``.
GENERIC_FAST = frozenset({"TokenizersBackend", "TokenizersBackendFast", "PreTrainedTokenizerFast"})


def _generic_fast(probe: Probe) -> bool:
    """The checkpoint's tokenizer is the generic fast one: a ``tokenizer.json`` and a ``tokenizer_config.json``
    naming a :data:`GENERIC_FAST` class (and no ``auto_map``)."""
    from anyquant.errors import AnyquantError
    from anyquant.headers import loads_json

    if "tokenizer.json" not in probe.tokenizer_files or "tokenizer_config.json" not in probe.tokenizer_files:
        return False
    path = probe.root / "tokenizer_config.json"
    try:
        if path.stat().st_size > 16 << 20:
            return False
        cfg = loads_json(path.read_bytes(), "tokenizer_config.json", strict_keys=False)
    except (OSError, AnyquantError):  # anything odd: AutoTokenizer decides (and reports)
        return False
    return isinstance(cfg, dict) and cfg.get("tokenizer_class") in GENERIC_FAST and "auto_map" not in cfg


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of ``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _decodes_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    try:
        state = decoder.__getstate__()  # the decoder's own JSON (small: not the vocabulary)
    except Exception:  # a decoder without it
        return type(decoder).__name__ == "ByteLevel"
    return b"ByteLevel" in (state if isinstance(state, bytes) else str(state).encode())


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes token ``token_id`` stands for, also when they are only part of a UTF-8 character (where decoding
    the token alone gives U+FFFD): a byte-level BPE piece through GPT-2's byte alphabet, a SentencePiece byte
    piece (``<0xE2>``) as that byte, the SentencePiece word marker ``▁`` as a space, a special token as its text."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if not isinstance(piece, str):
        return b""
    special = getattr(tokenizer, "all_special_ids", ()) or ()
    if int(token_id) in special:
        return piece.encode("utf-8")
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if _decodes_byte_level(tokenizer):
        alphabet = _byte_level_alphabet()
        if all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
    return piece.replace("\u2581", " ").encode("utf-8")


#: transformers' named special tokens, in its order (``PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES``)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_materializing = threading.Lock()


class LazyTokenizer:
    """A tokenizer over a ``tokenizers.Tokenizer`` that answers what anyquant's runtime asks (encoding,
    decoding, special tokens, the added vocabulary, the chat template's text) itself, and builds transformers'
    ``PreTrainedTokenizerFast`` only when something else is asked: ``import transformers`` alone is ~0.5 s, more
    than the rest of a small model's load.

    At construction the backend is given what the wrapper's constructor would give it: the named special
    tokens missing from its added tokens become special added tokens, and its post-processor the
    ``TemplateProcessing`` that writes BOS/EOS as ``add_bos_token``/``add_eos_token`` say (transformers 5's
    ``update_post_processor``), so ``encode`` and ``decode`` here equal the wrapper's (the tests compare them,
    and the backends' JSON). Any other attribute, a call (``tokenizer(text)``), or setting an attribute
    builds the wrapper over the same backend (``make(backend)``), and from then on every attribute is the
    wrapper's; :meth:`as_transformers` returns it (for code that checks ``isinstance``).
    """

    def __init__(
        self,
        backend: Any,
        make: Callable[[Any], Any],
        *,
        special_tokens: Mapping[str, str | None],
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        name_or_path: str = "",
    ) -> None:
        from tokenizers import AddedToken, processors

        named = {name: special_tokens.get(name) for name in SPECIAL_TOKEN_NAMES}
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [AddedToken(t, special=True) for t in named.values() if t is not None and t not in added]
        if missing:
            backend.add_tokens(missing)
        state = self.__dict__
        state["_backend"], state["_make"], state["_real"] = backend, make, None
        state["_special"] = named
        state["add_bos_token"] = bool(add_bos_token) and named["bos_token"] is not None
        state["add_eos_token"] = bool(add_eos_token) and named["eos_token"] is not None
        state["chat_template"], state["name_or_path"] = chat_template, name_or_path
        bos, eos = named["bos_token"], named["eos_token"]
        single = f"{bos}:0 " if self.add_bos_token else ""
        single += "$A:0" + (f" {eos}:0" if self.add_eos_token else "")
        pair = f"{single}{f' {bos}:1' if self.add_bos_token else ''} $B:1{f' {eos}:1' if self.add_eos_token else ''}"
        on = ((bos, self.add_bos_token), (eos, self.add_eos_token))
        template = [(token, self._token_id(token)) for token, add in on if add and token is not None]
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=template)

    # -- the transformers wrapper, built on demand ------------------------------------------------------------
    def as_transformers(self) -> Any:
        """transformers' tokenizer over the same backend (built on the first call)."""
        real = self.__dict__["_real"]
        if real is None:
            with _materializing:
                real = self.__dict__["_real"]
                if real is None:
                    log.debug("building transformers' tokenizer wrapper for %s", self.name_or_path)
                    real = self.__dict__["_real"] = self._make(self._backend)
        return real

    def __getattr__(self, name: str) -> Any:  # only for names not found on the instance or the class
        if name.startswith("__") or name in ("_backend", "_make", "_real", "_special"):
            raise AttributeError(name)
        return getattr(self.as_transformers(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.as_transformers(), name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.as_transformers()(*args, **kwargs)

    def __getattribute__(self, name: str) -> Any:
        # once the wrapper exists, it answers everything (a user may have changed its state)
        state = object.__getattribute__(self, "__dict__")
        real = state.get("_real")
        if real is not None and not name.startswith("__") and name not in _OWN:
            return getattr(real, name)
        return object.__getattribute__(self, name)

    def __repr__(self) -> str:
        real = self.__dict__["_real"]
        if real is not None:
            return repr(real)
        return f"LazyTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        real = self.__dict__["_real"]
        return len(real) if real is not None else int(self._backend.get_vocab_size(with_added_tokens=True))

    # -- what the runtime asks, answered from the backend -------------------------------------------------------
    @property
    def is_fast(self) -> bool:
        return True

    @property
    def backend_tokenizer(self) -> Any:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._backend.get_vocab(with_added_tokens=True))

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return dict(self._backend.get_added_tokens_decoder())

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items(), key=lambda item: item[0])}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    def _token_id(self, token: str) -> int | None:
        index = self._backend.token_to_id(token)
        if index is None:
            unk = self._special["unk_token"]
            return None if unk is None else self._backend.token_to_id(unk)
        return int(index)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: value for name, value in self._special.items() if value is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(v for v in self._special.values() if v is not None))

    @property
    def all_special_ids(self) -> list[int | None]:
        return [self._token_id(t) for t in self.all_special_tokens]

    @property
    def extra_special_tokens(self) -> list[str]:
        return []

    def encode(self, text: Any, *args: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """The token ids of ``text`` (a string); any other input or option: transformers' ``encode``."""
        if args or kwargs or not isinstance(text, str):
            return self.as_transformers().encode(text, *args, add_special_tokens=add_special_tokens, **kwargs)
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        """The text of one sequence of ids (``clean_up_tokenization_spaces`` is off, as the wrapper's default);
        a batch, a tensor or another option: transformers' ``decode``."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if kwargs or not isinstance(token_ids, (list, tuple)) or not all(isinstance(i, int) for i in token_ids):
            return self.as_transformers().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


def _special_property(name: str) -> property:
    def token(self: LazyTokenizer) -> str | None:
        return self._special[name]  # type: ignore[no-any-return]

    return property(token)


def _special_id_property(name: str) -> property:
    def token_id(self: LazyTokenizer) -> int | None:
        value = self._special[name]
        return None if value is None else self._token_id(value)

    return property(token_id)


for _name in SPECIAL_TOKEN_NAMES:
    setattr(LazyTokenizer, _name, _special_property(_name))
    setattr(LazyTokenizer, f"{_name}_id", _special_id_property(_name))
#: the proxy's own names: answered by it even after the wrapper was built
_OWN = frozenset({"as_transformers", "_backend", "_make", "_real", "_special"})


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer(text, add_special_tokens=...)["input_ids"]``, without building a :class:`LazyTokenizer`'s
    transformers wrapper."""
    if isinstance(tokenizer, LazyTokenizer):
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    return [int(i) for i in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]
