"""The request queue and the decode loop of ``anyquant serve`` (imports torch).

One thread owns the model. Requests wait in a bounded queue; between decode steps the thread admits waiting
requests (up to ``max_batch`` running at once), prefills each alone and adds it to the running
:class:`~anyquant_serve.batch.DecodeBatch`, then runs one step for every running request, samples each row with
its own parameters (its logits masked first by its grammar when it asks for structured output), and hands each
request its text as it becomes final (stop strings held back until decided) through a callback the HTTP side
gives. A request that finishes, is cancelled (its client went away) or passes
its deadline leaves the batch at once.

Prompts are prefilled in chunks (``prefill_chunk`` positions, 256 by default: half generate's), at most one chunk's
worth of prompt tokens between two decode steps of the running batch (chunked prefill: a long prompt does not
stop the other streams for longer than one chunk); prompts that fit join in the round they are admitted. A prompt
that begins as a recent one did starts from that one's KV cache (the prefix cache, :mod:`.prefix`, within
``prefix_cache_mb``), in whole chunks, so its numbers are a cold prefill's. A prompt to score (``echo`` with
``logprobs``) is scored first in chunks of its own (``score_chunk``, generate's 512), every position's logits
kept one chunk at a time (:class:`_Scoring`), in the same rounds as the prefills.

:class:`ModelAdapter` is the one place that reads the loaded model (tokens in, text out, counts); it is what
switches to anyquant's generation-result API when there is one.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from anyquant.plugin import AnyquantError, ParameterError
from anyquant_runtime.stops import find_stop, held_back, stable

__all__ = [
    "DEFAULT_PREFILL_CHUNK",
    "DEFAULT_PREFIX_CACHE_MB",
    "DEFAULT_SCORE_CHUNK",
    "Finished",
    "ModelAdapter",
    "QueueFull",
    "Request",
    "Scheduler",
]

log = logging.getLogger(__name__)

_GRAMMARS_LOCK = threading.Lock()

#: prompt positions per prefill forward, and the grain at which the prefix cache reuses a kept prompt (whole chunks:
#: a warm prompt runs exactly the forwards a cold one runs). Half ``generate``'s
#: (:data:`anyquant_runtime.generate.PREFILL_CHUNK`, 512): a new question after a repeated 2,000-token system prompt
#: recomputes at most 255 of its tokens (time to first token ~0.14x the cold request's, against ~0.37x with 512), and
#: a running stream waits at most one 256-token forward; a served prompt over 256 tokens is then within the decode
#: tolerance of ``generate``'s logits rather than bitwise them (``--prefill-chunk 512`` gives those)
DEFAULT_PREFILL_CHUNK = 256
#: the prefix cache's budget: a 2,000-token prompt of SmolLM2-135M holds 92 MB of float32 keys and values, of a
#: Llama-3-8B 524 MB
DEFAULT_PREFIX_CACHE_MB = 1024.0
#: prompt positions per scoring forward (``echo`` with ``logprobs``): generate's chunk
#: (:data:`anyquant_runtime.generate.PREFILL_CHUNK`), not the prefill's. On the bundled model a prompt scored in
#: chunks of 512 gets the log-probabilities of one forward over the whole prompt bit for bit (measured up to 4,096
#: tokens: the scoring the server ran before, which held every position's logits at once); in chunks of 256 they
#: moved by up to 0.145 (the kernels' rounding: a forward's row count picks its kernels and its attention's
#: blocking), no closer to the exact model's. The price: the prefill after a scoring cannot start from the
#: scoring's cache unless ``prefill_chunk`` is this too (other forwards, other rounding), and one forward holds 512 x
#: the vocabulary of float32 logits (100 MB for SmolLM2's 49,152 tokens, 263 MB for a 128,256-token vocabulary)
DEFAULT_SCORE_CHUNK = 512


class QueueFull(AnyquantError):
    """The server's queue of waiting requests is full (HTTP 503)."""


@dataclass(frozen=True)
class Finished:
    """How a request ended: ``reason`` is ``stop`` (end of sequence or a stop string), ``length`` (max_tokens or
    the context), ``cancelled``, ``timeout`` or ``error`` (then ``error`` says what)."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    error: BaseException | None = None


class ModelAdapter:
    """What the scheduler needs of a :class:`~anyquant.LoadedModel` driven by core's torch generator: prompts
    to token ids, token ids to text, the end-of-sequence ids and the context length."""

    def __init__(self, model: Any) -> None:
        gen = model.generator
        for name in ("encode", "decode", "eos_ids", "stop_ids", "cache_kw"):
            if not hasattr(gen, name):
                raise ParameterError(
                    f"{model.format} on backend {model.backend} generates through {type(gen).__name__}, which "
                    "anyquant serve cannot batch; use --engine (vllm, exllamav3) for this checkpoint"
                )
        self.model = model
        self.generator = gen
        self.context: int | None = gen.context
        self.eos_ids: frozenset[int] = frozenset(gen.eos_ids)

    def encode(self, prompt: str | Sequence[Mapping[str, Any]], chat: bool) -> list[int]:
        from anyquant.plugin import GenerationParams

        return list(self.generator.encode(prompt, GenerationParams(chat=chat)))

    def chat_template(self, with_tools: bool = True) -> str | None:
        """The chat template's source (the ``tool_use`` one of a set, ``with_tools``), or ``None``."""
        from .tools import template_source

        return template_source(self.generator.tokenizer, with_tools)

    def use_chat_template(self, source: str) -> None:
        """Render chats with the Jinja template ``source`` instead of the checkpoint's (``--chat-template``): a
        :class:`ParameterError` when it does not compile (a sandboxed Jinja environment, as transformers renders)."""
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
        except Exception as exc:  # jinja2's TemplateSyntaxError, or an unusable extension
            raise ParameterError(f"--chat-template: the template does not compile: {exc}") from None
        if self.generator.tokenizer is None:
            raise ParameterError("--chat-template: this model has no tokenizer to render chats with")
        self.generator.tokenizer.chat_template = source

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, **variables: Any
    ) -> list[int]:
        """Chat messages and OpenAI tools rendered by the model's own chat template (``tools=``, when not ``None``;
        ``variables``: more the template reads, such as ``reasoning_effort``), as token ids."""
        from anyquant_runtime.chat import render_chat
        from anyquant_runtime.tokenizer import encode_text

        tok = self.generator.tokenizer
        if tools is not None:
            variables["tools"] = tools
        text = render_chat(tok, list(messages), context_length=self.context, add_generation_prompt=True, **variables)
        return encode_text(tok, text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], special: bool = False) -> str:
        """The text of ``ids``; ``special``: with the special tokens' text (harmony's markers), else without."""
        return str(self.generator.decode(ids, special=special))

    def stop_ids(self, stops: Sequence[str]) -> frozenset[int]:
        return frozenset(self.generator.stop_ids(tuple(stops)))

    def vocab_size(self) -> int:
        return len(self.model.tokenizer)

    def logits_width(self) -> int:
        """The width of the model's logits (its LM head's rows; may exceed the tokenizer's vocabulary)."""
        module = self.model.module
        head = getattr(module, "lm_head", None)
        width = getattr(head, "out_features", None)
        if width is None:
            width = getattr(getattr(module, "config", None), "vocab_size", None)
        return int(width) if isinstance(width, int) and width > 0 else self.vocab_size()

    def grammars(self) -> Any:
        """The model's :class:`~anyquant_runtime.grammar.Grammars` (structured output), made on the first call."""
        grammars = self.__dict__.get("_grammars")
        if grammars is None:
            from anyquant_runtime.grammar import Grammars

            with _GRAMMARS_LOCK:
                grammars = self.__dict__.get("_grammars")
                if grammars is None:
                    grammars = self.__dict__["_grammars"] = Grammars(
                        self.model.tokenizer, self.logits_width(), self.eos_ids
                    )
        return grammars

    def token_logprob(self, logits: Any, token: int, top: int) -> Any:
        """``token``'s :class:`~anyquant.results.TokenLogprob` under ``logits`` [1, vocab], with the ``top`` best."""
        return self.generator._token_logprob(logits, token, top)

    def token_bytes(self, token: int) -> bytes:
        """The bytes token ``token`` stands for, also when they are part of a UTF-8 character."""
        from anyquant_runtime.tokenizer import token_bytes

        cache = self.__dict__.setdefault("_token_bytes", {})
        if token not in cache:
            cache[token] = token_bytes(self.model.tokenizer, token)
        return cache[token]  # type: ignore[no-any-return]


@dataclass
class Request:
    """One completion: token ids in; ``emit(text)`` for each final piece of text and ``finish(Finished)`` once,
    both called from the scheduler's thread."""

    ids: list[int]
    params: Any  # GenerationParams
    max_tokens: int
    emit: Callable[[str], None]
    finish: Callable[[Finished], None]
    deadline: float | None = None  # time.monotonic() after which the request ends with ``timeout``
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: with ``params.logprobs``: called with each sampled token's :class:`~anyquant.results.TokenLogprob`, before
    #: the text that token makes final is emitted
    logprob: Callable[[Any], None] | None = None
    #: ``echo`` with ``logprobs``: called once, before any generated text, with the prompt tokens'
    #: :class:`~anyquant.results.TokenLogprob` (``prompt_top`` alternatives each; ``None`` for the first token,
    #: which nothing predicts), scored in prefill chunks (:class:`_Scoring`)
    prompt_logprobs: Callable[[list[Any]], None] | None = None
    prompt_top: int = 0
    #: structured output: a compiled grammar (:meth:`ModelAdapter.grammars`) the tokens must follow
    grammar: Any = None
    #: the text keeps the special tokens' text (a harmony answer's channel markers, parsed by the server)
    special: bool = False

    def cancel(self) -> None:
        self.cancelled.set()


class _Live:
    """A running request's decode state: tokens, text emitted, stop strings."""

    def __init__(self, request: Request, adapter: ModelAdapter) -> None:
        self.request = request
        self.adapter = adapter
        self.ends = adapter.eos_ids | adapter.stop_ids(request.params.stop)
        self.generated: list[int] = []
        self.emitted = 0
        self.last = -1
        self.done: Finished | None = None
        self.counted = 0  # tokens sampled: the generated ones, and an end-of-sequence token (as vLLM counts)
        self.rng: Any = None
        #: the grammar's state (:class:`~anyquant_runtime.grammar.Constraint`) when the output is constrained
        self.constraint: Any = None
        if request.grammar is not None:
            self.constraint = adapter.grammars().constraint(request.grammar)
        if request.params.temperature > 0:
            from anyquant_runtime.generate import row_generators

            self.rng = row_generators(request.params.seed, 1, adapter.generator.device)
        p = request.params
        #: its next token is the argmax of its logits as they are (:meth:`Scheduler._greedy`)
        self.plain_greedy = (
            p.temperature <= 0
            and self.constraint is None
            and not p.logit_bias
            and p.repetition_penalty == 1.0
            and not p.presence_penalty
            and not p.frequency_penalty
            and not p.logprobs
        )

    def end(self, reason: str, error: BaseException | None = None) -> None:
        if self.done is None:
            self.done = Finished(reason, len(self.request.ids), self.counted, error)

    def take(self, token: int, logprob: Any = None) -> None:
        """One sampled token (and its log-probability when asked for): the text it makes final goes out; the end
        of sequence, a stop string or the token budget ends the request."""
        stops = self.request.params.stop
        self.counted += 1
        if logprob is not None and self.request.logprob is not None:
            self.request.logprob(logprob)
        if token in self.ends:
            self._flush()
            self.end("stop")
            return
        self.last = token
        self.generated.append(token)
        text = stable(self.adapter.decode(self.generated, self.request.special))
        cut = find_stop(text, stops)
        if cut is not None:
            self._send(text[:cut])
            self.end("stop")
            return
        self._send(text[: len(text) - held_back(text, stops)])
        if len(self.generated) >= self.request.max_tokens:
            self._flush()
            self.end("length")

    def _flush(self) -> None:
        text = self.adapter.decode(self.generated, self.request.special)
        cut = find_stop(text, self.request.params.stop)
        self._send(text if cut is None else text[:cut])

    def _send(self, text: str) -> None:
        if len(text) > self.emitted:
            self.request.emit(text[self.emitted :])
            self.emitted = len(text)


class _Scoring:
    """A prompt being scored (``echo`` with ``logprobs``) and the requests that wait for it (the ``n`` choices of
    one request, or the same prompt and ``prompt_top`` arriving meanwhile). Its forwards are chunks of ``chunk``
    positions starting at multiples of it (:meth:`~.batch.DecodeBatch.score`), keeping every position's logits, on
    a cache of its own; each chunk's logits become the positions' :class:`~anyquant.results.TokenLogprob`
    (:attr:`items`) before the next chunk runs, so no more than one chunk's logits live at once, whatever the
    prompt's length. The prefix cache is not read:
    a kept prompt holds keys and values, not the logits of every position."""

    def __init__(self, row: _Live, chunk: int) -> None:
        self.rows = [row]
        self.ids = row.request.ids
        self.key = (tuple(self.ids), row.request.prompt_top)
        self.top = row.request.prompt_top
        self.chunk = chunk  # positions per forward (the scheduler's score_chunk)
        self.done = 0  # positions scored
        self.cache: Any = None
        self.items: list[Any] = [None]  # the first token: nothing predicts it


class _Filling:
    """A prompt being prefilled and the requests that wait for it: the first one's (``key``) cache is the one
    filled, the others (the ``n`` choices of one request, or the same prompt arriving meanwhile) copy it."""

    def __init__(self, row: _Live, reuse: tuple[int, Any] | None) -> None:
        self.rows = [row]
        self.key: object = row.request
        self.ids = row.request.ids
        self.prompt = tuple(self.ids)
        self.reuse = reuse  # (positions, cache) from the prefix cache or the prompt's scoring, for the first chunk
        self.done = reuse[0] if reuse is not None else 0  # positions prefilled


class Scheduler:
    """The bounded queue and the thread that decodes: ``submit`` from any thread, ``close`` to stop."""

    #: every row of a batched step is sampled with its own parameters, as ``LoadedModel.complete`` samples it
    #: (logit bias, penalties, min_p, seed) and reports log-probabilities: the HTTP side accepts all of them
    full_sampling = True
    #: scores prompts (``Request.prompt_logprobs``): ``echo`` with ``logprobs``
    prompt_scoring = True
    #: answers ``max_tokens: 0`` (``echo``'s prompt alone, scored with ``logprobs``)
    prompt_only = True
    #: constrains rows to a grammar (``Request.grammar``): ``response_format`` and the ``guided_*`` extensions
    structured_output = True
    #: decodes with the special tokens' text (``Request.special``): gpt-oss's harmony answers are parsed
    special_text = True

    def __init__(
        self,
        adapter: ModelAdapter,
        *,
        max_batch: int = 16,
        max_queue: int = 64,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
        score_chunk: int = DEFAULT_SCORE_CHUNK,
    ) -> None:
        """``prefill_chunk``: prompt positions per prefill forward, and the most prompt tokens prefilled between
        two decode steps (0: each prompt in one forward, all admitted prompts before the next step).
        ``prefix_cache_mb``: the prefix cache's budget in MB (2**20 bytes; 0: off).
        ``score_chunk``: prompt positions per scoring forward (``echo`` with ``logprobs``), the most logits held
        at once (this many x the vocabulary); equal to ``prefill_chunk``, the prefill after a scoring starts from
        the scoring's cache."""
        if max_batch < 1 or max_queue < 0:
            raise ParameterError(f"max_batch={max_batch} and max_queue={max_queue}: expected >= 1 and >= 0")
        if prefill_chunk < 0 or not 0 <= prefix_cache_mb < float("inf"):
            raise ParameterError(
                f"prefill_chunk={prefill_chunk} and prefix_cache_mb={prefix_cache_mb}: expected >= 0 and a finite >= 0"
            )
        if score_chunk < 1:
            raise ParameterError(f"score_chunk={score_chunk}: expected >= 1")
        from .prefix import PrefixCache

        self.adapter = adapter
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.score_chunk = score_chunk
        #: owned by the thread below (read, not changed, elsewhere)
        # LongRoPE: a kept prompt's cache serves only prompts turned by the same factors (NativeCausalLM.rope_regime)
        regime = getattr(getattr(getattr(adapter, "model", None), "module", None), "rope_regime", None)
        self.prefix = PrefixCache(int(prefix_cache_mb * 2**20), prefill_chunk, regime if callable(regime) else None)
        self._waiting: collections.deque[Request] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.running = 0
        self._thread = threading.Thread(target=self._loop, name="anyquant-serve", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> None:
        self.submit_many([request])

    def submit_many(self, requests: Sequence[Request]) -> None:
        """Queue ``requests`` together (all or none): the ``n`` choices of one HTTP request, admitted in the same
        round when the batch has room, so their shared prompt is prefilled once."""
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            free = max(0, self.max_batch - self.running)  # places in the running batch, taken at its next step
            if len(self._waiting) + len(requests) > self.max_queue + free:
                raise QueueFull(
                    f"{len(self._waiting)} requests are waiting (--max-queue {self.max_queue}); retry later"
                )
            self._waiting.extend(requests)
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        """Finish the requests admitted or waiting, then stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache (vLLM's ``prefix_cache_queries``)."""
        return self.prefix.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found there, not prefilled again (vLLM's ``prefix_cache_hits``)."""
        return self.prefix.hits

    @property
    def capacity(self) -> int:
        """The most requests taken at once when idle (the batch and the queue): more ``n`` choices would always be
        refused as a full queue."""
        return self.max_batch + self.max_queue

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        from .batch import DecodeBatch

        gen = self.adapter.generator
        batch = DecodeBatch(self.adapter.model.module, gen.cache_kw, gen.device, self.prefill_chunk)
        live: list[_Live] = []
        filling: list[_Filling | _Scoring] = []  # prompts being prefilled or scored, oldest first
        while True:
            with self._cond:
                while not self._waiting and not live and not filling and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._waiting and not live and not filling:
                    return
                joining: list[Request] = []
                taken = len(live) + sum(len(f.rows) for f in filling)
                while self._waiting and taken + len(joining) < self.max_batch:
                    joining.append(self._waiting.popleft())
            for request in joining:
                self._admit(request, batch, live, filling)
            self._fill(batch, live, filling)
            live = self._retire(batch, live)
            self.running = len(live) + sum(len(f.rows) for f in filling)
            if not live:
                continue
            try:
                logits = batch.step([row.last for row in live])
                greedy = self._greedy(live, logits)
                for i, row in enumerate(live):
                    token = greedy.get(i)
                    row.take(*((token, None) if token is not None else self._sample(row, logits[i : i + 1])))
            except Exception as exc:
                log.exception("decode step failed")
                for row in live:
                    row.end("error", exc)
            live = self._retire(batch, live)
            self.running = len(live) + sum(len(f.rows) for f in filling)

    def _admit(self, request: Request, batch: Any, live: list[_Live], filling: list[_Filling | _Scoring]) -> None:
        """Start a new request: its prompt's scoring when it asks for one (behind the same scoring in progress,
        or a new one: :meth:`_fill` runs its chunks), else :meth:`_proceed`."""
        row = _Live(request, self.adapter)
        if self._ended(row):
            return
        if request.prompt_logprobs is not None and len(request.ids) > 1:
            key = (tuple(request.ids), request.prompt_top)
            same = next((f for f in filling if isinstance(f, _Scoring) and f.key == key), None)
            if same is not None:  # scored once for all of them (n choices)
                same.rows.append(row)
            else:
                filling.append(_Scoring(row, self.score_chunk))
            return
        self._proceed(row, batch, live, filling, [None] * len(request.ids))

    def _proceed(
        self,
        row: _Live,
        batch: Any,
        live: list[_Live],
        filling: list[_Filling | _Scoring],
        scores: list[Any],
        scored: tuple[int, Any] | None = None,
        at: int | None = None,
    ) -> None:
        """A request whose prompt is scored (``scores``, given to it when it asked for them) goes on: ended at once
        with ``max_tokens: 0``, else started (:meth:`_start`)."""
        request = row.request
        try:
            if request.prompt_logprobs is not None:
                request.prompt_logprobs(list(scores))
            if request.max_tokens == 0:  # the prompt scored, nothing generated (echo with max_tokens 0)
                row.end("length")
                request.finish(row.done)  # type: ignore[arg-type]
                return
            self._start(row, batch, live, filling, scored, at)
        except Exception as exc:  # this request's failure, not the server's
            log.exception("request failed in prefill")
            row.end("error", exc)
            if row not in live:  # not yet running: nothing else will tell it
                request.finish(row.done)  # type: ignore[arg-type]

    def _start(
        self,
        row: _Live,
        batch: Any,
        live: list[_Live],
        filling: list[_Filling | _Scoring],
        scored: tuple[int, Any] | None = None,
        at: int | None = None,
    ) -> None:
        """Start ``row``'s prefill: with the prefix cache's copy of the whole prompt (it joins the batch at
        once), behind the same prompt's prefill in progress, or as a prefill of its own (inserted in ``filling``
        at ``at``, default last), from the prefix cache's first chunks of it when kept, or from ``scored``,
        ``(positions, cache)``: its scoring's own cache, cut to the start of the prompt's last chunk (then the
        prefix cache can give no more than the whole prompt, and only that is looked up)."""
        prompt = tuple(row.request.ids)
        same = next((f for f in filling if isinstance(f, _Filling) and f.prompt == prompt), None)
        if same is not None:  # prefilled once, then copied
            same.rows.append(row)
            return
        hit = self.prefix.lookup(prompt) if scored is None or prompt in self.prefix.entries else None
        if hit is not None and hit.logits is not None:  # the whole prompt kept
            batch.join(row.request, prompt, hit.cache)
            live.append(row)
            row.take(*self._sample(row, hit.logits[None]))
            return
        started = _Filling(row, (hit.length, hit.cache) if hit is not None else scored)
        filling.insert(len(filling) if at is None else at, started)

    def _fill(self, batch: Any, live: list[_Live], filling: list[_Filling | _Scoring]) -> None:
        """One round of prefill between two decode steps: chunks of the prompts in ``filling``, oldest first,
        while their tokens fit in one chunk (always at least one chunk; with ``prefill_chunk`` 0, every prompt
        whole). A prompt whose last chunk ran joins the batch with the requests waiting for it, each sampling its
        first token. A prompt being scored runs its scoring chunks in the same rounds, under the same count of
        tokens (:meth:`_score`)."""
        for f in filling:
            f.rows = [row for row in f.rows if not self._ended(row)]
        for f in [f for f in filling if not f.rows]:  # every request for it gone: its cache too
            if isinstance(f, _Filling):
                batch.remove([f.key])
            filling.remove(f)
        spent = 0
        while filling:
            f = filling[0]
            if isinstance(f, _Scoring):
                piece = self._chunk_end(f.done, len(f.ids), f.chunk) - f.done
                if self.prefill_chunk and spent and spent + piece > self.prefill_chunk:
                    return
                self._score(batch, f, live, filling)
                spent += piece
                continue
            piece = self._chunk_end(f.done, len(f.ids)) - f.done
            if self.prefill_chunk and spent and spent + piece > self.prefill_chunk:
                return
            try:
                logits = batch.prefill(f.key, f.ids, 1, f.reuse)
            except Exception as exc:  # the prompt's failure: every request waiting for it ends with it
                log.exception("request failed in prefill")
                filling.pop(0)
                batch.remove([f.key])
                for row in f.rows:
                    row.end("error", exc)
                    row.request.finish(row.done)  # type: ignore[arg-type]
                continue
            f.reuse = None
            f.done += piece
            spent += piece
            if logits is not None:
                filling.pop(0)
                self._joined(batch, f, logits, live, filling)

    def _chunk_end(self, done: int, total: int, chunk: int | None = None) -> int:
        from .batch import chunk_end

        return chunk_end(done, total, self.prefill_chunk if chunk is None else chunk)

    def _score(self, batch: Any, f: _Scoring, live: list[_Live], filling: list[_Filling | _Scoring]) -> None:
        """One chunk of ``f``'s scoring (``f`` is ``filling[0]``): its logits turned into the log-probabilities of
        the tokens that follow each position (``None``: the chunk's logits are dropped before the next forward).
        After the last chunk the requests waiting for it get the scores and go on (:meth:`_proceed`). When the
        scoring's chunks are the prefill's (``score_chunk == prefill_chunk``), the first prefill starts from the
        scoring's cache cut to the prompt's last chunk: those are the forwards a prefill runs there, over the same
        cache contents, so its numbers are a cold prefill's (as from the prefix cache)."""
        from .prefix import cut

        n = len(f.ids)
        try:
            start = f.done
            f.done, f.cache, logits = batch.score(f.ids, start, f.cache, f.chunk)
            for i in range(start, min(f.done, n - 1)):  # position i's logits predict token i + 1
                f.items.append(self.adapter.token_logprob(logits[i - start : i - start + 1], int(f.ids[i + 1]), f.top))
            del logits
        except Exception as exc:  # the prompt's failure: every request waiting for it ends with it
            log.exception("request failed in prefill")
            filling.remove(f)
            for row in f.rows:
                row.end("error", exc)
                row.request.finish(row.done)  # type: ignore[arg-type]
            return
        if f.done < n:
            return
        filling.remove(f)
        reuse = (n - 1) // f.chunk * f.chunk if f.chunk == self.prefill_chunk else 0
        cache = cut(f.cache, reuse) if reuse else None
        f.cache = None
        scored = (reuse, cache) if cache is not None else None
        for row in f.rows:
            if self._ended(row):
                continue
            self._proceed(row, batch, live, filling, f.items, scored, 0)
            if scored is not None and any(isinstance(g, _Filling) and g.key is row.request for g in filling):
                scored = None  # the cache went to that prefill; the other rows copy it when it is in

    def _joined(
        self, batch: Any, f: _Filling, logits: Any, live: list[_Live], filling: list[_Filling | _Scoring]
    ) -> None:
        """``f``'s prompt is in: keep it in the prefix cache, copy its cache to every request waiting for it and
        sample their first tokens."""
        kept = logits.clone()  # apart from what sampling reads (a grammar masks a row's logits in place)
        try:
            self.prefix.store(f.ids, batch.cache_of(f.key), kept)
        except Exception:  # the cache is an optimisation: the request goes on without it
            log.exception("keeping a prompt in the prefix cache failed")
        starting: list[tuple[_Live, Any]] = []
        for row in f.rows:
            if row.request is f.key:
                starting.append((row, logits))
            elif batch.fork(row.request, f.key):
                starting.append((row, kept.clone()))
            else:  # not copied: a prefill of its own
                filling.append(_Filling(row, None))
        if all(row.request is not f.key for row in f.rows):  # the request it was filled for is gone
            batch.remove([f.key])
        for row, row_logits in starting:
            live.append(row)
            try:
                row.take(*self._sample(row, row_logits[None]))
            except Exception as exc:  # ends the request (it leaves at the next retire)
                log.exception("request failed in prefill")
                row.end("error", exc)

    def _ended(self, row: _Live) -> bool:
        """Ends (and reports) a request that was cancelled or timed out before it ran."""
        if self._check(row):
            row.request.finish(row.done)  # type: ignore[arg-type]
            return True
        return False

    def _check(self, row: _Live) -> bool:
        if row.done is None and row.request.cancelled.is_set():
            row.end("cancelled")
        elif row.done is None and row.request.deadline is not None and time.monotonic() > row.request.deadline:
            row.end("timeout")
        return row.done is not None

    def _retire(self, batch: Any, live: list[_Live]) -> list[_Live]:
        gone = [row for row in live if self._check(row)]
        if gone:
            batch.remove([row.request for row in gone])
            for row in gone:
                try:
                    row.request.finish(row.done)  # type: ignore[arg-type]
                except Exception:  # the client's side failed: nothing left to tell it
                    log.exception("finishing a request failed")
        return [row for row in live if row.done is None]

    @staticmethod
    def _greedy(live: list[_Live], logits: Any) -> dict[int, int]:
        """The next tokens of the rows that take the plain argmax (greedy, no grammar, bias, penalty or
        log-probabilities), by row, in one argmax over those rows: what :meth:`_sample` gives each (the first
        largest logit), without its per-row calls (~30 us a row). A row whose logits are not all finite is left
        to :meth:`_sample`, which says so."""
        rows = [i for i, row in enumerate(live) if row.plain_greedy]
        if len(rows) < 2:
            return {}
        chosen = logits if len(rows) == len(live) else logits[rows]
        finite = chosen.amax(dim=-1).isfinite().tolist()
        tokens = chosen.argmax(dim=-1).tolist()
        return {i: int(t) for i, t, ok in zip(rows, tokens, finite, strict=True) if ok}

    def _sample(self, row: _Live, logits: Any) -> tuple[int, Any]:
        """The row's next token from its logits ``[1, vocab]`` (masked by its grammar first, when it has one)
        and, when asked for, its log-probability (under the model's own distribution, as ``complete`` reports it,
        the grammar's mask not applied)."""
        import torch

        from anyquant_runtime.generate import sample_next

        params = row.request.params
        device = logits.device
        if params.repetition_penalty == 1.0:  # the history is read for the penalty only
            history = torch.empty((1, 0), dtype=torch.long, device=device)
        else:
            history = torch.tensor([row.request.ids + row.generated], dtype=torch.long, device=device)
        generated = None
        if params.presence_penalty or params.frequency_penalty:
            generated = torch.tensor([row.generated], dtype=torch.long, device=device).reshape(1, -1)
        scores = logits
        if row.constraint is not None:  # the tokens the grammar does not allow next: -inf, before any sampler
            scores = logits.float()  # in place on the row's own logits (nothing else reads them) ...
            if params.logprobs and scores.data_ptr() == logits.data_ptr():
                scores = scores.clone()  # ... unless its log-probabilities read them after
            row.constraint.mask(scores)
        token = int(sample_next(scores, params, history, row.rng, generated)[0])
        if row.constraint is not None and not row.constraint.accept(token):
            raise AnyquantError(f"token {token} was sampled outside the request's grammar")
        if not params.logprobs:
            return token, None
        return token, self.adapter.token_logprob(logits, token, params.top_logprobs)
