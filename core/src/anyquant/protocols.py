"""The plugin contract: frozen option dataclasses and ``typing.Protocol`` classes.

Methods take one frozen dataclass (:class:`LoadOptions`, :class:`QuantizeSpec`,
:class:`GenerationParams`), so adding a field never breaks a plugin's signature. Third parties
need not inherit from anything: the protocols are structural.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from ._openmp import pool_released, released_after
from .errors import ModelClosedError, ParameterError, UnsupportedBackendError
from .params import GenerationKwargs, GenerationParams, Prompt, _is_int
from .probe import Probe  # torch-free: imported so that typing.get_type_hints resolves the protocols
from .results import GenerationResult, StreamChunk, collect

if sys.version_info >= (3, 11):
    from typing import Unpack
elif TYPE_CHECKING:  # Python 3.10: type checkers only (typing_extensions is no runtime dependency)
    from typing_extensions import Unpack

__all__ = [
    "BackendInfo",
    "Claim",
    "Detection",
    "FormatSpec",
    "GenerationKwargs",
    "GenerationParams",
    "Generator",
    "LoadOptions",
    "LoadedModel",
    "Loader",
    "ModuleInfo",
    "Prompt",
    "QuantizeFlag",
    "QuantizeSpec",
    "Quantizer",
]


@dataclass(frozen=True)
class Claim:
    """A plugin's answer to ``anyquant_detect``: "this checkpoint is in my format"."""

    format: str
    confidence: float = 1.0
    evidence: tuple[str, ...] = ()
    variant: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Detection:
    """The resolved answer of detection: one format, and why."""

    format: str
    variant: str | None
    evidence: tuple[str, ...]
    details: Mapping[str, Any]
    plugin: str  # who claimed it
    path: Path
    #: what the probe noticed that is not an error (a stale shard index, ...)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "variant": self.variant,
            "evidence": list(self.evidence),
            "details": dict(self.details),
            "plugin": self.plugin,
            "path": str(self.path),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class FormatSpec:
    """What a plugin registers for a format id. Loader and quantizer are lazy ``"module:Class"``
    strings, imported only when used; ``requires`` are distribution requirements
    (``"torch>=2.4"``) checked before anything is imported. ``loader=None`` means the format is
    recognised but cannot be loaded (a clear error, never a dense fallback)."""

    name: str
    loader: str | None = None
    quantizer: str | None = None
    requires: tuple[str, ...] = ()
    description: str = ""
    install_hint: str = ""  # what to do when ``loader`` is None or requirements are missing


@dataclass(frozen=True)
class LoadOptions:
    backend: str = "auto"
    device: str = "auto"
    dtype: str | None = None  # "float32", "float16", "bfloat16" or None (auto)
    allow_pickle: bool = False
    trust_remote_code: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class QuantizeSpec:
    method: str
    bits: float = 4
    group_size: int = 128
    sym: bool | None = None  # None: the method's own default (GPTQ symmetric, AWQ zero points)
    desc_act: bool = False
    calibration: str | None = None
    calibration_samples: int = 128
    calibration_seq_len: int = 512
    options: Mapping[str, Any] = field(default_factory=dict)


#: the kinds of :class:`QuantizeFlag`
FLAG_KINDS = ("switch", "bool", "str")


@dataclass(frozen=True)
class QuantizeFlag:
    """A flag of ``anyquant quantize`` that a quantizer declares (its optional ``quantize_flags``, a sequence of
    these): ``--<name, dashes for underscores>`` sets the :func:`~anyquant.quantize` keyword ``name``, one of the
    quantizer's ``quantize_options`` (``zero_point``) or a :class:`QuantizeSpec` field (``desc_act``).

    ``kind``: ``"switch"`` (set by being given), ``"bool"`` (true/false, yes/no, on/off, 1/0) or ``"str"``. A
    flag passes its keyword only when given; ``-o NAME=...`` is then refused (one value, one place), and always
    for a :class:`QuantizeSpec` field. Several methods may declare one flag: it is one flag (its help shows each
    method's), and given with a method that does not read it, that method refuses it as it refuses
    an unknown ``-o``. A quantizer may also define ``check_flags(given)`` (a static method): it gets the
    keywords the command line set (``group_size`` and ``sym`` when ``--group-size`` / ``--asym`` are given,
    and the declared flags given) and raises a :class:`~anyquant.errors.ParameterError` for a combination it
    refuses; it runs when its method is chosen or one of its declared flags is given."""

    name: str
    help: str = ""
    kind: str = "str"

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ParameterError(f"QuantizeFlag name {self.name!r}: expected an identifier (the keyword it sets)")
        if self.kind not in FLAG_KINDS:
            raise ParameterError(f"QuantizeFlag kind {self.kind!r}: expected one of {FLAG_KINDS}")

    @property
    def flag(self) -> str:
        """The command-line spelling: ``--zero-point`` for ``zero_point``."""
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class BackendInfo:
    """One backend of a format's loader, as ``anyquant backends`` lists it and :func:`anyquant.backends.choose_backend`
    chooses among them."""

    name: str
    available: bool
    reason: str = ""  # why not, when unavailable
    description: str = ""
    #: the device types it runs on (``("cpu",)``, ``("cuda",)``); empty: any device
    devices: tuple[str, ...] = ()


#: the packed layouts a backend may say it runs (:class:`BackendSpec`; :mod:`anyquant_runtime.layouts` describes
#: each): 4-bit groups with zero points (GPTQ, AWQ, compressed-tensors int4), 4-bit affine blocks (MLX), 8-bit
#: blocks, a 4-bit code table (NF4/FP4, MXFP4/NVFP4), FP8 E4M3 groups, GGUF's blocks, EXL3's trellis, and any
#: weight decoded to bfloat16
LAYOUT_KINDS = (
    "int4-groups",
    "affine4-blocks",
    "int8-blocks",
    "table4",
    "e4m3-groups",
    "gguf-blocks",
    "exl3-trellis",
    "decoded",
)


@dataclass(frozen=True)
class BackendSpec:
    """A backend a plugin registers (``anyquant_register_backends``): what runs formats' layers fast somewhere.

    ``devices``: the device types it runs on (empty: any); ``layouts``: the packed layouts (:data:`LAYOUT_KINDS`)
    it runs, so a format whose layers come in one of them gets it without code of its own; ``status``: an import
    reference (``"package.module:function"``) to a function returning ``(available, reason)`` on this machine,
    imported only when asked (``anyquant backends``); ``requires``: its distributions, as a format's; ``engine``: the
    module that converts a format's layers for it, imported when a load uses it (``cpu-fast``'s: what
    :mod:`anyquant_runtime.cpu` reaches); ``options``: the load options it reads (name -> what it does), which
    ``anyquant.load`` accepts for every format it is offered to; ``option_layouts``: for an option that concerns
    only some layouts, those (the option is accepted where the format offers one of them)."""

    name: str
    description: str = ""
    devices: tuple[str, ...] = ()
    layouts: tuple[str, ...] = ()
    status: str | None = None
    requires: tuple[str, ...] = ()
    engine: str | None = None
    options: Mapping[str, str] = field(default_factory=dict)
    option_layouts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.layouts) - set(LAYOUT_KINDS))
        if unknown:
            raise ParameterError(f"backend {self.name!r}: layouts {unknown} are not among {LAYOUT_KINDS}")
        for option, kinds in self.option_layouts.items():
            if option not in self.options or not set(kinds) <= set(self.layouts):
                raise ParameterError(
                    f"backend {self.name!r}: option_layouts[{option!r}] must name one of its options and some of "
                    f"its layouts {self.layouts}"
                )

    def options_for(self, kinds: Collection[str]) -> dict[str, str]:
        """The options it reads for a format whose layers offer ``kinds`` (:data:`LAYOUT_KINDS` names)."""
        return {
            name: text
            for name, text in self.options.items()
            if name not in self.option_layouts or set(self.option_layouts[name]) & set(kinds)
        }


@dataclass(frozen=True)
class ModuleInfo:
    """One row of ``anyquant inspect``."""

    name: str
    format: str
    shape: tuple[int, ...]  # logical (out_features, in_features) for linears
    bits: float | None
    group_size: int | None
    nbytes: int
    extra: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Loader(Protocol):
    @property
    def format(self) -> str:
        """The format id this loader loads (a plain class attribute satisfies this)."""
        ...

    def backends(self) -> list[BackendInfo]: ...

    def validate(self, probe: Probe, detection: Detection) -> None: ...

    def load(self, probe: Probe, detection: Detection, options: LoadOptions) -> LoadedModel: ...


@runtime_checkable
class Quantizer(Protocol):
    @property
    def method(self) -> str:
        """The method id this quantizer writes (a plain class attribute satisfies this)."""
        ...

    def quantize(self, src: Path, dst: Path, spec: QuantizeSpec, progress: Callable[[str, float], None]) -> Path:
        """Write ``dst`` (core passes a staging directory and always a ``progress(stage, fraction)``)."""
        ...


@runtime_checkable
class Generator(Protocol):
    def generate(self, prompt: Prompt, params: GenerationParams) -> str: ...

    def stream(self, prompt: Prompt, params: GenerationParams) -> Iterator[str]: ...

    def generate_batch(
        self, prompts: Sequence[Prompt], params: GenerationParams
    ) -> list[str]: ...  # core passes a list


# ---------------------------------------------------------------- the loaded model


def _check_prompt(prompt: Any) -> Prompt:
    """A string, token ids (a list/tuple of integers), or chat messages (a list/tuple of mappings); anything else is
    a ParameterError here rather than a TypeError deep inside the tokenizer."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):  # each message is checked where the chat template is applied
        ints = [_is_int(p) for p in prompt]
        if any(ints) and not all(ints):
            raise ParameterError("a prompt list is token ids (integers) or chat messages (mappings), not a mix")
        return prompt
    raise ParameterError(
        "a prompt is a string, a list of token ids or a list of chat messages ({'role': ..., 'content': ...}), "
        f"got {type(prompt).__name__}"
    )


_T = TypeVar("_T")


def _check_batch_size(batch_size: Any) -> int:
    if not _is_int(batch_size) or batch_size < 1:
        raise ParameterError(f"batch_size={batch_size!r}: expected an integer >= 1")
    return int(batch_size)


@dataclass
class LoadedModel:
    """A loaded checkpoint: the torch ``module``, its ``tokenizer``, what it is and how it runs.

    ``module(input_ids)`` returns an object with ``.logits`` (like transformers). ``generate``,
    ``stream`` and ``generate_batch`` go through ``generator`` (core's torch generator unless the
    plugin brings its own).

    Each call that runs the model ends the calling thread's OpenMP worker pool when it returns (a stream: when it
    ends or is closed), so that the next call on another thread (an async call's worker, a web framework's thread
    pool) runs at full speed (:mod:`anyquant._openmp`); calling ``module`` directly does not.

    ``close()`` (or a ``with`` block) releases what it holds now rather than at garbage collection: the
    checkpoint files a backend keeps open to read tables on demand, a GPU backend's memory, the module and
    the tokenizer. A closed model refuses to generate.
    """

    module: Any  # a torch.nn.Module, or a GPU backend's own callable (exllamav3's is no nn.Module)
    tokenizer: Any  # a transformers tokenizer (``None`` when the checkpoint has none)
    format: str
    backend: str
    detection: Detection
    generator: Generator
    device: str = "cpu"
    dtype: str = "float32"
    info: Mapping[str, Any] = field(default_factory=dict)
    closed: bool = field(default=False, init=False)
    #: held by the async methods while they run the model in their worker thread (one at a time per model)
    lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    #: makes the generator :meth:`complete`, :meth:`loglikelihood` ... use where ``generator`` lacks them (the runtime's
    #: ``TorchGenerator`` over this model, which anyquant-runtime's loaders pass); called once, on first need
    fallback: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    _fallback: Any = field(default=None, init=False, repr=False, compare=False)

    @staticmethod
    def params(**kwargs: Unpack[GenerationKwargs]) -> GenerationParams:
        """:class:`GenerationParams` from keywords; ``stop`` may be one string or a list. An unknown keyword
        (a misspelt ``max_tokens``) or a bad value is a :class:`~anyquant.errors.ParameterError`."""
        given: dict[str, Any] = dict(kwargs)
        stop = given.pop("stop", ())
        if isinstance(stop, str):
            stop = (stop,)
        elif stop is None:
            stop = ()
        unknown = sorted(set(given) - {f.name for f in fields(GenerationParams)})
        if unknown:
            known = ", ".join(f.name for f in fields(GenerationParams))
            raise ParameterError(f"unknown generation parameter(s) {unknown}; known: {known}")
        return replace(GenerationParams(), stop=tuple(stop) if isinstance(stop, (list, tuple)) else stop, **given)

    def generate(self, prompt: Prompt, **kwargs: Unpack[GenerationKwargs]) -> str:
        """Generate text. Keyword arguments are :class:`~anyquant.GenerationParams` fields."""
        with pool_released():
            return self._open_generator().generate(_check_prompt(prompt), self.params(**kwargs))

    def stream(self, prompt: Prompt, **kwargs: Unpack[GenerationKwargs]) -> Iterator[str]:
        return released_after(self._open_generator().stream(_check_prompt(prompt), self.params(**kwargs)))

    def generate_batch(self, prompts: Iterable[Prompt], **kwargs: Unpack[GenerationKwargs]) -> list[str]:
        """One completion per prompt (a list or other iterable of prompts, not one string). With ``seed``
        and sampling, row ``i`` samples with ``seed + i``: row 0 gives what ``generate`` gives."""
        if isinstance(prompts, (str, bytes)) or prompts is None or not hasattr(prompts, "__iter__"):
            raise ParameterError(
                f"generate_batch takes a list of prompts, got {type(prompts).__name__}; "
                "for one prompt use generate(), or pass [prompt]"
            )
        with pool_released():
            return self._open_generator().generate_batch([_check_prompt(p) for p in prompts], self.params(**kwargs))

    # ------------------------------------------------------------ results, scoring, async
    def complete(self, prompt: Prompt, **kwargs: Unpack[GenerationKwargs]) -> GenerationResult:
        """Generate, and return a :class:`~anyquant.results.GenerationResult`: the text with its token ids,
        ``finish_reason``, ``usage``, ``timings``, the ``capped`` note, and with ``logprobs=True`` (and
        ``top_logprobs=k``) each token's log-probability. The same tokens as :meth:`generate` for the same
        parameters."""
        return collect(self.complete_stream(prompt, **kwargs))

    def complete_stream(self, prompt: Prompt, **kwargs: Unpack[GenerationKwargs]) -> Iterator[StreamChunk]:
        """:meth:`complete` as it happens: one :class:`~anyquant.results.StreamChunk` per token, the last with
        ``finish_reason``, ``usage`` and ``timings`` (:func:`anyquant.results.collect` joins them)."""
        return released_after(self._result_generator().complete_stream(_check_prompt(prompt), self.params(**kwargs)))

    def loglikelihood(
        self, requests: Iterable[tuple[str | Sequence[int], str | Sequence[int]]], *, batch_size: int = 8
    ) -> list[tuple[float, bool]]:
        """For each ``(context, continuation)`` (strings or token ids): the natural-log probability of the
        continuation's tokens given the context, summed, and whether greedy decoding would produce exactly them
        (lm-eval's ``loglikelihood``; strings are split into tokens as lm-eval does)."""
        pairs = list(requests) if not isinstance(requests, (str, bytes)) else None
        if pairs is None or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
            raise ParameterError("loglikelihood takes a list of (context, continuation) pairs")
        gen = self._result_generator()
        with pool_released():
            return gen.loglikelihood(pairs, _check_batch_size(batch_size))  # type: ignore[no-any-return]

    def loglikelihood_rolling(
        self, texts: Iterable[str | Sequence[int]], *, window: int | None = None, batch_size: int = 8
    ) -> list[float]:
        """The log-likelihood of each whole text (for perplexity: ``exp(-total / tokens)``), every token predicted
        once with up to ``window`` tokens before it (default: the model's context), the first from the BOS (else
        EOS) token: lm-eval's ``loglikelihood_rolling``."""
        if isinstance(texts, (str, bytes)):
            raise ParameterError("loglikelihood_rolling takes a list of texts; for one text pass [text]")
        if window is not None and (not _is_int(window) or window < 1):
            raise ParameterError(f"window={window!r}: expected an integer >= 1 or None (the model's context)")
        gen = self._result_generator()
        with pool_released():
            return gen.loglikelihood_rolling(list(texts), window, _check_batch_size(batch_size))  # type: ignore[no-any-return]

    async def agenerate(self, prompt: Prompt, **kwargs: Unpack[GenerationKwargs]) -> str:
        """:meth:`generate` without blocking the event loop (see :meth:`astream`)."""
        return "".join([piece async for piece in self.astream(prompt, **kwargs)])

    async def astream(self, prompt: Prompt, **kwargs: Unpack[GenerationKwargs]) -> AsyncIterator[str]:
        """:meth:`stream` for asyncio: the model runs in a worker thread holding :attr:`lock` (the async calls on
        one model run one at a time); the parameters are checked before anything starts. Cancelling the consumer
        (or closing the iterator) stops the decode at the next token and releases the lock."""
        prompt, params = _check_prompt(prompt), self.params(**kwargs)
        generator = self._open_generator()
        async for piece in self._in_thread(lambda: generator.stream(prompt, params)):
            yield piece

    async def acomplete(self, prompt: Prompt, **kwargs: Unpack[GenerationKwargs]) -> GenerationResult:
        """:meth:`complete` without blocking the event loop (see :meth:`astream`)."""
        return collect([chunk async for chunk in self.acomplete_stream(prompt, **kwargs)])

    async def acomplete_stream(self, prompt: Prompt, **kwargs: Unpack[GenerationKwargs]) -> AsyncIterator[StreamChunk]:
        """:meth:`complete_stream` for asyncio (see :meth:`astream`)."""
        prompt, params = _check_prompt(prompt), self.params(**kwargs)
        generator = self._result_generator()
        async for chunk in self._in_thread(lambda: generator.complete_stream(prompt, params)):
            yield chunk

    async def _in_thread(self, start: Callable[[], Iterable[_T]]) -> AsyncIterator[_T]:
        """Run ``start()`` and iterate it in a worker thread under :attr:`lock`, handing items to the event loop; the
        worker runs at most :data:`ASYNC_AHEAD` items ahead of the consumer (a slow client holds the decode)."""
        import asyncio

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancelled = threading.Event()
        ahead = threading.Semaphore(ASYNC_AHEAD)

        def put(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
            except RuntimeError:  # the loop is closed: nobody is listening
                cancelled.set()

        def work() -> None:
            with self.lock:
                try:
                    items = iter(start()) if not cancelled.is_set() else iter(())
                    try:
                        for item in items:
                            while not ahead.acquire(timeout=0.05):
                                if cancelled.is_set():
                                    return
                            if cancelled.is_set():
                                return
                            put("item", item)
                    finally:
                        close = getattr(items, "close", None)
                        if callable(close):
                            close()
                except BaseException as exc:  # handed to the consumer, raised there
                    put("error", exc)
                    return
            put("end", None)

        worker = threading.Thread(target=work, name="anyquant-generate", daemon=True)
        worker.start()
        try:
            while True:
                kind, value = await queue.get()
                if kind == "item":
                    ahead.release()
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            cancelled.set()

    def _result_generator(self) -> Any:
        """The generator, when it has ``complete_stream``, ``loglikelihood`` and ``loglikelihood_rolling``
        (the runtime's does); else what ``fallback`` makes (a plugin's generator need not implement them)."""
        generator = self._open_generator()
        if all(callable(getattr(generator, name, None)) for name in _RESULT_METHODS):
            return generator
        if self._fallback is None:
            if self.fallback is None:
                missing = [name for name in _RESULT_METHODS if not callable(getattr(generator, name, None))]
                raise UnsupportedBackendError(
                    f"{type(generator).__name__} (backend {self.backend!r}) has no {', '.join(missing)}, and the "
                    "loaded model names no fallback generator"
                )
            self._fallback = self.fallback()
        return self._fallback

    def _open_generator(self) -> Generator:
        if self.closed:
            raise ModelClosedError(f"{self!r} was closed; load the checkpoint again")
        return self.generator

    def close(self) -> None:
        """Release the model now: close the checkpoint files kept open for tables read on demand, free a GPU
        backend's memory (its module's ``unload()``), drop the module, tokenizer and generator, and hand the
        freed heap back to the OS. Idempotent."""
        if self.closed:
            return
        from ._memory import release_free_heap

        module = self.module
        stop = getattr(self.generator, "close", None)
        if callable(stop):
            stop()  # a stream still being read stops with a ModelClosedError
        unload = getattr(module, "unload", None)
        if callable(unload):
            unload()
        for sub in module.modules() if hasattr(module, "modules") else ():
            for value in vars(sub).values():
                if getattr(type(value), "closes_with_model", False) is True:  # the runtime's FileRows
                    value.close()
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None
        self.closed = True
        self.module = self.tokenizer = None
        self.generator = None  # type: ignore[assignment]  # it holds the module too
        self.fallback = None  # and so does the fallback's maker
        del module
        release_free_heap()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LoadedModel(format={self.format!r}, variant={self.detection.variant!r}, backend={self.backend!r}, "
            f"device={self.device!r}, dtype={self.dtype!r}{', closed' if self.closed else ''})"
        )


#: how many items (stream pieces, chunks) an async call's worker thread may run ahead of its consumer
ASYNC_AHEAD = 8

#: the methods :meth:`LoadedModel.complete` and the scoring methods need of a generator
_RESULT_METHODS = ("complete_stream", "loglikelihood", "loglikelihood_rolling")


def undeclared_options(
    owner: object, attribute: str, given: Collection[str], always: Collection[str] = ()
) -> tuple[list[str], list[str]] | None:
    """``(unknown, accepted)``: the keywords in ``given`` that ``owner``'s declaration ``attribute`` (a loader's
    ``load_options``, a quantizer's ``quantize_options``) and ``always`` do not name, and every accepted name,
    sorted; ``None`` when ``owner`` declares nothing (a third party's class: every keyword passes)."""
    declared = getattr(owner, attribute, None)
    if declared is None:
        return None
    accepted = {*declared, *always}
    return sorted(set(given) - accepted), sorted(accepted)
