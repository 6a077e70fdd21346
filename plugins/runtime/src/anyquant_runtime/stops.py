"""Stop strings over streamed text, shared by the generator and the server (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["find_stop", "held_back", "stable"]


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first of ``stops`` begins in ``text``, or ``None``."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` (a stable text: :func:`stable`) might still become a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


def stable(text: str) -> str:
    """``text`` without its trailing U+FFFD: a character whose bytes are split across tokens decodes as one
    U+FFFD (byte-level BPE) or one per byte (SentencePiece's byte fallback) until its last byte arrives, and
    then as itself; nothing up to it is streamed or searched for stop strings before then. (The final text,
    once generation ends, keeps any U+FFFD the model really produced.)"""
    return text.rstrip("\ufffd")
