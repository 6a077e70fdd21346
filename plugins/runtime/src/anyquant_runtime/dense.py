"""Core's loader for unquantized (``dense``) checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from anyquant.errors import CheckpointError, PickleRefusedError
from anyquant.probe import Probe
from anyquant.protocols import Detection, LoadOptions

from .loaders import TransformersLoader

if TYPE_CHECKING:
    from .tensors import TensorSource

__all__ = ["DenseLoader"]


class DenseLoader(TransformersLoader):
    format = "dense"

    def validate(self, probe: Probe, detection: Detection) -> None:
        from anyquant.builtin import looks_dense

        if detection.variant != "pickle" and not looks_dense(probe):
            from anyquant.errors import FormatConflictError

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

        from .tensors import DictSource

        tensors: dict[str, torch.Tensor] = {}
        for name in probe.pickle_files:
            state = _load_pickle(probe, name)
            tensors.update({k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)})
        return DictSource(tensors)


def _load_pickle(probe: Probe, name: str) -> dict[object, object]:
    """One pickle file's state dict through ``torch.load(weights_only=True)``; what it refuses (a pickle of
    other objects: torch's text then advises ``weights_only=False``, which anyquant never does), what is not a
    torch file at all, and a file that holds no dict are :class:`~anyquant.errors.CheckpointError` naming it."""
    import pickle
    import zipfile

    import torch

    try:
        state = torch.load(probe.root / name, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as exc:
        if "memory" in str(exc).lower():  # an allocation failure: load() reports it as memory
            raise
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        raise CheckpointError(
            f"{name}: torch.load(weights_only=True) cannot read it ({type(exc).__name__}: "
            f"{first.removeprefix('Weights only load failed.').strip()[:200]}). It is not a plain state dict of "
            "tensors (or is damaged); anyquant never unpickles arbitrary objects. Convert it to safetensors "
            "from a trusted environment, or re-download it"
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{name}: holds a {type(state).__name__}, not a state dict (tensor names to tensors); "
            "save the model's state_dict() instead, or convert it to safetensors"
        )
    return state
