"""What generation takes: :class:`GenerationParams` (checked when made), the keywords of ``generate`` and its kin
(:class:`GenerationKwargs`) and the :data:`Prompt` type. Torch-free; :mod:`anyquant.protocols` re-exports them
(the generators in :mod:`anyquant_runtime` import them from here, which keeps ``protocols`` free to use them)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from .errors import ParameterError

__all__ = ["MIN_TEMPERATURE", "GenerationKwargs", "GenerationParams", "Prompt"]

#: the smallest temperature above 0 that sampling can divide float32 logits by: a smaller one rounds to 0 in
#: float32 and turns the best logit into 0/0 = NaN (a ``ParameterError`` here, not a bare ``RuntimeError`` from
#: torch's sampler at the first token)
MIN_TEMPERATURE = 1e-45

#: a plain prompt, token ids (a list of ints, passed to the model as they are: no special tokens added, no chat
#: template), or chat messages (``[{"role": "user", "content": "..."}]``; a message's content may be anything its
#: chat template reads: a string, a list of parts, ``None``).
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class GenerationParams:
    """How to generate. Out-of-range or mistyped values are a :class:`~anyquant.errors.ParameterError`
    when the object is made (``temperature=-1``, ``top_p=2``, ``max_new_tokens="5"``, ``stop=[1]``)."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    chat: bool | None = None  # None: apply the chat template to message lists only
    #: drop tokens whose probability is below ``min_p`` times the best token's (0 = off); sampling only
    min_p: float = 0.0
    #: subtracted from the logit of every token already generated (OpenAI's, in [-2, 2]; 0 = off)
    presence_penalty: float = 0.0
    #: subtracted from a token's logit once per time it was generated (OpenAI's, in [-2, 2]; 0 = off)
    frequency_penalty: float = 0.0
    #: added to the logits of these token ids before anything else (OpenAI's, values in [-100, 100])
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)  # params stay hashable
    #: ``complete``/``complete_stream``: report each generated token's log-probability
    logprobs: bool = False
    #: with ``logprobs``: also the ``top_logprobs`` most likely tokens at each step (0-20)
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> ParameterError:
            return ParameterError(f"{name}={getattr(self, name)!r}: expected {want}")

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", "an integer >= 0")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a number >= 0 (0 = greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise bad("temperature", f"0 (greedy) or at least {MIN_TEMPERATURE:g} (smaller ones underflow float32)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0 = off)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1] (1 = off)")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a number > 0 (1 = off)")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "non-empty strings")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "an integer in [0, 2**63) or None")
        if self.chat is not None and not isinstance(self.chat, bool):
            raise bad("chat", "True, False or None")
        if not _is_number(self.min_p) or not 0 <= self.min_p < 1:
            raise bad("min_p", "a number in [0, 1) (0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, "a number in [-2, 2] (0 = off)")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.logit_bias, Mapping) or not all(
            _is_int(k) and k >= 0 and _is_number(v) and -100 <= v <= 100 for k, v in self.logit_bias.items()
        ):
            raise bad("logit_bias", "a mapping of token ids (integers >= 0) to numbers in [-100, 100]")
        object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        if not isinstance(self.logprobs, bool):
            raise bad("logprobs", "True or False")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", "an integer in [0, 20]")
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs", "0 unless logprobs=True")
        object.__setattr__(self, "min_p", float(self.min_p))
        object.__setattr__(self, "top_logprobs", int(self.top_logprobs))
        # numpy scalars (np.int64(5), np.float32(0.5)) pass the checks above; keep plain Python values
        for name, kind in (("max_new_tokens", int), ("top_k", int), ("temperature", float), ("top_p", float)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))


class GenerationKwargs(TypedDict, total=False):
    """The keywords of ``generate``/``stream``/``generate_batch``: :class:`GenerationParams`' fields, so a
    type checker flags a misspelt ``max_tokens`` as the runtime does; ``stop`` may also be one string."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    stop: str | Sequence[str] | None
    seed: int | None
    chat: bool | None
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: Mapping[int, float]
    logprobs: bool
    top_logprobs: int


def _is_int(value: object) -> bool:
    """An integer, numpy's included (``numbers.Integral``), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite real number, numpy's included (``numbers.Real``), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
