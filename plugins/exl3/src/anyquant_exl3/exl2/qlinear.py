"""``EXL2Linear``: an EXL2 (exllamav2) linear layer over the pure-torch decoder."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from anyquant_runtime.qlinear import QuantLinearBase

from ..qlinear import decoded_layouts
from .dequant import decode_exl2

if TYPE_CHECKING:
    from anyquant_runtime.layouts import Layout

__all__ = ["EXL2Linear"]


class EXL2Linear(QuantLinearBase):
    """An EXL2 (exllamav2) linear over the pure-torch decoder (fp16 steps as the CUDA kernel)."""

    packed_names = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")
    q_weight: torch.Tensor
    q_scale: torch.Tensor
    q_scale_max: torch.Tensor
    q_groups: torch.Tensor
    q_invperm: torch.Tensor | None

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        bias: torch.Tensor | None,
        *,
        in_features: int,
        out_features: int,
        mode: str = "reference",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(in_features, out_features, mode=mode, compute_dtype=compute_dtype)
        invperm = tensors.get("q_invperm")
        if invperm is None and "q_perm" in tensors:
            invperm = torch.argsort(tensors["q_perm"].long()).to(torch.int32)
        self.set_packed(
            bias, **{n: tensors[n] for n in ("q_weight", "q_scale", "q_scale_max", "q_groups")}, q_invperm=invperm
        )

    def dequantize(self) -> torch.Tensor:
        if self.q_weight is None:
            assert self._weight is not None
            return self._weight
        return decode_exl2(
            self.q_weight,
            self.q_scale,
            self.q_scale_max,
            self.q_groups,
            self.q_invperm,
            out_features=self.out_features,
        )

    def packed_layouts(self) -> Sequence[Layout] | str:
        """The decoded weight as Q8_0 blocks or in bfloat16 (:func:`~anyquant_exl3.qlinear.decoded_layouts`)."""
        return decoded_layouts(self)
