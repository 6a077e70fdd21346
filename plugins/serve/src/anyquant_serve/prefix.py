"""The prefix cache of ``anyquant serve``: a prompt that begins as an earlier one did (a system prompt, a growing
chat, few-shot examples) starts from that prompt's KV cache instead of prefilling its beginning again.

What is kept: after each prompt's prefill, a copy of its KV cache (the prompt's positions, nothing generated) and
its next-token logits, keyed by the prompt's token ids, in least-recently-used order within a budget of bytes
counted from the tensors held (keys, values and logits). A prompt too large for the budget is not kept; a kept
prompt that the new one extends (the previous turn of a chat) is dropped, the new one serving every request the
old one would and more.

What is reused (llama-server's longest common prefix, over every kept prompt): the new prompt's common prefix
with a kept one, cut back to a multiple of the prefill chunk (:attr:`PrefixCache.chunk`,
:class:`~.batch.DecodeBatch`'s ``chunk``) and to at most all but its last token. Prefills run in chunks that
start at multiples of the chunk, so from there on the rest is prefilled in the very forwards a cold prefill of the
same prompt makes, over the very cache contents it would hold: the logits are bit for bit a cold run's, not
merely close (reusing any other length changes the shapes a forward sees, and with them the rounding; on the
bundled model's kernels that changed greedy tokens within 32 steps in 2 of 32 cases). A prompt equal to a kept
one reuses all of it, logits included, without a forward. Without chunks (``chunk`` 0) only equal prompts are
reused.

Caches copied: :class:`~anyquant_runtime.native.NativeCache` (its ``copy``), and transformers'
``DynamicCache`` when every layer can be cropped and none slides (``copy.deepcopy`` then ``crop``); a model with
another cache is served without prefix caching. One thread (the scheduler's) owns a :class:`PrefixCache`.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Hit", "PrefixCache", "cache_bytes", "cacheable", "cut", "snapshot"]


@dataclass(frozen=True)
class Hit:
    """What a prompt reuses: a cache of its own holding the prompt's first ``length`` positions, and the prompt's
    next-token logits ``[vocab]`` when the whole prompt was kept (then ``length`` is the prompt's)."""

    length: int
    cache: Any
    logits: Any = None


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: Any
    logits: Any
    nbytes: int


def _dynamic_layers(cache: Any) -> list[Any] | None:
    """The layers of a transformers ``DynamicCache`` whose positions can be cut (``None`` for any other cache)."""
    try:
        from transformers.cache_utils import DynamicCache
    except ImportError:  # pragma: no cover - transformers is a dependency of the runtime
        return None
    if not isinstance(cache, DynamicCache) or not getattr(cache, "is_croppable", True):
        return None
    if any(getattr(cache, "is_sliding", None) or ()):
        return None
    layers = list(getattr(cache, "layers", None) or ())
    import torch

    ok = layers and all(
        isinstance(getattr(layer, "keys", None), torch.Tensor)
        and isinstance(getattr(layer, "values", None), torch.Tensor)
        for layer in layers
    )
    return layers if ok else None


def cacheable(cache: Any) -> bool:
    """Whether :func:`snapshot` can copy ``cache`` (a :class:`~anyquant_runtime.native.NativeCache`, or a
    transformers ``DynamicCache`` of croppable, non-sliding layers)."""
    from anyquant_runtime.native import NativeCache

    return isinstance(cache, NativeCache) or _dynamic_layers(cache) is not None


def snapshot(cache: Any, length: int) -> Any:
    """A cache of its own holding ``cache``'s first ``length`` positions (values as stored)."""
    from anyquant_runtime.native import NativeCache

    if isinstance(cache, NativeCache):
        return cache.copy(length)
    if _dynamic_layers(cache) is None:
        raise TypeError(f"cannot copy a {type(cache).__name__}")
    out = cut(copy.deepcopy(cache), length)
    for layer in _dynamic_layers(out) or ():
        layer.keys, layer.values = layer.keys.contiguous().clone(), layer.values.contiguous().clone()
    return out


def cut(cache: Any, length: int) -> Any | None:
    """``cache`` itself cut to its first ``length`` positions (nothing copied: the next forward writes from there),
    or ``None`` when it is not one :func:`snapshot` could copy (then it cannot be reused either)."""
    from anyquant_runtime.native import NativeCache

    if isinstance(cache, NativeCache):
        cache.crop(length)
        return cache
    if _dynamic_layers(cache) is None:
        return None
    extra = int(cache.get_seq_length()) - length
    if extra > 0:
        cache.crop(-extra)  # a negative count removes that many: transformers 4's and 5's crop alike
    return cache


def cache_bytes(cache: Any) -> int:
    """Bytes of the tensors ``cache`` holds (a :func:`snapshot` holds no spare room)."""
    from anyquant_runtime.native import NativeCache

    if isinstance(cache, NativeCache):
        return cache.nbytes()
    layers = _dynamic_layers(cache) or ()
    return sum(int(layer.keys.nbytes) + int(layer.values.nbytes) for layer in layers)


def _estimate(cache: Any, length: int) -> int:
    """Bytes a :func:`snapshot` of ``cache``'s first ``length`` positions will hold (nothing copied)."""
    from anyquant_runtime.native import NativeCache

    if isinstance(cache, NativeCache):
        total = 0
        for kb, n in zip(cache.keys, cache.lengths, strict=True):
            if kb is not None:
                total += 2 * kb.shape[0] * kb.shape[1] * kb.shape[3] * kb.element_size() * min(n, length)
        return total
    total = 0
    for layer in _dynamic_layers(cache) or ():
        for t in (layer.keys, layer.values):
            per = t.numel() // max(t.shape[-2], 1) * t.element_size()
            total += per * min(t.shape[-2], length)
    return total


class PrefixCache:
    """Kept prompts' KV caches within ``budget`` bytes (0: nothing kept, every lookup a miss), reused in whole
    chunks of ``chunk`` positions (0: only for an equal prompt). Counts, as vLLM's metrics do, the prompt tokens
    looked up (:attr:`queries`) and those found cached (:attr:`hits`). ``regime``: a prompt length's rotary regime
    (the native decoder's ``rope_regime``: LongRoPE's long or short factors, which every position of a prompt is
    turned by); a kept prompt serves only prompts of its regime (``None``: one regime)."""

    def __init__(self, budget: int, chunk: int, regime: Callable[[int], object] | None = None) -> None:
        if budget < 0 or chunk < 0:
            raise ValueError(f"budget={budget}, chunk={chunk}: expected >= 0")
        self.budget = budget
        self.chunk = chunk
        self.regime = regime
        self.entries: collections.OrderedDict[tuple[int, ...], _Entry] = collections.OrderedDict()
        self.bytes = 0  # held by the entries
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, reused from a kept prompt
        self.evictions = 0  # entries dropped for room

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self.entries)

    def reusable(self, kept: Sequence[int], prompt: Sequence[int]) -> int:
        """Positions of ``prompt`` a kept prompt ``kept`` gives: all of them when equal, else their common prefix
        in whole chunks, short of ``prompt``'s last token (both tuples)."""
        n = len(prompt)
        if len(kept) == n and kept == prompt:
            return n
        if not self.chunk or (self.regime is not None and self.regime(len(kept)) != self.regime(n)):
            return 0
        reused = 0
        for end in range(self.chunk, min(len(kept), n - 1) + 1, self.chunk):
            if kept[end - self.chunk : end] != prompt[end - self.chunk : end]:
                break
            reused = end
        return reused

    def lookup(self, ids: Sequence[int]) -> Hit | None:
        """The most ``ids`` any kept prompt gives (a copy of its cache, cut to that), or ``None``; the entry used
        becomes the most recently used."""
        if not self.enabled:
            return None
        prompt = tuple(ids)
        self.queries += len(prompt)
        best: _Entry | None = self.entries.get(prompt)
        length = len(prompt) if best is not None else 0
        if best is None:
            for entry in self.entries.values():
                got = self.reusable(entry.tokens, prompt)
                if got > length:
                    best, length = entry, got
        if best is None or length == 0:
            return None
        self.entries.move_to_end(best.tokens)
        self.hits += length
        whole = length == len(prompt)
        return Hit(length, snapshot(best.cache, length), best.logits.clone() if whole else None)

    def store(self, ids: Sequence[int], cache: Any, logits: Any) -> bool:
        """Keep a copy of ``cache`` (holding prompt ``ids``'s positions, perhaps more) and the prompt's next-token
        ``logits``; least recently used entries make room. ``False`` (nothing kept) when the cache is off, cannot
        be copied, or the copy alone exceeds the budget."""
        if not self.enabled or not cacheable(cache):
            return False
        tokens = tuple(ids)
        if _estimate(cache, len(tokens)) + logits.nbytes > self.budget:
            return False
        for kept in [k for k in self.entries if len(k) <= len(tokens) and tokens[: len(k)] == k]:
            self._drop(kept)  # this prompt again, or one it extends: the new entry serves all they did
        entry = _Entry(tokens, snapshot(cache, len(tokens)), logits.detach().clone(), 0)
        entry.nbytes = cache_bytes(entry.cache) + int(entry.logits.nbytes)
        if entry.nbytes > self.budget:
            return False
        while self.entries and self.bytes + entry.nbytes > self.budget:
            self._drop(next(iter(self.entries)))
            self.evictions += 1
        self.entries[tokens] = entry
        self.bytes += entry.nbytes
        return True

    def _drop(self, tokens: tuple[int, ...]) -> None:
        entry = self.entries.pop(tokens)
        self.bytes -= entry.nbytes
