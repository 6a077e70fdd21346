"""anyquant-bnb: bitsandbytes 4-bit (nf4/fp4) and 8-bit (LLM.int8) checkpoints for anyquant.

Importing this package imports neither torch nor bitsandbytes; the hooks live in :mod:`anyquant_bnb.plugin`.
"""

__version__ = "0.1.0"
