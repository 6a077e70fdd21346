"""Rendering a checkpoint's chat template with a time and memory budget.

A chat template is code from the checkpoint. transformers renders it in jinja2's sandbox, which
stops it from reaching Python internals but not from running for hours (nested ``range`` loops)
or building gigabytes of text. :func:`render_chat` renders through the tokenizer's own
``apply_chat_template`` (so the text is exactly transformers') while a trace function, active on
this thread only and only for the template's own frames (jinja compiles templates to code named
``<template>``), checks the time spent and the process's resident memory every few lines and stops the
render with a :class:`~anyquant.errors.CheckpointError` when either budget is spent.

The rendered text is bounded too, while it is produced: tokenizing text costs far more memory than
the text itself, so a template that emits megabytes of filler would exhaust the process in the tokenizer
after the render. jinja2 joins a template's output chunks with its environment's ``concat``; on the
environment transformers compiled this template with, that is replaced by a join that counts characters
against the budget this thread set (and is a plain join for every other render), so the output is
byte-identical to ``apply_chat_template``'s and an over-long one stops at the chunk that crosses the limit.

Not covered: a single C-level operation inside the template (``'x' * 10**10``) runs to its end
before the next check.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from types import FrameType
from typing import Any

from anyquant.errors import CheckpointError, ParameterError

__all__ = [
    "CHAT_TEMPLATE_CHARS_PER_TOKEN",
    "CHAT_TEMPLATE_MAX_BYTES",
    "CHAT_TEMPLATE_MIN_CHARS",
    "CHAT_TEMPLATE_SECONDS",
    "render_chat",
    "template_source",
]

#: wall-clock seconds a chat template may take to render (real templates take milliseconds).
CHAT_TEMPLATE_SECONDS = 10.0
#: growth of the process's peak RSS a render may cause, in bytes (real prompts are kilobytes).
CHAT_TEMPLATE_MAX_BYTES = 1 << 30
#: characters a template may render per token of the model's context, beyond the messages' own text.
CHAT_TEMPLATE_CHARS_PER_TOKEN = 16
#: the least a template may render beyond the messages' own text, whatever the context.
CHAT_TEMPLATE_MIN_CHARS = 256 << 10
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


_budget = threading.local()  # .left: characters this thread's render may still produce; absent: unbounded


def _counting_concat(chunks: Iterable[str]) -> str:
    """``"".join(chunks)``, stopped once the chunks exceed the budget this thread's :func:`render_chat` set."""
    left = getattr(_budget, "left", None)
    if left is None:  # a render that is not ours (another caller of the same cached template)
        return "".join(chunks)
    out: list[str] = []
    for chunk in chunks:
        left -= len(chunk)
        if left < 0:
            raise _Runaway(f"rendered more than {_budget.limit:,} characters")
        out.append(chunk)
    return "".join(out)


def _text_length(value: Any, depth: int = 0) -> int:
    """Characters of text in the messages (and tools, documents): strings anywhere in lists and mappings."""
    if isinstance(value, str):
        return len(value)
    if depth > 32:
        return 0
    if isinstance(value, Mapping):
        return sum(_text_length(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_length(v, depth + 1) for v in value)
    return 0


def _hook_output(tokenizer: Any, kwargs: Mapping[str, Any]) -> bool:
    """Make the environment transformers renders this template with join through :func:`_counting_concat`;
    False when this transformers compiles templates some other way (then only the length after is checked)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        source = tokenizer.get_chat_template(kwargs.get("chat_template"), kwargs.get("tools"))
        env = _compile_jinja_template(source).environment  # the cached template apply_chat_template uses
    except Exception:  # no such helper, or a template that does not compile: apply_chat_template says why
        return False
    if env.concat is not _counting_concat:
        env.concat = _counting_concat
    return True


def template_source(tokenizer: Any, with_tools: bool = True) -> str | None:
    """The chat template's source text transformers would render (the ``tool_use`` one of a set, when there is
    one and tools are passed), or ``None`` when the tokenizer has none."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, list):  # [{"name": ..., "template": ...}] as tokenizer_config.json stores a set
        source = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
    if isinstance(source, Mapping):
        source = (source.get("tool_use") if with_tools else None) or source.get("default")
    return source if isinstance(source, str) and source else None


def render_chat(tokenizer: Any, messages: Sequence[Any], context_length: int | None = None, **kwargs: Any) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)`` under a budget.

    Raises :class:`CheckpointError` when the template overruns :data:`CHAT_TEMPLATE_SECONDS` or
    :data:`CHAT_TEMPLATE_MAX_BYTES`, or renders more than the messages' own text plus
    :data:`CHAT_TEMPLATE_CHARS_PER_TOKEN` characters per token of ``context_length`` (the model's
    ``max_position_embeddings``; at least :data:`CHAT_TEMPLATE_MIN_CHARS`); :class:`ParameterError` when it
    refuses the messages (its own ``raise_exception``, an undefined field).
    """
    messages = list(messages)
    extra = max(CHAT_TEMPLATE_MIN_CHARS, CHAT_TEMPLATE_CHARS_PER_TOKEN * (context_length or 0))
    limit = extra + _text_length(messages) + _text_length(dict(kwargs))
    name = getattr(tokenizer, "name_or_path", None) or "this model"
    hooked = _hook_output(tokenizer, kwargs)
    dog = _Watchdog(CHAT_TEMPLATE_SECONDS, CHAT_TEMPLATE_MAX_BYTES)
    previous = sys.gettrace()  # a debugger's or coverage's tracer: put back afterwards
    _budget.left, _budget.limit = limit, limit
    sys.settrace(dog.global_trace)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except _Runaway as exc:
        raise CheckpointError(
            f"this model's chat template {exc}; it was stopped (template of {name}; pass a plain string prompt)"
        ) from None
    except MemoryError:  # one allocation past what the machine has ("".join of a folded constant 10**5 times)
        raise CheckpointError("this model's chat template ran out of memory (pass a plain string prompt)") from None
    except Exception as exc:  # the template's own checks (jinja2's raise_exception, undefined fields)
        raise ParameterError(f"the chat template refused these messages: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.settrace(previous)
        del _budget.left, _budget.limit
    if not isinstance(text, str):
        raise CheckpointError(f"this model's chat template rendered a {type(text).__name__}, not text")
    if not hooked and len(text) > limit:
        raise CheckpointError(
            f"this model's chat template rendered {len(text):,} characters, more than {limit:,}; it was refused "
            f"before tokenizing (template of {name}; pass a plain string prompt)"
        )
    return text
