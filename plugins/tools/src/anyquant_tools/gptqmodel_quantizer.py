"""Quantization through GPTQModel (GPTQ and AWQ), run in a worker subprocess
(:mod:`anyquant_tools.gptqmodel_worker`: importing gptqmodel patches transformers globally)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from anyquant.errors import QuantizeError
from anyquant.probe import Probe
from anyquant.protocols import QuantizeSpec

from .quantize import calibration_texts

__all__ = ["GPTQModelQuantizer", "linear_in_features"]


def linear_in_features(probe: Probe) -> dict[str, int]:
    """``{module: in_features}`` for every 2-D ``*.weight`` of the decoder layers (dense source)."""
    out = {}
    for name, t in probe.tensors.items():
        if name.endswith(".weight") and len(t.shape) == 2 and ".layers." in name:
            out[name.removesuffix(".weight")] = t.shape[1]
    return out


class GPTQModelQuantizer:
    """Shared by GPTQ and AWQ: GPTQModel in :mod:`anyquant_tools.gptqmodel_worker`; a subclass sets
    ``method``, ``formats`` and ``bits_allowed``."""

    method = "gptq"
    formats: tuple[str, ...] = ("gptq", "gptq_v2")
    bits_allowed: tuple[int, ...] = (2, 3, 4, 8)
    #: the ``quantize(..., **options)`` keywords this quantizer reads (any other is a QuantizeError)
    quantize_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "format": "the checkpoint format GPTQModel writes: 'gptq' (default) or 'gptq_v2'",
            "dynamic": "GPTQModel's per-module overrides ({regex: {bits, group_size, ...}}), passed through",
            "dtype": "the dtype GPTQModel quantizes in: 'float16' (default) or 'bfloat16'",
            "batch_size": "calibration batch size (default 4)",
        }
    )

    def validate(self, probe: Probe, spec: QuantizeSpec) -> None:
        bits = spec.bits
        if bits not in self.bits_allowed or int(bits) != bits:
            raise QuantizeError(
                f"{self.method} bits={bits} is not supported; choose one of {self.bits_allowed}"
                + (" (5/6/7-bit GPTQ exists only in GPTQModel's planar gptq_p format)" if self.method == "gptq" else "")
            )
        opts = spec.options
        dtype = opts.get("dtype", "float16")
        if dtype not in ("float16", "bfloat16"):
            raise QuantizeError(f"dtype={dtype!r}: expected 'float16' or 'bfloat16'")
        batch = opts.get("batch_size", 4)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise QuantizeError(f"batch_size={batch!r}: expected an integer >= 1")
        fmt = opts.get("format", self.formats[0])
        if fmt not in self.formats:
            raise QuantizeError(f"{self.method} format {fmt!r} is not one of {self.formats}")
        gs = spec.group_size
        if gs != -1 and gs <= 0:
            raise QuantizeError(f"group_size must be -1 (per channel) or positive, got {gs}")
        if gs > 0:
            bad = {n: k for n, k in linear_in_features(probe).items() if k % gs}
            if bad:
                name, k = next(iter(bad.items()))
                raise QuantizeError(
                    f"group_size={gs} does not divide in_features={k} of {name} ({len(bad)} module(s)); "
                    f"try {math.gcd(k, gs)} or another divisor of {k}"
                )

    def job(self, src: Path, dst: Path, spec: QuantizeSpec, calibration_file: Path) -> dict[str, Any]:
        return {
            "method": self.method,
            "src": str(src.resolve()),
            "dst": str(dst.resolve()),
            "bits": int(spec.bits),
            "group_size": spec.group_size,
            "sym": True if spec.sym is None else spec.sym,
            "desc_act": spec.desc_act,
            "format": spec.options.get("format", self.formats[0]),
            "dynamic": spec.options.get("dynamic"),
            "dtype": spec.options.get("dtype", "float16"),
            "batch_size": spec.options.get("batch_size", 4),
            "seed": spec.options.get("seed", 0),
            "calibration_file": str(calibration_file.resolve()),
        }

    def quantize(
        self, src: Path, dst: Path, spec: QuantizeSpec, progress: Callable[[str, float], None] | None = None
    ) -> Path:
        from .quantize import run_worker

        scratch = dst / ".scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        texts = calibration_texts(spec)
        if not texts:
            raise QuantizeError("no calibration samples")
        texts = _cut_to_tokens(src, texts, spec.calibration_seq_len)
        cal = scratch / "calibration.json"
        cal.write_text(json.dumps(texts))
        out = dst / "model"
        run_worker("anyquant_tools.gptqmodel_worker", self.job(src, out, spec, cal), scratch=scratch, progress=progress)
        return out


def _cut_to_tokens(src: Path, texts: list[str], seq_len: int) -> list[str]:
    """Each text cut to its first ``seq_len`` tokens of the source's tokenizer: samples are drawn by
    characters (about 4 per token), and GPTQModel trims only to the model's context, so a 512-token
    request gave 440-2,050 tokens per text."""
    from anyquant_runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(Probe.open(src))
    if tok is None:
        return texts
    out = []
    for text, ids in zip(texts, tok(texts, add_special_tokens=False)["input_ids"], strict=True):
        out.append(text if len(ids) <= seq_len else str(tok.decode(ids[:seq_len])))
    return out
