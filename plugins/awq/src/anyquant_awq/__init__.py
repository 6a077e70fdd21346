"""anyquant-awq: AWQ checkpoints (AutoAWQ, GPTQModel) for anyquant.

Importing this package imports neither torch nor an AWQ library; the hooks live in
:mod:`anyquant_awq.plugin`.
"""

__version__ = "0.1.0"
