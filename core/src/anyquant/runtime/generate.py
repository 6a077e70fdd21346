"""Core's default :class:`~anyquant.protocols.Generator`: runs over any module whose
``forward(input_ids, attention_mask, position_ids, cache, use_cache)`` returns ``.logits`` and
``.cache`` (``past_key_values`` in older transformers): every transformers causal LM, and the
modules anyquant builds from them.

Greedy and sampled decoding with a KV cache, streaming with stop strings held back until they
are decided, chat templates, and left-padded batches.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import CheckpointError, ModelClosedError, NumericalError, ParameterError
from ..protocols import GenerationParams, Prompt
from .chat import render_chat

__all__ = ["TorchGenerator", "context_length", "sample_next"]

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512
"""Prompt positions per forward during prefill (llama.cpp's default micro-batch is 512 too)."""


def _eos_ids(module: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for cfg in (getattr(module, "generation_config", None), getattr(module, "config", None)):
        value = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return ids


def context_length(module: Any) -> int | None:
    """The positions the model was made for (``max_position_embeddings``), or ``None`` when unknown or when
    its RoPE scales itself past them (``dynamic``)."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        return None
    try:
        raw = cfg.to_dict() if hasattr(cfg, "to_dict") else cfg if isinstance(cfg, dict) else {}
    except Exception:  # another library's config object (exllamav3's): no limit known here
        return None
    if not isinstance(raw, dict):
        return None
    value = raw.get("max_position_embeddings")
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic":
            return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _check_text(prompt: Any) -> None:
    """Text the tokenizer can take: UTF-8 encodable (a command line's undecodable bytes arrive as lone
    surrogates, which tokenizers refuse with a bare TypeError)."""
    texts: list[Any] = [prompt] if isinstance(prompt, str) else []
    if isinstance(prompt, (list, tuple)):
        texts = [m.get("content") for m in prompt if isinstance(m, Mapping) and isinstance(m.get("content"), str)]
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ParameterError(
                f"the prompt is not valid text: {exc.reason} at character {exc.start} ({text[exc.start : exc.end]!r}; "
                "undecodable bytes on a command line arrive as lone surrogates)"
            ) from None


def _check_messages(messages: list[Any]) -> None:
    """Chat messages as chat templates read them: mappings with a string ``role`` and a ``content``."""
    if not messages:
        raise ParameterError("no chat messages: pass a string prompt or at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ParameterError(
                f"chat message {i} is {m!r}: expected a mapping with a string 'role' and a 'content', "
                "e.g. {'role': 'user', 'content': 'Hi'}"
            )


def sample_next(
    logits: torch.Tensor,
    params: GenerationParams,
    history: torch.Tensor,
    rng: torch.Generator | Sequence[torch.Generator] | None,
) -> torch.Tensor:
    """Pick the next token per row from ``logits`` [B, V] (fp32). ``history`` [B, T] for the penalty.

    :class:`~anyquant.errors.NumericalError` when a row holds NaN or +inf, or nothing but -inf: the model's
    output is not a distribution (NaN/inf weights, or an overflow in a narrow dtype), and sampling from it
    would fail in torch or pick an arbitrary token."""
    logits = logits.float()
    top = logits.amax(dim=-1)  # NaN anywhere in a row propagates; +inf shows; an all -inf row shows
    if not bool(torch.isfinite(top).all()):
        raise NumericalError(
            f"the model produced non-finite logits ({_non_finite(logits)}): its weights hold NaN/inf or its "
            "computation overflowed in this dtype. Load it in float32 or bfloat16; if that does not help, the "
            "checkpoint is damaged: re-download or re-export it"
        )
    if params.repetition_penalty != 1.0 and history.numel():
        seen = torch.gather(logits, 1, history)
        seen = torch.where(seen > 0, seen / params.repetition_penalty, seen * params.repetition_penalty)
        logits = logits.scatter(1, history, seen)
    if params.temperature <= 0:
        return logits.argmax(dim=-1)
    # the best logit becomes 0 first: a tiny temperature (1e-45) then gives -inf for the rest, never inf/inf
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs > params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if isinstance(rng, Sequence):  # one generator per row: a row samples as it would alone
        return torch.cat([torch.multinomial(probs[i : i + 1], 1, generator=g) for i, g in enumerate(rng)]).squeeze(-1)
    return torch.multinomial(probs, 1, generator=rng).squeeze(-1)


def _non_finite(logits: torch.Tensor) -> str:
    nan = int(torch.isnan(logits).sum())
    pos = int(torch.isposinf(logits).sum())
    parts = [f"{nan} NaN"] if nan else []
    parts += [f"{pos} +inf"] if pos else []
    return ", ".join(parts) or "a row of only -inf"


def row_generators(seed: int | None, rows: int, device: Any) -> list[torch.Generator]:
    """One private generator per row: row ``i`` is seeded ``seed + i`` (so row 0 of a batch samples as
    ``generate`` with the same seed does), or from ``os.urandom`` without a seed. torch's global generator is
    neither read nor reseeded (``torch.seed()`` would reset an application's ``manual_seed``)."""
    base = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
    return [torch.Generator(device=device).manual_seed((base + i) % 2**63) for i in range(rows)]


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` (a stable text: :func:`_stable`) might still become a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


def _stable(text: str) -> str:
    """``text`` without its trailing U+FFFD: a character whose bytes are split across tokens decodes as one
    U+FFFD (byte-level BPE) or one per byte (SentencePiece's byte fallback) until its last byte arrives, and
    then as itself; nothing up to it is streamed or searched for stop strings before then. (The final text,
    once generation ends, keeps any U+FFFD the model really produced.)"""
    return text.rstrip("\ufffd")


class TorchGenerator:
    """Token-by-token generation over a causal-LM module with a KV cache."""

    def __init__(
        self, module: Any, tokenizer: Any, *, device: torch.device | str = "cpu", eos_ids: Iterable[int] = ()
    ) -> None:
        """``eos_ids``: end-of-sequence ids besides the module's config's and the tokenizer's (the checkpoint's
        ``config.json`` and ``generation_config.json``: :func:`anyquant.loaders.end_of_sequence_ids`)."""
        self.module = module
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.eos_ids = _eos_ids(module, tokenizer) | set(eos_ids)
        self.cache_kw = _cache_keyword(module)
        self.keeps_logits = _takes(module, "logits_to_keep")
        self.context = context_length(module)

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: Prompt, params: GenerationParams) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise CheckpointError("this model has no tokenizer; pass token ids to .module directly")
        _check_text(prompt)
        chat = params.chat if params.chat is not None else not isinstance(prompt, str)
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            _check_messages(messages)
            if not getattr(tok, "chat_template", None):
                raise CheckpointError("this model's tokenizer has no chat template; pass a plain string prompt")
            text = render_chat(tok, messages, add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        if not isinstance(prompt, str):
            raise ParameterError("chat=False needs a string prompt")
        return list(tok(prompt)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    # ------------------------------------------------------------------ core loop
    @torch.inference_mode()
    def token_steps(
        self, batch: Sequence[Sequence[int]], params: GenerationParams, ends: Iterable[int] | None = None
    ) -> Iterator[list[int | None]]:
        """Yield, per step, the new token of every row (``None`` for rows already finished). A row finishes
        at one of ``ends`` (default: the end-of-sequence ids) or when it reaches the model's context."""
        if params.max_new_tokens <= 0:
            return
        self._check_prompts(batch)
        rows = len(batch)
        width = max(len(ids) for ids in batch)
        ends = sorted(self.eos_ids if ends is None else set(ends))
        # row i's prompt takes positions 0 .. len_i - 1 and its new token j (from 0) is fed at len_i + j; the
        # last new token is never fed: a prompt that fills the context still gets one
        limits = [
            params.max_new_tokens if self.context is None else min(params.max_new_tokens, self.context + 1 - len(ids))
            for ids in batch
        ]
        steps = max(limits)
        if min(limits) < params.max_new_tokens:
            log.warning(
                "generation stops at the model's context of %d tokens: at most %d new tokens after a %d-token "
                "prompt, not %d",
                self.context,
                min(limits),
                max(len(ids) for ids in batch),
                params.max_new_tokens,
            )
        pad = next(iter(self.eos_ids), 0)
        input_ids = torch.full((rows, width), pad, dtype=torch.long)
        history = torch.empty((rows, width), dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[i, width - len(ids) :] = 1
            # the padding repeats the row's first token for the repetition penalty: a token it has anyway
            history[i] = input_ids[i]
            history[i, : width - len(ids)] = ids[0]
        input_ids, mask, history = input_ids.to(self.device), mask.to(self.device), history.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        rng = row_generators(params.seed, rows, self.device) if params.temperature > 0 else None
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        last = torch.tensor([n - 1 for n in limits], device=self.device)  # the step of each row's last token
        end_ids = torch.tensor(ends, dtype=torch.long, device=self.device)
        out = self._prefill(input_ids, mask, positions, width + steps)
        for _step in range(steps):
            nxt = sample_next(out.logits[:, -1, :], params, history, rng)
            tokens: list[int | None] = [
                None if d else int(t) for t, d in zip(nxt.tolist(), done.tolist(), strict=False)
            ]
            yield tokens
            done |= torch.isin(nxt, end_ids) | (last <= _step)
            if bool(done.all()) or _step == steps - 1:
                return  # no forward for a token nobody will sample after
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            history = torch.cat([history, nxt[:, None]], dim=1)
            mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
            positions = positions[:, -1:] + 1
            cache = getattr(out, self.cache_kw)
            out = self._forward(
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self.cache_kw: cache},
            )

    closed = False

    def close(self) -> None:
        """Refuse further steps: a stream still being read (or a generation in another thread) stops with an
        :class:`~anyquant.errors.ModelClosedError` instead of running on a released model. The module is dropped
        here too: a stream left paused would otherwise keep the weights (and their open files) alive."""
        self.closed = True
        self.module = None

    def _forward(self, **kwargs: Any) -> Any:
        if self.closed:
            raise ModelClosedError("the model was closed while generating; load the checkpoint again")
        try:
            return self.module(**kwargs)
        except Exception as exc:
            if self.closed:  # closed from another thread mid-forward (a file it reads was closed)
                raise ModelClosedError("the model was closed while generating; load the checkpoint again") from exc
            raise

    def _prefill(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, capacity: int) -> Any:
        """The prompt's forward, :data:`PREFILL_CHUNK` positions at a time (one chunk's activations and
        attention scores live at once), keeping the logits of the last position only where the module takes
        ``logits_to_keep``; the cache gets room for ``capacity`` positions where the module makes its own
        (``new_cache``: never regrown, never copied). An 8,001-token prompt on the bundled SmolLM2 peaked at
        2.7 GB with the whole prompt's logits at once."""
        make_cache = getattr(self.module, "new_cache", None)
        cache = make_cache(capacity) if callable(make_cache) else None
        keep = {"logits_to_keep": 1} if self.keeps_logits else {}
        width = input_ids.shape[1]
        out: Any = None
        for start in range(0, width, PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, width)
            past = {self.cache_kw: cache} if cache is not None else {}
            out = self._forward(
                input_ids=input_ids[:, start:end],
                attention_mask=mask[:, :end],
                position_ids=positions[:, start:end],
                use_cache=True,
                **past,
                **keep,
            )
            cache = getattr(out, self.cache_kw)
        return out

    # ------------------------------------------------------------------ protocol
    def stream(self, prompt: Prompt, params: GenerationParams) -> Iterator[str]:
        ids = self.encode(prompt, params)  # now: a bad prompt raises here, not at the first next()
        self._check_prompts([ids])
        return self._stream(ids, params)

    def _check_prompts(self, batch: Sequence[Sequence[int]]) -> None:
        if min(len(ids) for ids in batch) == 0:
            raise ParameterError("empty prompt: nothing to condition on")
        width = max(len(ids) for ids in batch)
        if self.context is not None and width > self.context:
            raise ParameterError(
                f"the prompt is {width} tokens; this model's context is {self.context} "
                "(max_position_embeddings): shorten it"
            )

    def stop_ids(self, stops: Sequence[str]) -> frozenset[int]:
        """The ids of the stop strings that are one special (or added) token, such as ``<|im_end|>``: the text
        is decoded without special tokens, where such a stop string could never be found."""
        tok = self.tokenizer
        if not stops or tok is None:
            return frozenset()
        try:
            added = dict(tok.get_added_vocab())
        except Exception:  # a tokenizer without added-token bookkeeping
            added = {}
        special = set(getattr(tok, "all_special_tokens", ()) or ())
        return frozenset(added[s] for s in stops if s in added and (s in special or _is_special(tok, added[s])))

    def _stream(self, ids: list[int], params: GenerationParams) -> Iterator[str]:
        generated: list[int] = []
        emitted = 0
        ends = self.eos_ids | self.stop_ids(params.stop)
        for (token,) in self.token_steps([ids], params, ends):
            if token is None or token in ends:
                break
            generated.append(token)
            text = _stable(self.decode(generated))
            cut = _find_stop(text, params.stop)
            if cut is not None:
                if cut > emitted:
                    yield text[emitted:cut]
                return
            safe = len(text) - _held_back(text, params.stop)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
        text = self.decode(generated)
        cut = _find_stop(text, params.stop)
        end = cut if cut is not None else len(text)
        if end > emitted:
            yield text[emitted:end]

    def generate(self, prompt: Prompt, params: GenerationParams) -> str:
        return "".join(self.stream(prompt, params))

    def generate_batch(self, prompts: Sequence[Prompt], params: GenerationParams) -> list[str]:
        if not prompts:
            return []
        encoded = [self.encode(p, params) for p in prompts]
        self._check_prompts(encoded)
        generated: list[list[int]] = [[] for _ in prompts]
        finished = [False] * len(prompts)
        ends = self.eos_ids | self.stop_ids(params.stop)
        for tokens in self.token_steps(encoded, params, ends):
            for i, token in enumerate(tokens):
                if token is None or finished[i]:
                    continue
                if token in ends:
                    finished[i] = True
                    continue
                generated[i].append(token)
                if params.stop and _find_stop(_stable(self.decode(generated[i])), params.stop) is not None:
                    finished[i] = True
            if all(finished):
                break
        results = []
        for ids in generated:
            text = self.decode(ids)
            cut = _find_stop(text, params.stop)
            results.append(text if cut is None else text[:cut])
        return results

    def generate_ids(self, prompt_ids: Sequence[int], params: GenerationParams) -> list[int]:
        """New token ids (eos included when produced) for one tokenised prompt."""
        out: list[int] = []
        for (token,) in self.token_steps([list(prompt_ids)], params):
            if token is None:
                break
            out.append(token)
            if token in self.eos_ids:
                break
        return out


def _takes(module: Any, name: str) -> bool:
    """Whether ``module.forward`` takes a keyword ``name``."""
    import inspect

    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _cache_keyword(module: Any) -> str:
    """Recent transformers call the KV cache argument ``cache``; older ones ``past_key_values``."""
    import inspect

    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _is_special(tokenizer: Any, token_id: int) -> bool:
    """An added token the decoder drops with ``skip_special_tokens`` (transformers' ``AddedToken.special``)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    token = decoder.get(token_id)
    return bool(getattr(token, "special", False))
