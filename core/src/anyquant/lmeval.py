"""``anyquant.lmeval``: the lm-eval adapter's public module path (lm-eval users import it by name); the adapter lives
in :mod:`anyquant.tools.lmeval`. Importing either registers the lm-eval model ``"anyquant"``.
"""

from .tools.lmeval import AnyquantLM, generation_keywords

__all__ = ["AnyquantLM", "generation_keywords"]
