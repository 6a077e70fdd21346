"""anyquant-tools: quantize, calibration, evaluate/compare, check, estimate, advise, export, the lm-eval adapter,
and their commands (``anyquant quantize``, ``export``, ``eval``, ``compare``, ``check``, ``estimate``, ``advise``,
``calibration``), registered through the command hook by :mod:`.plugin`.

The public functions are also ``anyquant.quantize``, ``anyquant.compare`` ... (core's top level imports them from
here when asked). The names below are this distribution's declared API for plugins: a format plugin's quantizer
uses the calibration texts and the worker protocol (:func:`run_worker`, :func:`emit_progress` ...), anyquant-serve the
vLLM command plan. The tools build on the contract (:mod:`anyquant.plugin`, ``anyquant.api``) and the runtime
(:mod:`anyquant_runtime`); nothing of core or the runtime imports them. Importing this package imports nothing
heavy: names are imported lazily, each looked up in its home module every time (a test that patches
``anyquant_tools.quantize.run_worker`` patches what plugins get from here too).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # the public tools (also anyquant.<name>)
    "quantize": "quantize",
    "export_dense": "export",
    "perplexity": "evaluate",
    "compare": "evaluate",
    "EvalResult": "evaluate",
    "EvaluationError": "evaluate",
    "estimate": "estimate",
    "advise": "advise",
    "Estimate": "estimate",
    "Advice": "advise",
    "CalibrationError": "calibration",
    "CalibrationOverlapError": "calibration",
    # a quantizer's calibration, backend routing and worker subprocesses
    "calibration_texts": "quantize",
    "calibration_batch": "quantize",
    "route_backend": "quantize",
    "run_worker": "quantize",
    "emit_progress": "quantize",
    "emit_result": "quantize",
    "watch_parent": "quantize",
    # GPTQModel's quantizer, the base of GPTQ's and AWQ's (run in a worker subprocess)
    "GPTQModelQuantizer": "gptqmodel_quantizer",
    # the vLLM command line a detected checkpoint implies (``advise`` writes it, anyquant-serve's --engine vllm runs it)
    "VllmPlan": "engines",
    "vllm_plan": "engines",
}

__all__ = [  # a literal, sorted list (type checkers read it)
    "Advice",
    "CalibrationError",
    "CalibrationOverlapError",
    "Estimate",
    "GPTQModelQuantizer",
    "EvalResult",
    "EvaluationError",
    "VllmPlan",
    "__version__",
    "advise",
    "calibration_batch",
    "calibration_texts",
    "compare",
    "emit_progress",
    "emit_result",
    "estimate",
    "export_dense",
    "perplexity",
    "quantize",
    "route_backend",
    "run_worker",
    "vllm_plan",
    "watch_parent",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'anyquant_tools' has no attribute {name!r}")
    return getattr(importlib.import_module(f"anyquant_tools.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from .advise import Advice, advise
    from .calibration import CalibrationError, CalibrationOverlapError
    from .engines import VllmPlan, vllm_plan
    from .estimate import Estimate, estimate
    from .evaluate import EvalResult, EvaluationError, compare, perplexity
    from .export import export_dense
    from .gptqmodel_quantizer import GPTQModelQuantizer
    from .quantize import (
        calibration_batch,
        calibration_texts,
        emit_progress,
        emit_result,
        quantize,
        route_backend,
        run_worker,
        watch_parent,
    )
