"""anyquant-gptq: GPTQ checkpoints (GPTQModel, AutoGPTQ) for anyquant.

Importing this package imports neither torch nor gptqmodel; the hooks live in
:mod:`anyquant_gptq.plugin` (the entry point), the loader in :mod:`anyquant_gptq.loader`.
"""

__version__ = "0.1.0"
