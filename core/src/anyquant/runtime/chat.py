"""Rendering a checkpoint's chat template with a time and memory budget.

A chat template is code from the checkpoint. transformers renders it in jinja2's sandbox, which
stops it from reaching Python internals but not from running for hours (nested ``range`` loops)
or building gigabytes of text. :func:`render_chat` renders through the tokenizer's own
``apply_chat_template`` (so the text is exactly transformers') while a trace function, active on
this thread only and only for the template's own frames (jinja compiles templates to code named
``<template>``), checks the time spent and the process's resident memory every few lines and stops the
render with a :class:`~anyquant.errors.CheckpointError` when either budget is spent.

Not covered: a single C-level operation inside the template (``'x' * 10**10``) runs to its end
before the next check.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from ..errors import CheckpointError, ParameterError

__all__ = ["CHAT_TEMPLATE_MAX_BYTES", "CHAT_TEMPLATE_SECONDS", "render_chat"]

#: wall-clock seconds a chat template may take to render (real templates take milliseconds).
CHAT_TEMPLATE_SECONDS = 10.0
#: growth of the process's peak RSS a render may cause, in bytes (real prompts are kilobytes).
CHAT_TEMPLATE_MAX_BYTES = 1 << 30
#: lines of template code run between two budget checks.
_CHECK_EVERY = 64
_TEMPLATE_FILENAME = "<template>"
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere


def _rss() -> int:
    """The process's resident bytes now (Linux), else its peak so far; 0 where neither is known."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource  # not on Windows: no memory budget there
    except ImportError:  # pragma: no cover
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT


try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
    _PAGE = 4096


class _Runaway(Exception):
    """Raised from the trace function into the template's frame; turned into a CheckpointError."""


class _Watchdog:
    def __init__(self, seconds: float, max_bytes: int) -> None:
        self.seconds = seconds
        self.max_bytes = max_bytes
        self.lines = 0
        self.deadline = time.monotonic() + seconds
        self.peak0 = _rss()

    def global_trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self.local_trace if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    def local_trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        self.lines += 1
        if self.lines % _CHECK_EVERY == 0:
            if time.monotonic() > self.deadline:
                raise _Runaway(f"ran for more than {self.seconds:g} s")
            grown = _rss() - self.peak0
            if grown > self.max_bytes:
                raise _Runaway(
                    f"grew the process's memory by {grown / 2**20:.0f} MiB (limit {self.max_bytes / 2**20:.0f})"
                )
        return self.local_trace


def render_chat(tokenizer: Any, messages: Sequence[Any], **kwargs: Any) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)`` under a budget.

    Raises :class:`CheckpointError` when the template overruns :data:`CHAT_TEMPLATE_SECONDS` or
    :data:`CHAT_TEMPLATE_MAX_BYTES`, :class:`ParameterError` when it refuses the messages (its own
    ``raise_exception``, an undefined field).
    """
    dog = _Watchdog(CHAT_TEMPLATE_SECONDS, CHAT_TEMPLATE_MAX_BYTES)
    previous = sys.gettrace()  # a debugger's or coverage's tracer: put back afterwards
    sys.settrace(dog.global_trace)
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)
    except _Runaway as exc:
        raise CheckpointError(
            f"this model's chat template {exc}; it was stopped (pass a plain string prompt)"
        ) from None
    except MemoryError:  # one allocation past what the machine has ("".join of a folded constant 10**5 times)
        raise CheckpointError("this model's chat template ran out of memory (pass a plain string prompt)") from None
    except Exception as exc:  # the template's own checks (jinja2's raise_exception, undefined fields)
        raise ParameterError(f"the chat template refused these messages: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.settrace(previous)
    if not isinstance(text, str):
        raise CheckpointError(f"this model's chat template rendered a {type(text).__name__}, not text")
    return text
