"""Tokenizer loading from a checkpoint directory, offline and without remote code."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..probe import Probe

__all__ = ["load_tokenizer"]

log = logging.getLogger(__name__)


def load_tokenizer(probe: Probe, *, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer, or ``None`` (logged) when it ships none."""
    if not any(n.startswith(("tokenizer", "vocab")) for n in probe.tokenizer_files):
        log.warning("%s has no tokenizer files: text generation needs one", probe.root)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(probe.root), trust_remote_code=trust_remote_code, local_files_only=True)
