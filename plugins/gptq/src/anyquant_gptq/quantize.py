"""GPTQ quantization through GPTQModel, run in a worker subprocess (core's
:class:`anyquant.int4.gptqmodel_quantizer.GPTQModelQuantizer`)."""

from __future__ import annotations

from anyquant.int4.gptqmodel_quantizer import GPTQModelQuantizer

__all__ = ["GPTQQuantizer"]


class GPTQQuantizer(GPTQModelQuantizer):
    method = "gptq"
    formats = ("gptq", "gptq_v2")
    bits_allowed = (2, 3, 4, 8)
