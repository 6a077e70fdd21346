"""``anyquant check`` and ``load(..., check=True)``: does the loaded model behave like a language model?

The most common complaint after "unsupported" is a checkpoint that loads and then writes nonsense (a wrong kernel,
a wrong layout, a broken conversion). The check is short and bounded: the perplexity of a small bundled English text
(:data:`CHECK_TEXT`, at most :data:`MAX_TOKENS` tokens) and a greedy answer to a fixed prompt. A model that predicts
nothing scores the vocabulary size (a uniform guess); a working one a small fraction of it. The verdict compares
the two on a log scale, ``r = ln(perplexity) / ln(vocabulary)`` (0: certain, 1: uniform): ``ok`` below
:data:`OK_BELOW`, ``broken`` from :data:`BROKEN_FROM` on (a mis-decoded model scores ~0.8-1.0), ``degraded`` between.
A random tiny test model is "broken" by this measure, rightly: it is not a language model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anyquant.errors import AnyquantError, ParameterError

if TYPE_CHECKING:
    from anyquant.protocols import LoadedModel

__all__ = ["BROKEN_FROM", "CHECK_TEXT", "OK_BELOW", "CheckReport", "ModelCheckError", "check"]

#: written for this check (public domain): plain English any language model of the families anyquant loads predicts
CHECK_TEXT = (
    "The morning train to the coast was late again, so most of the passengers waited on the platform with their "
    "coffee and their phones. A small girl asked her father why the sea was salty, and he told her that rivers carry "
    "a little salt from the rocks every day, and that the water which leaves the sea as rain leaves the salt behind. "
    "When the train finally arrived, the conductor apologised for the delay and explained that a tree had fallen "
    "across the line during the night. Nobody was hurt, he said, but the workers had needed two hours to cut it up "
    "and clear the track. The journey itself took a little under an hour. Outside the windows the fields gave way to "
    "low hills, then to a grey town with a church, a football ground and a long row of houses painted in different "
    "colours. At the last station the passengers walked down the hill to the harbour, where the fishing boats were "
    "coming back with their morning catch. The girl counted the boats, found that there were eleven of them, and "
    "decided that the blue one with the red stripe was the best. Her father bought two ice creams, although it was "
    "still early, and they sat on the wall of the harbour to eat them while the gulls watched every move they made."
)
#: the fixed question; a healthy instruction or base model continues it sensibly (its answer is shown, not scored)
PROMPT = "The capital of France is"
#: tokens of the text scored, and new tokens of the answer: the check's whole cost is bounded by these
MAX_TOKENS = 256
ANSWER_TOKENS = 16
#: ``r = ln(perplexity) / ln(vocabulary)`` below which the model is ``ok`` (SmolLM2-135M: ~0.25) ...
OK_BELOW = 0.45
#: ... and from which it is ``broken`` (a uniform guess is 1.0; swapped nibbles ~0.9)
BROKEN_FROM = 0.7


class ModelCheckError(AnyquantError):
    """``load(..., check=True)``: the loaded model does not behave like a language model (its report says why)."""

    def __init__(self, message: str, report: CheckReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class CheckReport:
    """What :func:`check` measured and concluded."""

    verdict: str  # "ok", "degraded" or "broken"
    perplexity: float
    vocab_size: int
    #: ``ln(perplexity) / ln(vocab_size)``: 0 certain, 1 a uniform guess
    uniform_fraction: float
    tokens: int
    answer: str
    format: str
    backend: str
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "perplexity": self.perplexity,
            "vocab_size": self.vocab_size,
            "uniform_fraction": self.uniform_fraction,
            "tokens": self.tokens,
            "answer": self.answer,
            "format": self.format,
            "backend": self.backend,
            "advice": list(self.advice),
        }

    def summary(self) -> str:
        head = {
            "ok": "behaves like a language model",
            "degraded": "works, but far from a healthy model",
            "broken": "does NOT behave like a language model",
        }[self.verdict]
        lines = [
            f"{self.verdict.upper()}: the model {head} ({self.format}, backend {self.backend}).",
            f"  perplexity {self.perplexity:.4g} on {self.tokens} tokens of English text; a uniform guess over its "
            f"{self.vocab_size} tokens scores {self.vocab_size} (ln ratio {self.uniform_fraction:.2f}; ok below "
            f"{OK_BELOW}, broken from {BROKEN_FROM})",
            f"  greedy answer to {PROMPT!r}: {self.answer!r}",
        ]
        lines += [f"  try: {a}" for a in self.advice]
        return "\n".join(lines)


def _advice(verdict: str, backend: str) -> list[str]:
    if verdict == "ok":
        return []
    out = []
    if backend not in ("reference", "dequantized"):
        out.append(
            f"load it with an exact backend, backend='dequantized' (or 'reference'): if that is ok, the {backend!r} path "
            "is at fault (report it with `anyquant inspect` output)"
        )
    out.append("`anyquant detect PATH`: is the format (and variant) the one the checkpoint was written as?")
    if verdict == "broken":
        out.append(
            "if the exact backend is broken too, the weights themselves are: re-download the checkpoint, or re-export it "
            "with the tool that made it (a conversion with the wrong group size or packing gives exactly this)"
        )
    else:
        out.append("a very low bit width or a small model can score here; compare with the unquantized model")
    return out


def _vocab_size(model: LoadedModel) -> int:
    value = getattr(getattr(model.module, "config", None), "vocab_size", None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise ParameterError("the model's config has no vocab_size: the check cannot say what a uniform guess scores")
    return value


def _perplexity(model: LoadedModel, ids: list[int]) -> float:
    """One window's perplexity (float32 logits; the same arithmetic as ``anyquant eval``)."""
    import torch
    import torch.nn.functional as F

    with torch.inference_mode():
        x = torch.tensor([ids], dtype=torch.long, device=model.device)
        logits = model.module(x).logits.float()
        nll = float(F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="mean"))
    return math.exp(nll) if nll < 709 else math.inf


def check(model: LoadedModel, *, text: str | None = None, max_tokens: int = MAX_TOKENS) -> CheckReport:
    """Score ``model`` on :data:`CHECK_TEXT` (or ``text``; at most ``max_tokens`` tokens) and answer :data:`PROMPT`
    greedily; see the module docstring for the verdict."""
    from anyquant_runtime.tokenizer import encode_text

    vocab = _vocab_size(model)
    if model.tokenizer is None:
        raise ParameterError("the model has no tokenizer: the check reads text")
    ids = encode_text(model.tokenizer, text if text is not None else CHECK_TEXT, add_special_tokens=False)[:max_tokens]
    if len(ids) < 16:
        raise ParameterError(f"the check text is {len(ids)} tokens; it needs at least 16")
    ppl = _perplexity(model, ids)
    fraction = math.log(ppl) / math.log(vocab) if math.isfinite(ppl) and ppl > 0 else math.inf
    verdict = "ok" if fraction < OK_BELOW else "broken" if not fraction < BROKEN_FROM else "degraded"
    answer = model.generate(PROMPT, max_new_tokens=ANSWER_TOKENS, temperature=0.0, chat=False)
    return CheckReport(
        verdict=verdict,
        perplexity=ppl,
        vocab_size=vocab,
        uniform_fraction=fraction,
        tokens=len(ids),
        answer=answer,
        format=model.format,
        backend=model.backend,
        advice=_advice(verdict, model.backend),
    )
