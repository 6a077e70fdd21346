"""Batched decode across requests for the served model (imports torch).

Each prompt is prefilled alone, exactly as :meth:`anyquant.LoadedModel.generate` runs it: in chunks that start at
multiples of ``chunk`` positions (:data:`~anyquant_runtime.generate.PREFILL_CHUNK`, generate's, by default),
keeping the last position's logits only where the module takes ``logits_to_keep`` (the same rows, so the same
kernels and the same numbers). A prompt may be prefilled one chunk per call, the scheduler running decode steps of
the batch in between (chunked prefill), and may start from a cache that already holds its first chunks (the
prefix cache's copy, :mod:`.prefix`, or a scoring's cache in the same chunks): the chunks left are then the very
forwards a cold prefill makes. A prompt is scored (``echo`` with ``logprobs``: :meth:`DecodeBatch.score`) by the
same call in chunks of the scorer's size, one chunk at a time, every position's logits kept for that chunk only.
Each request keeps its own KV cache (requests admitted together with the same prompt, such as the ``n`` choices of
one HTTP request, prefill it once and copy the cache). A decode step then runs every request of the batch through
one pass of the linears (the weights are read once for all rows), while each request attends over its own cache,
with no padding and no mask (on cpu-fast one kernel call a layer for every row, the whole step one compiled call): a
request's logits do not depend on which others share its steps (padding shifts the summation order inside
attention, and last-bit differences turn into different greedy tokens). Requests join and leave between steps
(continuous batching).

The shared pass needs anyquant's native decoder (:class:`~anyquant_runtime.native.NativeCausalLM`: the Llama family,
Mixtral, Qwen2-MoE, Phi-3, Gemma 1-3, sliding windows included; its own ``decode_rows``);
any other module is stepped one request at a time (still interleaved, so every client streams), and so is a lone
request (the module's own forward: the same numbers, less per-step work than the row-by-row shared pass).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DecodeBatch", "Slot", "chunk_end"]


def chunk_end(done: int, total: int, chunk: int) -> int:
    """Where the prefill chunk from position ``done`` of a ``total``-token prompt ends: chunks start at multiples
    of ``chunk`` (0: the rest of the prompt at once)."""
    return total if chunk <= 0 else min(total, (done // chunk + 1) * chunk)


@dataclass
class Slot:
    """One request's place in a :class:`DecodeBatch`."""

    key: object
    position: int  # the position id of the next token fed
    cache: Any
    history: list[int] = field(default_factory=list)  # the prompt and every token fed (repetition penalty)


class DecodeBatch:
    """The requests decoding together, each with its own cache, and the prompts on their way in."""

    def __init__(self, module: Any, cache_keyword: str, device: torch.device, chunk: int | None = None) -> None:
        from anyquant_runtime.generate import PREFILL_CHUNK, _takes
        from anyquant_runtime.native import NativeCausalLM

        self.module = module
        self.cache_kw = cache_keyword
        self.device = device
        #: prefill chunks start at multiples of this many positions (0: a prompt in one forward)
        self.chunk = PREFILL_CHUNK if chunk is None else chunk
        self.slots: list[Slot] = []
        #: one shared pass per step (the native decoder), else one forward per request
        self.shared = isinstance(module, NativeCausalLM)
        #: the module computes the last position's logits only when asked (as generate asks it)
        self.keeps_logits = _takes(module, "logits_to_keep")
        self.takes_horizon = _takes(module, "rope_horizon")  # LongRoPE's factors for the whole prompt, each chunk
        self._partial: dict[int, tuple[object, int, Any]] = {}  # id(key): (key, positions prefilled, cache)

    def __len__(self) -> int:
        return len(self.slots)

    def prefilled(self, key: object) -> int:
        """Positions of ``key``'s prompt in its cache so far (0 before its first chunk; a request in the batch is
        not counted)."""
        state = self._partial.get(id(key))
        return state[1] if state is not None else 0

    @torch.inference_mode()
    def prefill(
        self, key: object, ids: Sequence[int], chunks: int | None = None, reuse: tuple[int, Any] | None = None
    ) -> torch.Tensor | None:
        """Prefill ``key``'s prompt ``ids`` alone, as a single-request generation does: ``chunks`` chunks in this
        call (default: every one left), from where the previous call for ``key`` stopped, or on the first call
        from ``reuse``, ``(positions, cache)``: a cache of ``key``'s own holding the prompt's first ``positions``
        (fewer than the prompt's; a multiple of :attr:`chunk` for a cold prefill's numbers). Once the whole
        prompt is in, the request joins the batch and its next-token logits ``[vocab]`` are returned; until then
        ``None``."""
        n = len(ids)
        state = self._partial.pop(id(key), None)
        done, cache = (state[1], state[2]) if state is not None else reuse if reuse is not None else (0, None)
        if done >= n:
            raise ValueError(f"prefill from position {done} of a {n}-token prompt: nothing left to feed")
        runs = 0
        logits: torch.Tensor | None = None
        while done < n and (chunks is None or runs < chunks):
            end = chunk_end(done, n, self.chunk)
            out, cache = self._chunk(ids, done, end, cache, 1 if self.keeps_logits else 0)
            done, runs = end, runs + 1
            if done == n:
                logits = out.logits[0, -1]
        if logits is None:
            self._partial[id(key)] = (key, done, cache)
            return None
        self.slots.append(Slot(key, n, cache, list(ids)))
        return logits

    @torch.inference_mode()
    def score(self, ids: Sequence[int], done: int, cache: Any, chunk: int) -> tuple[int, Any, torch.Tensor]:
        """The next chunk of prompt ``ids``'s scoring forwards, from position ``done`` over ``cache`` (``None``
        before the first), chunks starting at multiples of ``chunk`` (> 0), keeping every position's logits.
        Returns where the chunk ends, the cache (now holding the prompt up to there: what a prefill in chunks of
        ``chunk`` holds, the head's rows aside) and the chunk's logits ``[end - done, vocab]``: at most ``chunk``
        rows, the only logits alive."""
        end = chunk_end(done, len(ids), chunk)
        out, cache = self._chunk(ids, done, end, cache, 0)
        return end, cache, out.logits[0]

    def _chunk(self, ids: Sequence[int], done: int, end: int, cache: Any, keep: int) -> tuple[Any, Any]:
        """One forward of ``ids[done:end]`` over ``cache`` (``None``: a new one), ``keep`` positions' logits kept
        (0: all of them; a prefill's 1 only where the module takes ``logits_to_keep``): the module's output and
        the cache after it. The prefill and the scorer run this same call, so their caches hold the same values."""
        kw: dict[str, Any] = {self.cache_kw: cache} if cache is not None else {}
        if keep:
            kw["logits_to_keep"] = keep
        if self.takes_horizon:
            kw["rope_horizon"] = len(ids)
        out = self.module(
            input_ids=torch.tensor([list(ids[done:end])], dtype=torch.long, device=self.device),
            attention_mask=torch.ones((1, end), dtype=torch.long, device=self.device),
            position_ids=torch.arange(done, end, device=self.device)[None],
            use_cache=True,
            **kw,
        )
        return out, getattr(out, self.cache_kw)

    def join(self, key: object, ids: Sequence[int], cache: Any) -> None:
        """Add ``key`` with a cache of its own that already holds the whole prompt ``ids`` (a prompt the prefix
        cache kept): no forward."""
        self.slots.append(Slot(key, len(ids), cache, list(ids)))

    def cache_of(self, key: object) -> Any:
        """The cache of ``key``'s slot (``None`` when ``key`` is not in the batch)."""
        return next((slot.cache for slot in self.slots if slot.key is key), None)

    def fork(self, key: object, source: object) -> bool:
        """Add ``key`` as a copy of ``source``'s slot (its cache copied): the same prompt prefilled once for both.
        Called between ``source``'s prefill and the next step; ``False`` (nothing added) when ``source`` is not in
        the batch."""
        for slot in self.slots:
            if slot.key is source:
                self.slots.append(Slot(key, slot.position, copy.deepcopy(slot.cache), list(slot.history)))
                return True
        return False

    @torch.inference_mode()
    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed each slot its next token (``tokens[i]`` for ``slots[i]``); the next-token logits ``[rows, vocab]``."""
        for slot, token in zip(self.slots, tokens, strict=True):
            slot.history.append(token)
        if self.shared and len(self.slots) > 1:
            logits = self._shared_step(tokens)
        else:
            rows = []
            for slot, token in zip(self.slots, tokens, strict=True):
                out = self.module(
                    input_ids=torch.tensor([[token]], dtype=torch.long, device=self.device),
                    attention_mask=torch.ones((1, slot.position + 1), dtype=torch.long, device=self.device),
                    position_ids=torch.tensor([[slot.position]], device=self.device),
                    use_cache=True,
                    **{self.cache_kw: slot.cache},
                )
                slot.cache = getattr(out, self.cache_kw)
                rows.append(out.logits[0, -1])
            logits = torch.stack(rows)
        for slot in self.slots:
            slot.position += 1
        return logits

    def _shared_step(self, tokens: Sequence[int]) -> torch.Tensor:
        """The native decoder's own shared pass (:meth:`~anyquant_runtime.native.NativeCausalLM.decode_rows`): the
        embedding, rotary tables, projections, norms and MLP or MoE blocks once over every row, attention row by row
        over each row's own cache (a sliding layer's window, Gemma 2's soft-capping and four norms included)."""
        ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=self.device)
        positions = torch.tensor([[s.position] for s in self.slots], device=self.device)
        logits: torch.Tensor = self.module.decode_rows(ids, positions, [slot.cache for slot in self.slots])
        return logits

    def remove(self, keys: Sequence[object]) -> None:
        """Drop the slots of ``keys``, and their prompts' prefills in progress (their caches go with them)."""
        gone = set(map(id, keys))
        self.slots = [s for s in self.slots if id(s.key) not in gone]
        for k in gone:
            self._partial.pop(k, None)
