"""anyquant-fp8: FP8 checkpoints (``quant_method: "fp8"``: block-scaled ``weight_scale_inv``) for anyquant.

Importing this package imports neither torch nor transformers; the hooks live in :mod:`anyquant_fp8.plugin`.
"""

__version__ = "0.1.0"
