"""One linear of the model stored as several: fused projections stored split, in every format.

transformers' Phi-3 (and Phi-4) classes have a fused ``self_attn.qkv_proj`` and ``mlp.gate_up_proj``; the
quantizers write them in several ways. GPTQModel 7.6 keeps ``qkv_proj`` whole and writes ``gate_up_proj`` as
``gate_proj`` + ``up_proj``; exllamav3 and exllamav2 write both split (``q_proj``/``k_proj``/``v_proj``,
``gate_proj``/``up_proj``). :func:`split_parts` finds the stored parts of such a linear and
:class:`LinearParts` runs them as the one linear the model has: its output is the parts' outputs side by
side, exactly the fused layer's. :func:`anyquant_runtime.build.build_model` uses it for every format whose
factory has no module under the fused name; a format with more ways of its own (EXL3's ``.slice.N`` pieces of
a very wide MLP) builds a :class:`PartsPlan` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from anyquant.errors import CheckpointError

__all__ = ["FUSED_PARTS", "LinearParts", "PartsPlan", "fused_sizes", "split_parts"]

#: fused projections of transformers' classes and the names of their parts, in output order
FUSED_PARTS: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fused_sizes(leaf: str, out_features: int, config: Mapping[str, Any]) -> list[int]:
    """The parts' output sizes of a fused projection: q, k, v from the head counts; gate and up halves."""
    if leaf == "gate_up_proj":
        return [out_features // 2] * 2
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads < 1:
        raise CheckpointError("config.json lacks num_attention_heads: cannot split the fused q/k/v projection")
    head_dim = config.get("head_dim") or int(config.get("hidden_size", 0)) // heads
    return [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]


@dataclass(frozen=True)
class PartsPlan:
    """How one linear of the model is stored as several: part names with their (in, out) sizes."""

    parts: tuple[tuple[str, int, int], ...]
    split_input: bool

    def build(self, one: Callable[[str, int, int], Any], linear: nn.Linear) -> LinearParts:
        """``one(part_name, in_features, out_features)`` builds each part."""
        built = [one(name, i, o) for name, i, o in self.parts]
        return LinearParts(
            built,
            linear.in_features,
            linear.out_features,
            split_input=self.split_input,
            names=[name for name, _, _ in self.parts],
        )


def split_parts(
    name: str, linear: nn.Linear, stored: Callable[[str], bool], config: Mapping[str, Any]
) -> PartsPlan | None:
    """The parts of the fused projection ``name`` (``qkv_proj``, ``gate_up_proj``) when the checkpoint stores
    it split (``stored(module_name)`` says whether it has a module of that name); ``None`` for any other linear
    or when a part is missing. Sizes come from ``config`` and must add up to the linear's outputs."""
    parent, _, leaf = name.rpartition(".")
    members = FUSED_PARTS.get(leaf)
    if not members or not all(stored(f"{parent}.{m}") for m in members):
        return None
    sizes = fused_sizes(leaf, linear.out_features, config)
    if sum(sizes) != linear.out_features:
        raise CheckpointError(
            f"{name}: split parts of sizes {sizes} (config.json) do not add up to its {linear.out_features} outputs"
        )
    return PartsPlan(
        tuple((f"{parent}.{m}", linear.in_features, n) for m, n in zip(members, sizes, strict=True)), False
    )


class LinearParts(nn.Module):
    """One linear of the model stored as several linears:

    - ``split_input=False``: the parts' outputs side by side: a fused projection stored split (Phi-3's
      ``qkv_proj`` as ``q_proj``/``k_proj``/``v_proj``, ``gate_up_proj`` as ``gate_proj``/``up_proj``) or a very
      wide MLP's ``gate_proj``/``up_proj`` stored as ``.slice.N`` pieces of the intermediate dimension (EXL3);
    - ``split_input=True``: part ``i`` reads its own chunk of the input and the parts' outputs add up (EXL3's
      ``down_proj.slice.N``).

    A part is any module with ``in_features``, ``out_features``, a ``bias`` and ``dequantize()`` (a quantized
    linear) or ``weight`` (a dense ``nn.Linear``). ``names``: the parts' names in the checkpoint.
    """

    def __init__(
        self,
        parts: list[Any],
        in_features: int,
        out_features: int,
        *,
        split_input: bool,
        names: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self._parts = tuple(parts)  # the same modules (moves act on them in place), outside the ModuleList's indexing
        self.in_features, self.out_features, self.split_input = in_features, out_features, split_input
        sizes = [p.in_features if split_input else p.out_features for p in parts]
        whole, other = (in_features, out_features) if split_input else (out_features, in_features)
        crossing = {p.out_features if split_input else p.in_features for p in parts}
        if sum(sizes) != whole or crossing != {other}:
            raise ValueError(
                f"parts of sizes {sizes} x {sorted(crossing)} do not make a {out_features}x{in_features} linear"
            )
        self.sizes = sizes
        self.names = names or [f"parts.{i}" for i in range(len(parts))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.split_input:
            return torch.cat([p(x) for p in self._parts], dim=-1)
        chunks = torch.split(x, self.sizes, dim=-1)
        out: torch.Tensor = self._parts[0](chunks[0])
        for part, chunk in zip(self._parts[1:], chunks[1:], strict=True):
            out = out + part(chunk)
        return out

    def dequantize(self) -> torch.Tensor:
        """The whole weight ``[out, in]``: the parts' weights joined (rows, or columns for split inputs)."""
        weights = [p.dequantize() if hasattr(p, "dequantize") else p.weight for p in self._parts]
        return torch.cat(weights, dim=1 if self.split_input else 0)

    @property
    def bias(self) -> torch.Tensor | None:
        biases: list[Any] = [getattr(p, "bias", None) for p in self._parts]
        if all(b is None for b in biases):
            return None
        if self.split_input:
            raise ValueError("summed parts with biases are not a format anyquant knows")
        return torch.cat(
            [b if b is not None else torch.zeros(p.out_features) for b, p in zip(biases, self._parts, strict=True)]
        )

    def extra_repr(self) -> str:
        how = "inputs split, outputs added" if self.split_input else "outputs joined"
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={self.sizes} ({how})"
