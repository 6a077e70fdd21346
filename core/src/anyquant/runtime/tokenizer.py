"""Tokenizer loading from a checkpoint directory, offline and without remote code."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..probe import Probe

__all__ = ["load_tokenizer"]

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


def _load(probe: Probe, trust_remote_code: bool) -> Any:
    if not trust_remote_code and _generic_fast(probe):
        # what AutoTokenizer would build, without its AutoConfig round trip (which imports the model's
        # configuration module and, through it, torch.distributed.tensor: ~1 s of a ~2 s load)
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(probe.root), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(probe.root), trust_remote_code=trust_remote_code, local_files_only=True)


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
