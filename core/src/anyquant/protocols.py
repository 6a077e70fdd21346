"""The plugin contract: frozen option dataclasses and ``typing.Protocol`` classes.

Methods take one frozen dataclass (:class:`LoadOptions`, :class:`QuantizeSpec`,
:class:`GenerationParams`), so adding a field never breaks a plugin's signature. Third parties
need not inherit from anything: the protocols are structural.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

from .errors import ModelClosedError, ParameterError
from .probe import Probe  # torch-free: imported so that typing.get_type_hints resolves the protocols

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

#: a plain prompt, or chat messages (``[{"role": "user", "content": "..."}]``; a message's content may be
#: anything its chat template reads: a string, a list of parts, ``None``).
Prompt = str | Sequence[Mapping[str, Any]]


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

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> ParameterError:
            return ParameterError(f"{name}={getattr(self, name)!r}: expected {want}")

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", "an integer >= 0")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a number >= 0 (0 = greedy)")
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


def _is_int(value: object) -> bool:
    """An integer, numpy's included (``numbers.Integral``), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite real number, numpy's included (``numbers.Real``), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


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
    name: str
    available: bool
    reason: str = ""  # why not, when unavailable
    description: str = ""


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
    """A string, or chat messages (a list/tuple of mappings); anything else is a ParameterError here rather
    than a TypeError deep inside the tokenizer."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):  # each message is checked where the chat template is applied
        return prompt
    raise ParameterError(
        f"a prompt is a string or a list of chat messages ({{'role': ..., 'content': ...}}), got {type(prompt).__name__}"
    )


@dataclass
class LoadedModel:
    """A loaded checkpoint: the torch ``module``, its ``tokenizer``, what it is and how it runs.

    ``module(input_ids)`` returns an object with ``.logits`` (like transformers). ``generate``,
    ``stream`` and ``generate_batch`` go through ``generator`` (core's torch generator unless the
    plugin brings its own).

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
        return self._open_generator().generate(_check_prompt(prompt), self.params(**kwargs))

    def stream(self, prompt: Prompt, **kwargs: Unpack[GenerationKwargs]) -> Iterator[str]:
        return self._open_generator().stream(_check_prompt(prompt), self.params(**kwargs))

    def generate_batch(self, prompts: Iterable[Prompt], **kwargs: Unpack[GenerationKwargs]) -> list[str]:
        """One completion per prompt (a list or other iterable of prompts, not one string). With ``seed``
        and sampling, row ``i`` samples with ``seed + i``: row 0 gives what ``generate`` gives."""
        if isinstance(prompts, (str, bytes)) or prompts is None or not hasattr(prompts, "__iter__"):
            raise ParameterError(
                f"generate_batch takes a list of prompts, got {type(prompts).__name__}; "
                "for one prompt use generate(), or pass [prompt]"
            )
        return self._open_generator().generate_batch([_check_prompt(p) for p in prompts], self.params(**kwargs))

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
        from .runtime.tensors import FileRows

        module = self.module
        stop = getattr(self.generator, "close", None)
        if callable(stop):
            stop()  # a stream still being read stops with a ModelClosedError
        unload = getattr(module, "unload", None)
        if callable(unload):
            unload()
        for sub in module.modules() if hasattr(module, "modules") else ():
            for value in vars(sub).values():
                if isinstance(value, FileRows):
                    value.close()
        self.closed = True
        self.module = self.tokenizer = None
        self.generator = None  # type: ignore[assignment]  # it holds the module too
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
