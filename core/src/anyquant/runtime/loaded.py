"""The object :func:`anyquant.load` returns."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

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
        stop = kwargs.pop("stop", ())
        if isinstance(stop, str):
            stop = (stop,)
        return replace(GenerationParams(), stop=tuple(stop or ()), **kwargs)

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
