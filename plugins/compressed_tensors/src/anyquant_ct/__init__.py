"""anyquant-compressed-tensors: compressed-tensors checkpoints (llm-compressor, vLLM) for anyquant.

Importing this package imports neither torch nor compressed-tensors; the hooks live in :mod:`anyquant_ct.plugin`.
"""

__version__ = "0.1.0"
