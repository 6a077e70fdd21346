"""Quantizing into compressed-tensors with llm-compressor (``quantizer_backend="llmcompressor"``).

llm-compressor (the vLLM project's) runs in a worker subprocess of its own interpreter (:mod:`llmcompressor_worker`):
it pins an older transformers than anyquant's, so it usually lives in a venv of its own
(``make install`` makes ``.venv-llmcompressor``), named by the ``llmcompressor_python`` option or the
``ANYQUANT_LLMCOMPRESSOR_PYTHON`` environment variable; without either, this interpreter is used where it imports
llmcompressor. Methods: ``compressed-tensors`` with ``scheme=`` (any preset below), the shorthands of
:data:`METHOD_ALIASES` (``w4a16``, ``w8a8``, ``fp8``, ...), and ``awq``/``gptq`` with ``quantizer_backend="llmcompressor"``
(llm-compressor's AWQ and GPTQ modifiers, written as compressed-tensors: what vLLM serves).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from anyquant.plugin import Probe, QuantizeError, QuantizeFlag, QuantizeSpec
from anyquant_tools import calibration_texts

__all__ = ["METHOD_ALIASES", "SCHEMES", "CTQuantizer"]

#: llm-compressor presets this quantizer runs on a CPU, and whether they need calibration data
SCHEMES: Mapping[str, bool] = MappingProxyType(
    {
        "W4A16": False,
        "W4A16_ASYM": False,
        "W8A16": False,
        "W8A8": False,
        "FP8": True,  # static per-tensor activation scales: calibrated
        "FP8_DYNAMIC": False,
        "FP8_BLOCK": False,
        "NVFP4A16": False,
        "MXFP4A16": False,
    }
)
#: method names (``anyquant quantize --method``) that mean compressed-tensors with these options
METHOD_ALIASES: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "w4a16": {"scheme": "W4A16"},
        "w4a16-asym": {"scheme": "W4A16_ASYM"},
        "w8a16": {"scheme": "W8A16"},
        "w8a8": {"scheme": "W8A8"},
        "fp8": {"scheme": "FP8_DYNAMIC"},
        "fp8-static": {"scheme": "FP8"},
        "fp8-block": {"scheme": "FP8_BLOCK"},
        "nvfp4": {"scheme": "NVFP4A16"},
        "awq@llmcompressor": {"modifier": "awq", "scheme": "W4A16_ASYM"},
        "gptq@llmcompressor": {"modifier": "gptq", "scheme": "W4A16"},
    }
)
ENV_PYTHON = "ANYQUANT_LLMCOMPRESSOR_PYTHON"
WORKER = Path(__file__).resolve().parent / "llmcompressor_worker.py"


def llmcompressor_python(options: Mapping[str, Any]) -> str:
    """The interpreter that runs llm-compressor: the option, the environment variable, or this one if it imports it."""
    given = options.get("llmcompressor_python") or os.environ.get(ENV_PYTHON)
    if given:
        path = shutil.which(str(given)) or str(given)
        if not os.access(path, os.X_OK):
            raise QuantizeError(f"llmcompressor_python={given!r} is not an executable Python")
        return path
    import importlib.util

    if importlib.util.find_spec("llmcompressor") is not None:
        return sys.executable
    raise QuantizeError(
        "llm-compressor is not installed for this Python, and no other is named. It pins an older transformers than "
        "anyquant's, so give it a venv of its own: python -m venv V && V/bin/pip install torch==2.13.0 "
        f"llmcompressor==0.14.0.1, then pass llmcompressor_python='V/bin/python' (or set {ENV_PYTHON}); "
        "`make install` makes .venv-llmcompressor"
    )


class CTQuantizer:
    """compressed-tensors checkpoints written by llm-compressor's ``oneshot`` in a worker."""

    method = "compressed-tensors"
    method_aliases: ClassVar[Mapping[str, Mapping[str, str]]] = METHOD_ALIASES
    quantize_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "scheme": f"llm-compressor's preset: {', '.join(SCHEMES)} (default W4A16)",
            "modifier": "'quantization' (round to nearest, default), 'gptq' or 'awq' (calibrated)",
            "quantizer_backend": "'llmcompressor' (the one backend; 'auto' is the same)",
            "llmcompressor_python": f"the Python that imports llmcompressor (default: ${ENV_PYTHON}, else this one)",
            "ignore": "module names (or 're:' patterns) left unquantized (default ['lm_head'])",
        }
    )

    quantize_flags: ClassVar[tuple[QuantizeFlag, ...]] = (
        QuantizeFlag("scheme", f"compressed-tensors: llm-compressor's preset ({', '.join(SCHEMES)})", "str"),
        QuantizeFlag(
            "quantizer_backend",
            "which tool quantizes: 'llmcompressor' writes compressed-tensors (with --method awq/gptq too)",
            "str",
        ),
        QuantizeFlag("llmcompressor_python", f"the Python that imports llmcompressor (default ${ENV_PYTHON})", "str"),
    )

    def validate(self, probe: Probe, spec: QuantizeSpec) -> None:
        opts = spec.options
        scheme = opts.get("scheme", "W4A16")
        if scheme not in SCHEMES:
            raise QuantizeError(f"scheme={scheme!r} is not one of {list(SCHEMES)}")
        if opts.get("modifier", "quantization") not in ("quantization", "gptq", "awq"):
            raise QuantizeError(f"modifier={opts.get('modifier')!r} is not 'quantization', 'gptq' or 'awq'")
        if opts.get("quantizer_backend", "auto") not in ("auto", "llmcompressor"):
            raise QuantizeError(
                f"quantizer_backend={opts.get('quantizer_backend')!r}: compressed-tensors has 'llmcompressor'"
            )
        ignore = opts.get("ignore", ["lm_head"])
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise QuantizeError("ignore must be a list of module names or 're:' patterns")
        gs = spec.group_size
        if scheme in ("W4A16", "W4A16_ASYM", "W8A16"):
            widths = {
                t.shape[1]
                for n, t in probe.tensors.items()
                if n.endswith(".weight") and ".layers." in n and len(t.shape) == 2
            }
            bad = sorted(k for k in widths if gs <= 0 or k % gs)
            if bad:
                raise QuantizeError(f"group_size={gs} does not divide in_features {bad[0]}: choose a divisor (32, 64)")
        llmcompressor_python(opts)  # refused now, before any work, if there is none

    def quantize(
        self, src: Path, dst: Path, spec: QuantizeSpec, progress: Callable[[str, float], None] | None = None
    ) -> Path:
        from anyquant_tools import run_worker

        opts = spec.options
        scheme = opts.get("scheme", "W4A16")
        modifier = opts.get("modifier", "quantization")
        calibrate = modifier != "quantization" or SCHEMES[scheme]
        texts = calibration_texts(spec) if calibrate else []
        scratch = dst / ".scratch"
        out = dst / "model"
        job = {
            "src": str(Path(src).resolve()),
            "dst": str(out.resolve()),
            "scheme": scheme,
            "group_size": spec.group_size,
            "modifier": modifier,
            "calibrate": calibrate,
            "ignore": opts.get("ignore", ["lm_head"]),
            "texts": texts,
            "seq_len": spec.calibration_seq_len,
            "seed": opts.get("seed", 0),
        }
        run_worker(str(WORKER), job, scratch=scratch, progress=progress, python=llmcompressor_python(opts))
        shutil.rmtree(scratch, ignore_errors=True)
        return out
