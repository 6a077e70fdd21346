"""anyquant-exl3: EXL3 (ExLlamaV3) and EXL2 (ExLlamaV2) checkpoints for anyquant.

Importing this package imports neither torch nor exllamav3 (which fails without CUDA); the hooks
live in :mod:`anyquant_exl3.plugin`.
"""

__version__ = "0.1.0"
