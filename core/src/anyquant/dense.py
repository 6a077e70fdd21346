"""Core's loader for unquantized (``dense``) checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import PickleRefusedError
from .loaders import TransformersLoader
from .probe import Probe
from .protocols import Detection, LoadOptions

if TYPE_CHECKING:
    from .runtime.tensors import TensorSource

__all__ = ["DenseLoader"]


class DenseLoader(TransformersLoader):
    format = "dense"

    def validate(self, probe: Probe, detection: Detection) -> None:
        from .builtin import looks_dense

        if detection.variant != "pickle" and not looks_dense(probe):
            from .errors import FormatConflictError

            raise FormatConflictError(f"{probe.root}: tensors carry quantization markers; refusing a dense load")

    def tensor_source(self, probe: Probe, options: LoadOptions) -> TensorSource:
        if probe.safetensors:
            return super().tensor_source(probe, options)
        if not options.allow_pickle:
            raise PickleRefusedError(
                f"{probe.root} has only pickle weights ({list(probe.pickle_files)[:3]}). Unpickling can run "
                "arbitrary code; anyquant refuses it by default. Convert to safetensors, or pass "
                "allow_pickle=True (then only torch.load(weights_only=True) is used)."
            )
        import torch

        from .runtime.tensors import DictSource

        tensors: dict[str, torch.Tensor] = {}
        for name in probe.pickle_files:
            state = torch.load(probe.root / name, map_location="cpu", weights_only=True, mmap=True)
            tensors.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
        return DictSource(tensors)
