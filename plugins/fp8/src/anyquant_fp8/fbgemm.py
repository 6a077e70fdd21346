"""transformers' ``fbgemm_fp8`` checkpoints (``FbgemmFp8Config``, ``quant_method: "fbgemm_fp8"``) from their headers.

transformers 5.24 (``integrations/fbgemm_fp8.py``, ``quantizers/quantizer_fbgemm_fp8.py``): every linear that
``modules_to_not_convert`` does not name becomes an ``FbgemmFp8Linear`` holding

- ``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale`` float32 ``[out, 1]``: fbgemm's
  ``quantize_fp8_per_row`` of the 16-bit weight (per output row ``s = max(max|w| / 448, 1 / (448 * 512))``,
  ``w8 = e4m3_satfinite(w / s)``); the weight is ``float32(w8) * weight_scale`` (fbgemm's rowwise GEMM multiplies
  the accumulator by it);
- ``input_scale_ub``: a non-persistent buffer (not on disk; a stored one is ignored, as transformers ignores it) that
  the quantizer fills with the config's ``activation_scale_ub`` (default 1200.0) after loading; the forward
  quantizes each input row with it: ``quantize_fp8_per_row(x, scale_ub=input_scale_ub)``
  (:func:`anyquant_fp8.qlinear.quantize_fbgemm_activations`).

``modules_to_not_convert`` (``null``: transformers' default, the output embedding ``lm_head``) is matched as
transformers' ``should_convert_module`` matches it: a regex from the start of the name up to a module boundary, or
a suffix. Llama-4's MoE experts (``FbgemmFp8Llama4TextExperts``: 3-D ``gate_up_proj``/``down_proj`` with
``*_proj_scale``) are refused by name. Standard library only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from anyquant.plugin import ConfigError, Probe

__all__ = ["DEFAULT_SCALE_UB", "EXPERT_TENSORS", "FbgemmConfig", "read_fbgemm_config"]

#: ``FbgemmFp8Config.activation_scale_ub``'s default
DEFAULT_SCALE_UB = 1200.0
#: transformers' default ``modules_to_not_convert`` of a causal LM (``get_keys_to_not_convert``: the output embedding)
DEFAULT_SKIPS = ("lm_head",)
#: Llama-4's fbgemm experts (``FbgemmFp8Llama4TextExperts``): their FP8 tensors and scales
EXPERT_TENSORS = ("gate_up_proj", "down_proj")
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


@dataclass(frozen=True)
class FbgemmConfig:
    """What ``quantization_config`` says: the activations' scale upper bound and the modules kept dense."""

    activation_scale_ub: float
    #: as the config writes it (``None``: transformers' default, :data:`DEFAULT_SKIPS`)
    modules_to_not_convert: tuple[str, ...] | None
    #: stored ``input_scale_ub`` tensors (read by nobody: transformers fills the buffer from the config)
    stored_ub: int = 0

    @property
    def skips(self) -> tuple[str, ...]:
        return DEFAULT_SKIPS if self.modules_to_not_convert is None else self.modules_to_not_convert

    def excluded(self, name: str) -> bool:
        """transformers' ``not should_convert_module(name, skips)``: a pattern matches from the start of ``name`` up to
        a module boundary (as a regex), or ends it."""
        return any(re.match(rf"(?:{key}){_BOUNDARY}", name) or name.endswith(key) for key in self.skips)

    def describe(self) -> str:
        skips = "null (lm_head)" if self.modules_to_not_convert is None else list(self.modules_to_not_convert)[:4]
        stored = f", {self.stored_ub} stored input_scale_ub ignored (as transformers)" if self.stored_ub else ""
        return (
            f"transformers fbgemm_fp8: weight_scale per output channel, inputs FP8 per row (fbgemm's "
            f"quantize_fp8_per_row, activation_scale_ub {self.activation_scale_ub:g}), modules_to_not_convert "
            f"{skips}{stored}"
        )


def read_fbgemm_config(probe: Probe) -> FbgemmConfig:
    qc = probe.quantization_config or {}
    ub = qc.get("activation_scale_ub", DEFAULT_SCALE_UB)
    if isinstance(ub, bool) or not isinstance(ub, int | float) or not math.isfinite(ub) or ub <= 0:
        raise ConfigError(
            f"{probe.root}: quantization_config.activation_scale_ub is {ub!r}; expected a positive number (the upper "
            "bound of each input row's max|x|, default 1200.0)"
        )
    raw = qc.get("modules_to_not_convert")
    skips: tuple[str, ...] | None = None
    if raw is not None:
        if not isinstance(raw, Sequence) or isinstance(raw, str) or not all(isinstance(v, str) for v in raw):
            raise ConfigError(f"quantization_config.modules_to_not_convert is {raw!r}; expected a list of names")
        if len(raw) > 1 << 16:
            raise ConfigError(f"quantization_config.modules_to_not_convert has {len(raw)} entries")
        for key in raw:
            try:
                re.compile(key)
            except re.error as e:
                raise ConfigError(
                    f"quantization_config.modules_to_not_convert entry {key!r} is not a regex: {e}"
                ) from e
        skips = tuple(raw)
    stored = sum(1 for n in probe.tensors if n.endswith(".input_scale_ub"))
    return FbgemmConfig(float(ub), skips, stored)
