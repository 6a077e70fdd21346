"""What a generation returns besides its text: :class:`GenerationResult` (``LoadedModel.complete``) and the
:class:`StreamChunk` pieces of ``LoadedModel.complete_stream``. Torch-free, frozen, plain values (``to_dict``
gives JSON-ready dicts, the shape ``anyquant generate --json`` prints).

``finish_reason`` is ``"stop"`` (an end-of-sequence token, or a stop string: ``stop_string`` names which) or
``"length"`` (``max_new_tokens`` reached, or the model's context: ``capped`` says so).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["Cap", "GenerationResult", "StreamChunk", "Timings", "TokenLogprob", "Usage", "collect"]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id, text (the token decoded alone) and natural-log probability under the model's
    own distribution (the log-softmax of its logits, before temperature, penalties or filters), with the
    ``top_logprobs`` most likely alternatives at that step as ``(token_id, text, logprob)``, best first."""

    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # every token sampled, the end-of-sequence token included when produced

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Wall-clock seconds. Prefill: until the first new token is known (the prompt's forward pass and the first
    sample); decode: the tokens after it."""

    prefill_seconds: float
    decode_seconds: float
    prefill_tokens_per_second: float | None  # prompt tokens / prefill seconds
    decode_tokens_per_second: float | None  # (completion tokens - 1) / decode seconds; None under two tokens


@dataclass(frozen=True)
class Cap:
    """``max_new_tokens`` was lowered before generating: the prompt leaves fewer positions in the model's context."""

    requested: int
    allowed: int
    context: int
    prompt_tokens: int

    @property
    def message(self) -> str:
        return (
            f"max_new_tokens capped at {self.allowed} (asked {self.requested}): the {self.prompt_tokens}-token prompt "
            f"leaves that many positions in this model's {self.context}-token context"
        )


@dataclass(frozen=True)
class GenerationResult:
    """A finished generation. ``token_ids`` are every token sampled (an end-of-sequence token included, and the
    tokens of a stop string, whose text ``text`` leaves out); ``logprobs`` is one :class:`TokenLogprob` per token
    id when asked for (``logprobs=True``), else ``None``."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop")
    logprobs: tuple[TokenLogprob, ...] | None = None
    capped: Cap | None = None
    #: a reasoning model's reasoning, apart from its answer ``text`` (gpt-oss's ``analysis`` channel, when a chat
    #: template in OpenAI's harmony format rendered the prompt); ``None`` when there is none
    reasoning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["token_ids"] = list(self.token_ids)
        out["usage"]["total_tokens"] = self.usage.total_tokens
        if self.capped is not None:
            out["capped"]["message"] = self.capped.message
        if self.logprobs is not None:
            out["logprobs"] = [{**asdict(lp), "top": [list(t) for t in lp.top]} for lp in self.logprobs]
        return out


@dataclass(frozen=True)
class StreamChunk:
    """A piece of ``complete_stream``: new ``text`` (may be empty while a possible stop string or a split character
    is held back), the ``token_ids`` sampled since the previous chunk (and their ``logprobs`` when asked for). The
    first chunk carries ``capped`` when the prompt capped ``max_new_tokens``; the last chunk (and only it) has
    ``finish_reason``, ``usage`` and ``timings`` set (its text and ids may be empty)."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    capped: Cap | None = None
    reasoning: str = ""  # new reasoning text (GenerationResult.reasoning), apart from the answer's ``text``


def collect(chunks: Iterable[StreamChunk]) -> GenerationResult:
    """The :class:`~anyquant.results.GenerationResult` of a ``complete_stream``'s chunks."""
    text: list[str] = []
    reasoning: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    cap = None
    for chunk in chunks:
        text.append(chunk.text)
        reasoning.append(chunk.reasoning)
        ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            logprobs = (logprobs or []) + list(chunk.logprobs)
        cap = cap or chunk.capped
        if chunk.finish_reason is not None:
            assert chunk.usage is not None and chunk.timings is not None
            return GenerationResult(
                text="".join(text),
                token_ids=tuple(ids),
                finish_reason=chunk.finish_reason,
                usage=chunk.usage,
                timings=chunk.timings,
                stop_string=chunk.stop_string,
                logprobs=None if logprobs is None else tuple(logprobs),
                capped=cap,
                reasoning="".join(reasoning) or None,
            )
    raise RuntimeError("the stream ended without a final chunk")  # a generator's defect, never the user's
