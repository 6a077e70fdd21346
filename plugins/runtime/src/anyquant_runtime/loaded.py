"""The object :func:`anyquant.load` returns: :class:`~anyquant.protocols.LoadedModel`, which lives next to the
protocols that name it (``Loader.load`` returns one); this module keeps its import path."""

from __future__ import annotations

from anyquant.protocols import LoadedModel

__all__ = ["LoadedModel"]
