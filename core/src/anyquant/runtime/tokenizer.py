"""Tokenizer loading from a checkpoint directory, offline and without remote code."""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..probe import Probe

__all__ = ["load_tokenizer", "token_bytes"]

log = logging.getLogger(__name__)


#: tokenizer files larger than this are refused before parsing
MAX_TOKENIZER_FILE_BYTES = 256 << 20


def load_tokenizer(probe: Probe, *, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer, or ``None`` (logged) when it ships none.

    Tokenizer files that cannot be loaded (truncated or malformed ``tokenizer.json``, a class that needs
    remote code, a missing vocabulary file) are a :class:`~anyquant.errors.CheckpointError` naming the
    library's own complaint: the tokenizer libraries raise anything from ``JSONDecodeError`` to the Rust
    binding's bare ``Exception``."""
    from ..errors import AnyquantError, CheckpointError

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
    from ..errors import UnsafePathError
    from ..probe import _check_inside

    root = probe.root

    def link(src: os.DirEntry[str], dest_dir: str) -> None:
        try:
            _check_inside(root, root / os.path.relpath(src.path, root), probe.allow_symlinks)
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
                _check_inside(root, root / e.name, probe.allow_symlinks)
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
    from ..errors import AnyquantError
    from ..headers import loads_json

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
