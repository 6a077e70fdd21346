"""The object :func:`anyquant.load` returns."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from ..errors import ModelClosedError, ParameterError
from ..protocols import Detection, GenerationKwargs, GenerationParams, Generator, Prompt

if sys.version_info >= (3, 11):
    from typing import Unpack
elif TYPE_CHECKING:  # Python 3.10: type checkers only (typing_extensions is no runtime dependency)
    from typing_extensions import Unpack

__all__ = ["LoadedModel"]


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
        from .._memory import release_free_heap
        from .tensors import FileRows

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
