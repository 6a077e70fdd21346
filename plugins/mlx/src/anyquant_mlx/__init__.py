"""anyquant-mlx: MLX checkpoints (``mlx_lm.convert -q``) for anyquant.

Importing this package imports neither torch nor mlx; the hooks live in :mod:`anyquant_mlx.plugin`.
"""

__version__ = "0.1.0"
