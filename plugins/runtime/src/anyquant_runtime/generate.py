"""Core's default :class:`~anyquant.protocols.Generator`: runs over any module whose
``forward(input_ids, attention_mask, position_ids, cache, use_cache)`` returns ``.logits`` and
``.cache`` (``past_key_values`` in older transformers): every transformers causal LM, and the
modules anyquant builds from them.

Greedy and sampled decoding with a KV cache, streaming with stop strings held back until they
are decided, chat templates, and left-padded batches.
"""

from __future__ import annotations

import logging
import numbers
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from anyquant.errors import CheckpointError, ModelClosedError, NumericalError, ParameterError
from anyquant.params import GenerationParams, Prompt
from anyquant.results import Cap, GenerationResult, StreamChunk, Timings, TokenLogprob, Usage, collect

from .chat import render_chat, template_source
from .harmony import ENDS as HARMONY_ENDS
from .harmony import HarmonyStream, is_harmony, parse_harmony
from .stops import find_stop, held_back, stable
from .tokenizer import encode_text

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
    generated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick the next token per row from ``logits`` [B, V] (fp32). ``history`` [B, T] (prompt and generated
    tokens) for the repetition penalty, ``generated`` [B, N] (the new tokens only) for the presence and frequency
    penalties. In order: ``logit_bias`` is added, the repetition penalty divides positive logits (multiplies
    negative ones) of tokens in ``history``, ``presence_penalty`` + ``frequency_penalty`` x count is subtracted for
    tokens in ``generated``; greedy takes the argmax of that; sampling divides by ``temperature`` and keeps the
    ``top_k``, the ``top_p`` nucleus, and the tokens with probability >= ``min_p`` x the best one's.

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
    if params.logit_bias:
        vocab = logits.shape[-1]
        bias = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
        for token, value in params.logit_bias.items():
            if token >= vocab:
                raise ParameterError(f"logit_bias names token {token}; this model's vocabulary has {vocab} tokens")
            bias[token] = value
        logits = logits + bias
    if params.repetition_penalty != 1.0 and history.numel():
        seen = torch.gather(logits, 1, history)
        seen = torch.where(seen > 0, seen / params.repetition_penalty, seen * params.repetition_penalty)
        logits = logits.scatter(1, history, seen)
    if (params.presence_penalty or params.frequency_penalty) and generated is not None and generated.numel():
        counts = torch.zeros_like(logits).scatter_add_(1, generated, torch.ones_like(generated, dtype=logits.dtype))
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
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
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
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


class TorchGenerator:
    """Token-by-token generation over a causal-LM module with a KV cache."""

    def __init__(
        self, module: Any, tokenizer: Any, *, device: torch.device | str = "cpu", eos_ids: Iterable[int] = ()
    ) -> None:
        """``eos_ids``: end-of-sequence ids besides the module's config's and the tokenizer's (the checkpoint's
        ``config.json`` and ``generation_config.json``: :func:`anyquant_runtime.loaders.end_of_sequence_ids`)."""
        self.module = module
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.eos_ids = _eos_ids(module, tokenizer) | set(eos_ids)
        self.cache_kw = _cache_keyword(module)
        self.keeps_logits = _takes(module, "logits_to_keep")
        #: the native decoder takes each prompt's length with its prefill chunks (LongRoPE's choice of factors)
        self.takes_horizon = _takes(module, "rope_horizon")
        self.context = context_length(module)

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: Prompt, params: GenerationParams) -> list[int]:
        if _is_token_ids(prompt):
            if params.chat:
                raise ParameterError("chat=True needs a string or chat messages, not token ids")
            return self._check_ids(prompt, "prompt")
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
            text = render_chat(tok, messages, context_length=self.context, add_generation_prompt=True)
            return encode_text(tok, text, add_special_tokens=False)
        if not isinstance(prompt, str):
            raise ParameterError("chat=False needs a string prompt")
        return encode_text(tok, prompt)

    def vocab_size(self) -> int | None:
        cfg = getattr(self.module, "config", None)
        value = getattr(cfg, "vocab_size", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        return len(self.tokenizer) if self.tokenizer is not None else None

    def _check_ids(self, ids: Sequence[Any], what: str) -> list[int]:
        vocab = self.vocab_size()
        out = [int(i) for i in ids]
        bad = [i for i in out if i < 0 or (vocab is not None and i >= vocab)]
        if bad:
            raise ParameterError(f"the {what} holds token id {bad[0]}, outside this model's vocabulary (0..{vocab}-1)")
        return out

    def decode(self, ids: Sequence[int], special: bool = False) -> str:
        """The text of ``ids``, without the special tokens' text (with it, ``special``)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=not special))

    # ------------------------------------------------------------------ core loop
    def cap(self, prompt_tokens: int, params: GenerationParams) -> Cap | None:
        """What the model's context leaves of ``max_new_tokens`` after a ``prompt_tokens``-token prompt, when less."""
        if self.context is None:
            return None
        # the prompt takes positions 0 .. n - 1 and new token j (from 0) is fed at n + j; the last new token is never
        # fed: a prompt that fills the context still gets one
        allowed = self.context + 1 - prompt_tokens
        if allowed >= params.max_new_tokens:
            return None
        return Cap(params.max_new_tokens, allowed, self.context, prompt_tokens)

    def token_steps(
        self, batch: Sequence[Sequence[int]], params: GenerationParams, ends: Iterable[int] | None = None
    ) -> Iterator[list[int | None]]:
        """Yield, per step, the new token of every row (``None`` for rows already finished). A row finishes
        at one of ``ends`` (default: the end-of-sequence ids) or when it reaches the model's context."""
        return self._token_steps(batch, params, ends)

    @torch.inference_mode()
    def _token_steps(
        self,
        batch: Sequence[Sequence[int]],
        params: GenerationParams,
        ends: Iterable[int] | None = None,
        observe: Callable[[torch.Tensor], None] | None = None,
        warn: bool = True,
    ) -> Iterator[list[int | None]]:
        """:meth:`token_steps`; ``observe`` gets each step's logits [B, V] (the model's, before any sampling
        parameter) before its tokens are yielded; ``warn=False``: no log warning when the context caps the
        generation (the caller reports it)."""
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
        if warn and min(limits) < params.max_new_tokens:
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
            logits = out.logits[:, -1, :]
            if observe is not None:
                observe(logits)
            nxt = sample_next(logits, params, history, rng, history[:, width:])
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
        keep: dict[str, Any] = {"logits_to_keep": 1} if self.keeps_logits else {}
        if self.takes_horizon:  # every chunk turned as one forward over the whole prompt would turn it
            keep["rope_horizon"] = positions[:, -1] + 1
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
        if self.harmony(prompt, params):  # the answer's text: its final channel (the reasoning is complete's)
            chunks = self._complete_stream(ids, replace(params, logprobs=False), self._own(), harmony=True)
            return (chunk.text for chunk in chunks if chunk.text)
        return self._stream(ids, params)

    def harmony(self, prompt: Prompt, params: GenerationParams) -> bool:
        """Whether ``prompt`` is rendered by a chat template in OpenAI's harmony format (gpt-oss's): its answer is
        then decoded with the channel markers and split (:mod:`.harmony`): the ``final`` channel is the text, the
        ``analysis`` channel the result's ``reasoning``; the answer ends at ``<|call|>`` and ``<|return|>``."""
        if self.tokenizer is None or _is_token_ids(prompt):
            return False
        if not (params.chat if params.chat is not None else not isinstance(prompt, str)):
            return False
        source = template_source(self.tokenizer, with_tools=False)
        return source is not None and is_harmony(source)

    def _own(self) -> bool:
        """This class's token loop runs (a subclass may replace ``token_steps``)."""
        return type(self).token_steps is TorchGenerator.token_steps

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
            text = stable(self.decode(generated))
            cut = find_stop(text, params.stop)
            if cut is not None:
                if cut > emitted:
                    yield text[emitted:cut]
                return
            safe = len(text) - held_back(text, params.stop)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
        text = self.decode(generated)
        cut = find_stop(text, params.stop)
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
        harmony = [self.harmony(p, params) for p in prompts]
        generated: list[list[int]] = [[] for _ in prompts]
        finished = [False] * len(prompts)
        ends = self.eos_ids | self.stop_ids(params.stop)
        if any(harmony):  # (only chat prompts are harmony's: a plain prompt in the batch ends at eos as before)
            ends = ends | self.stop_ids(HARMONY_ENDS)
        stops = [params.stop + HARMONY_ENDS if h else params.stop for h in harmony]
        for tokens in self.token_steps(encoded, params, ends):
            for i, token in enumerate(tokens):
                if token is None or finished[i]:
                    continue
                if token in ends:
                    finished[i] = True
                    continue
                generated[i].append(token)
                if stops[i] and find_stop(stable(self.decode(generated[i], harmony[i])), stops[i]) is not None:
                    finished[i] = True
            if all(finished):
                break
        results = []
        for ids, h, stop in zip(generated, harmony, stops, strict=True):
            text = self.decode(ids, h)
            cut = find_stop(text, stop)
            text = text if cut is None else text[:cut]
            results.append(parse_harmony(text, tools=False).content or "" if h else text)
        return results

    # ------------------------------------------------------------------ results
    def complete_stream(self, prompt: Prompt, params: GenerationParams) -> Iterator[StreamChunk]:
        """One :class:`~anyquant.results.StreamChunk` per sampled token, the last one with ``finish_reason``,
        ``usage`` and ``timings``. The prompt is checked now, not at the first ``next()``."""
        ids = self.encode(prompt, params)
        self._check_prompts([ids])
        own = self._own()
        if params.logprobs and not own:
            raise ParameterError(f"logprobs: {type(self).__name__} does not report token log-probabilities")
        return self._complete_stream(ids, params, own, self.harmony(prompt, params))

    def complete(self, prompt: Prompt, params: GenerationParams) -> GenerationResult:
        return collect(self.complete_stream(prompt, params))

    def _complete_stream(
        self, ids: list[int], params: GenerationParams, own: bool, harmony: bool = False
    ) -> Iterator[StreamChunk]:
        """The chunks of one completion; ``harmony``: the answer is decoded with its channel markers, ends at
        ``<|call|>`` and ``<|return|>`` as at an end-of-sequence token, and each piece is split into the chunk's
        ``text`` (the final channel) and ``reasoning`` (:class:`~.harmony.HarmonyStream`)."""
        cap = self.cap(len(ids), params)  # the first chunk says it (no log warning)
        stop_tokens = self.stop_ids(params.stop)
        token_stop = {i: s for s in params.stop for i in stop_tokens if i == self._added_id(s)}
        ends = self.eos_ids | stop_tokens
        stops = params.stop
        split: HarmonyStream | None = None
        if harmony:
            ends, stops = ends | self.stop_ids(HARMONY_ENDS), stops + HARMONY_ENDS
            split = HarmonyStream(tools=False)
        seen: list[torch.Tensor] = []
        observe = seen.append if params.logprobs else None
        steps = (
            self._token_steps([ids], params, ends, observe, warn=False)
            if own
            else self.token_steps([ids], params, ends)
        )
        generated: list[int] = []
        emitted = 0
        finish: str = "length"
        stop_string: str | None = None
        start = time.perf_counter()
        first: float | None = None
        last: tuple[int, TokenLogprob | None] | None = None  # the token that ends it goes in the final chunk
        yielded = 0
        try:
            for (token,) in steps:
                if token is None:
                    break
                if first is None:
                    first = time.perf_counter()
                generated.append(token)
                lp = self._token_logprob(seen.pop(), token, params.top_logprobs) if seen else None
                if token in ends:
                    finish, stop_string, last = "stop", token_stop.get(token), (token, lp)
                    break
                text = stable(self.decode(generated, harmony))
                if find_stop(text, stops) is not None:
                    finish, last = "stop", (token, lp)
                    break
                safe = len(text) - held_back(text, stops)
                piece, reasoning = _split(split, text[emitted:safe] if safe > emitted else "", final=False)
                chunk = StreamChunk(
                    piece,
                    (token,),
                    None if lp is None else (lp,),
                    capped=cap if not yielded else None,
                    reasoning=reasoning,
                )
                emitted = max(emitted, safe)
                yielded += 1
                yield chunk
        finally:
            close = getattr(steps, "close", None)
            if callable(close):
                close()
        end = time.perf_counter()
        text = self.decode(generated, harmony)
        hit = _which_stop(text, stops)
        if hit is not None:
            finish, stop_string = "stop", hit[1] if hit[1] in params.stop else None
            text = text[: hit[0]]
        piece, reasoning = _split(split, text[emitted:] if len(text) > emitted else "", final=True)
        prefill = (first if first is not None else end) - start
        decode = end - first if first is not None else 0.0
        timings = Timings(
            prefill_seconds=prefill,
            decode_seconds=decode,
            prefill_tokens_per_second=len(ids) / prefill if prefill > 0 and generated else None,
            decode_tokens_per_second=(len(generated) - 1) / decode if decode > 0 and len(generated) > 1 else None,
        )
        yield StreamChunk(
            piece,
            () if last is None else (last[0],),
            None if not params.logprobs else () if last is None or last[1] is None else (last[1],),
            finish_reason="stop" if finish == "stop" else "length",
            stop_string=stop_string,
            usage=Usage(len(ids), len(generated)),
            timings=timings,
            capped=cap if not yielded else None,
            reasoning=reasoning,
        )

    def _added_id(self, text: str) -> int | None:
        try:
            value = dict(self.tokenizer.get_added_vocab()).get(text)
        except Exception:  # a tokenizer without added-token bookkeeping
            return None
        return int(value) if isinstance(value, int) else None

    def _token_logprob(self, logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
        logprobs = torch.log_softmax(logits[0].float(), dim=-1)
        alternatives: tuple[tuple[int, str, float], ...] = ()
        if top:
            values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
            alternatives = tuple(
                (int(i), self._token_text(int(i)), float(v)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)
            )
        return TokenLogprob(token, self._token_text(token), float(logprobs[token]), alternatives)

    def _token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False)) if self.tokenizer is not None else ""

    # ------------------------------------------------------------------ scoring
    def _score_ids(self, text: str | Sequence[int], what: str) -> list[int]:
        if _is_token_ids(text) or (isinstance(text, (list, tuple)) and not text):
            return self._check_ids(text, what)
        if not isinstance(text, str):
            raise ParameterError(f"the {what} is a string or token ids, got {type(text).__name__}")
        if self.tokenizer is None:
            raise CheckpointError("this model has no tokenizer: pass token ids")
        _check_text(text)
        return encode_text(self.tokenizer, text)

    def _prefix(self) -> int:
        """The token an empty context stands for (lm-eval's ``prefix_token_id``): the tokenizer's BOS, else EOS."""
        for value in (getattr(self.tokenizer, "bos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                return value
        if self.eos_ids:
            return min(self.eos_ids)
        raise CheckpointError("this model has no BOS or EOS token to stand for an empty context; pass a context")

    def encode_pair(
        self, context: str | Sequence[int], continuation: str | Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """Token ids of a (context, continuation) pair as lm-eval encodes them: two strings are tokenised together
        (trailing spaces of the context move to the continuation) and split where the context's own tokens end;
        token ids pass as they are; an empty context becomes one prefix token (BOS, else EOS)."""
        if isinstance(context, str) and isinstance(continuation, str):
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = self._score_ids(context + continuation, "context + continuation")
            ctx = self._score_ids(context, "context") if context else []
            if not ctx and self._added_bos(whole):  # the tokenizer's BOS is the context then
                ctx, whole = whole[:1], whole
            if whole[: len(ctx)] != ctx:  # the tokeniser merged across the boundary: score the continuation alone
                cont = self._score_ids(continuation, "continuation")
            else:
                cont = whole[len(ctx) :]
        else:
            ctx, cont = self._score_ids(context, "context"), self._score_ids(continuation, "continuation")
            if isinstance(continuation, str) and self._added_bos(cont):
                cont = cont[1:]
        if not cont:
            raise ParameterError("empty continuation: nothing to score")
        if not ctx:
            ctx = [self._prefix()]
        return ctx, cont

    def _added_bos(self, ids: list[int]) -> bool:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bool(ids) and isinstance(bos, int) and ids[0] == bos

    @torch.inference_mode()
    def score(self, pairs: Sequence[tuple[list[int], list[int]]], batch_size: int = 8) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), greedy)`` per pair of token-id lists; a context longer than the
        model's context is cut from the left. Pairs are run ``batch_size`` at a time, right-padded, longest first."""
        window = self.context
        inputs: list[tuple[list[int], int]] = []
        for ctx, cont in pairs:
            if window is not None and len(cont) > window:
                raise ParameterError(
                    f"the continuation is {len(cont)} tokens; this model's context is {window}: score it in pieces"
                )
            seq = (ctx + cont)[:-1]
            if window is not None:
                seq = seq[-window:]
            inputs.append((seq, len(cont)))
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(inputs)
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            width = len(inputs[rows[0]][0])
            x = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                seq = inputs[i][0]
                x[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            # right padding needs neither a mask nor positions: a causal model's real tokens never see the pads after
            # them (and a module without padding support, exllamav3's, takes the batch as it is)
            logits = self._forward(input_ids=x.to(self.device), use_cache=False).logits
            for r, i in enumerate(rows):
                seq, n = inputs[i]
                cont = pairs[i][1]
                rows_logits = logits[r, len(seq) - n : len(seq)].float()
                top = rows_logits.amax(dim=-1)
                if not bool(torch.isfinite(top).all()):
                    raise NumericalError(f"the model produced non-finite logits ({_non_finite(rows_logits)})")
                logprobs = torch.log_softmax(rows_logits, dim=-1)
                target = torch.tensor(cont, dtype=torch.long, device=logprobs.device)
                total = float(logprobs.gather(1, target[:, None]).sum())
                greedy = bool((rows_logits.argmax(dim=-1) == target).all())
                out[i] = (total, greedy)
        return out

    def loglikelihood(
        self, requests: Sequence[tuple[str | Sequence[int], str | Sequence[int]]], batch_size: int = 8
    ) -> list[tuple[float, bool]]:
        return self.score([self.encode_pair(c, x) for c, x in requests], batch_size)

    def rolling_pairs(self, ids: list[int], window: int | None = None) -> list[tuple[list[int], list[int]]]:
        """lm-eval's rolling windows (``get_rolling_token_windows`` with ``context_len=1``, made disjoint): every
        token is predicted once, the first from the prefix token, each with up to ``window`` tokens before it."""
        size = window if window is not None else self.context
        if size is None:
            size = len(ids)
        if size < 1:
            raise ParameterError(f"window={size}: expected at least 1 token")
        pairs: list[tuple[list[int], list[int]]] = []
        first = min(size, len(ids))
        pairs.append(([self._prefix()], ids[:first]))
        done = first
        while done < len(ids):
            n = min(len(ids) - done, size)
            end = done + n
            pairs.append((ids[max(0, end - size - 1) : done], ids[done:end]))
            done = end
        return pairs

    def loglikelihood_rolling(
        self, texts: Sequence[str | Sequence[int]], window: int | None = None, batch_size: int = 8
    ) -> list[float]:
        out = []
        for text in texts:
            ids = self._score_ids(text, "text")
            if not ids:
                raise ParameterError("empty text: nothing to score")
            out.append(sum(total for total, _ in self.score(self.rolling_pairs(ids, window), batch_size)))
        return out

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
    return "cache" if _takes(module, "cache") else "past_key_values"


def _split(split: HarmonyStream | None, piece: str, final: bool) -> tuple[str, str]:
    """A piece of a completion's text as the chunk's ``(text, reasoning)``: as it is without ``split``, else split
    by harmony channel (everything not reasoning is text: :meth:`HarmonyStream.feed`, then its ``finish``)."""
    if split is None:
        return piece, ""
    deltas = split.feed(piece) if piece else []
    if final:
        deltas += split.finish()
    text = "".join(d.get("content", "") for d in deltas)
    return text, "".join(d.get("reasoning_content", "") for d in deltas)


def _is_token_ids(prompt: Any) -> bool:
    return (
        isinstance(prompt, (list, tuple))
        and bool(prompt)
        and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in prompt)
    )


def _which_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the first stop string in ``text`` starts, and which (the earliest; the first listed at a tie)."""
    hits = [(i, s) for s in stops if s for i in (text.find(s),) if i >= 0]
    return min(hits, key=lambda h: h[0]) if hits else None


def _is_special(tokenizer: Any, token_id: int) -> bool:
    """An added token the decoder drops with ``skip_special_tokens`` (transformers' ``AddedToken.special``)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    token = decoder.get(token_id)
    return bool(getattr(token, "special", False))
