"""The object :func:`anyquant.load` returns."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import ParameterError
from ..protocols import Detection, GenerationParams, Generator, Prompt

__all__ = ["LoadedModel"]


@dataclass
class LoadedModel:
    """A loaded checkpoint: the torch ``module``, its ``tokenizer``, what it is and how it runs.

    ``module(input_ids)`` returns an object with ``.logits`` (like transformers). ``generate``,
    ``stream`` and ``generate_batch`` go through ``generator`` (core's torch generator unless the
    plugin brings its own).
    """

    module: Any
    tokenizer: Any
    format: str
    backend: str
    detection: Detection
    generator: Generator
    device: str = "cpu"
    dtype: str = "float32"
    info: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def params(**kwargs: Any) -> GenerationParams:
        """:class:`GenerationParams` from keywords; ``stop`` may be one string or a list. An unknown keyword
        (a misspelt ``max_tokens``) or a bad value is a :class:`~anyquant.errors.ParameterError`."""
        stop = kwargs.pop("stop", ())
        if isinstance(stop, str):
            stop = (stop,)
        elif stop is None:
            stop = ()
        unknown = sorted(set(kwargs) - {f.name for f in fields(GenerationParams)})
        if unknown:
            known = ", ".join(f.name for f in fields(GenerationParams))
            raise ParameterError(f"unknown generation parameter(s) {unknown}; known: {known}")
        return replace(GenerationParams(), stop=tuple(stop) if isinstance(stop, (list, tuple)) else stop, **kwargs)

    def generate(self, prompt: Prompt, **kwargs: Any) -> str:
        """Generate text. Keyword arguments are :class:`~anyquant.GenerationParams` fields."""
        return self.generator.generate(prompt, self.params(**kwargs))

    def stream(self, prompt: Prompt, **kwargs: Any) -> Iterator[str]:
        return self.generator.stream(prompt, self.params(**kwargs))

    def generate_batch(self, prompts: Sequence[Prompt], **kwargs: Any) -> list[str]:
        return self.generator.generate_batch(prompts, self.params(**kwargs))

    def __repr__(self) -> str:
        return (
            f"LoadedModel(format={self.format!r}, variant={self.detection.variant!r}, backend={self.backend!r}, "
            f"device={self.device!r}, dtype={self.dtype!r})"
        )
