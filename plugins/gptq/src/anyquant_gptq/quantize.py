"""GPTQ quantization through GPTQModel, run in a worker subprocess (core's
:class:`anyquant_tools.gptqmodel_quantizer.GPTQModelQuantizer`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from anyquant.plugin import QuantizeFlag
from anyquant_tools import GPTQModelQuantizer

__all__ = ["GPTQQuantizer"]


class GPTQQuantizer(GPTQModelQuantizer):
    method = "gptq"
    formats = ("gptq", "gptq_v2")
    bits_allowed = (2, 3, 4, 8)
    #: ``anyquant quantize``'s GPTQ flags
    quantize_flags: ClassVar[Sequence[QuantizeFlag]] = (
        QuantizeFlag("desc_act", "GPTQ act-order", "switch"),
        QuantizeFlag("format", "checkpoint format, e.g. gptq (v1) or gptq_v2", "str"),
    )
