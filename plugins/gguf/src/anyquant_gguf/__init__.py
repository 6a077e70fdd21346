"""anyquant-gguf: GGUF (llama.cpp) files for anyquant.

Importing this package imports neither torch nor gguf; the hooks live in
:mod:`anyquant_gguf.plugin`.
"""

__version__ = "0.1.0"
