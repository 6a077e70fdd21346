"""The GGUF loader: llama-family GGUF files into transformers modules, packed linears kept packed."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyquant.errors import CheckpointError, MissingTensorError, UnsupportedFormatError
from anyquant.loaders import LoadContext, TransformersLoader
from anyquant.probe import Probe
from anyquant.protocols import BackendInfo, Detection, LoadOptions, ModuleInfo

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["GGUFLoader", "GGUFSource"]

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


def gguf_path(probe: Probe) -> Path:
    if len(probe.gguf) != 1:
        files = [g.file for g in probe.gguf]
        raise CheckpointError(f"{probe.root} holds {len(files)} GGUF files {files}: pass the path of the one to load")
    return probe.root / probe.gguf[0].file


class GGUFSource:
    """HF-named tensors of a GGUF file, dequantized on request (``gguf.quants`` numpy kernels)."""

    def __init__(self, path: Path) -> None:
        from .reader import hf_tensor_names, open_gguf

        self.path = path
        self.reader = open_gguf(path)
        self.gguf_names = {hf: g for g, hf in hf_tensor_names(self.reader).items()}
        self.used: set[str] = set()

    def keys(self) -> Iterator[str]:
        return iter(self.gguf_names)

    def __contains__(self, name: object) -> bool:
        return name in self.gguf_names

    def get(self, name: str) -> torch.Tensor:
        from .reader import load_tensor

        if name not in self.gguf_names:
            raise MissingTensorError(f"{self.path.name} has no tensor for {name!r}")
        self.used.add(name)
        return load_tensor(self.reader, self.gguf_names[name])

    def raw(self, name: str) -> Any:
        from .reader import load_raw

        self.used.add(name)
        return load_raw(self.reader, self.gguf_names[name])

    def qtype(self, name: str) -> Any:
        from .reader import get_tensor

        return get_tensor(self.reader, self.gguf_names[name]).tensor_type

    def unused(self) -> list[str]:
        return sorted(set(self.gguf_names) - self.used)


class GGUFLoader(TransformersLoader):
    format = "gguf"
    backend_order = ("dequantized", "packed")

    def backends(self) -> list[BackendInfo]:
        return [
            BackendInfo(
                "packed",
                True,
                description="Q4_0/Q4_1/Q5_x/Q8_0/K-quant linears stay packed (file-backed "
                "mmap), dequantized in torch on every forward",
            ),  # fmt: skip
            BackendInfo("dequantized", True, description="every tensor dequantized to the compute dtype at load"),
        ]

    def validate(self, probe: Probe, detection: Detection) -> None:
        gguf_path(probe)
        arch = detection.details.get("architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedFormatError(
                f"{probe.path}: GGUF architecture {arch!r} is not mapped to transformers by anyquant "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

    def choose_backend(self, requested: str, device: Any) -> str:
        # auto: "dequantized" (dense decode speed); "packed" keeps the Q-blocks file-backed and is
        # ~3.4x slower per decoded token on CPU (measured on SmolLM2-135M Q4_1)
        return super().choose_backend(requested, device)

    def tensor_source(self, probe: Probe, options: LoadOptions) -> GGUFSource:
        return GGUFSource(gguf_path(probe))

    def model_config(self, probe: Probe) -> Mapping[str, Any]:
        from .reader import hf_config_from_gguf, open_gguf

        return hf_config_from_gguf(open_gguf(gguf_path(probe)))

    def tokenizer(self, probe: Probe, options: LoadOptions) -> Any:
        from .reader import tokenizer_from_gguf

        return tokenizer_from_gguf(gguf_path(probe))

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .qlinear import PACKED_TYPES, GGUFLinear

        src = ctx.source
        assert isinstance(src, GGUFSource)
        mode = "on-the-fly" if ctx.backend == "packed" else "dequant-at-load"

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            key = f"{name}.weight"
            if key not in src or src.qtype(key) not in PACKED_TYPES:
                return None  # F32/F16/BF16: a dense nn.Linear filled from the source
            raw = src.raw(key)
            bias = src.get(f"{name}.bias") if f"{name}.bias" in src else None
            module = GGUFLinear.from_raw(raw.data, raw.qtype, raw.shape, bias, mode=mode)
            if (module.out_features, module.in_features) != (linear.out_features, linear.in_features):
                raise CheckpointError(f"{name}: GGUF weight {raw.shape} does not fit the model's linear")
            return module

        return factory

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        from anyquant.headers import GGUF_TYPE_SIZES

        g = probe.gguf[0]
        rows = []
        for t in g.tensors:
            name, block, block_bytes = GGUF_TYPE_SIZES.get(t.type_id, (t.type_name, 0, 0))
            numel = 1
            for d in t.shape:
                numel *= d
            nbytes = numel // block * block_bytes if block else 0
            fmt = "dense" if name in ("F32", "F16", "BF16") else "gguf"
            rows.append(ModuleInfo(t.name, fmt, tuple(reversed(t.shape)), 8 * nbytes / numel if numel else None,
                                   block if fmt == "gguf" else None, nbytes, extra={"type": name}))  # fmt: skip
        return rows
