"""anyquant-mxfp4: MXFP4 checkpoints (``quant_method: "mxfp4"``: gpt-oss's packed experts) for anyquant.

Importing this package imports neither torch nor transformers; the hooks live in :mod:`anyquant_mxfp4.plugin`.
"""

__version__ = "0.1.0"
