"""``anyquant serve``: an OpenAI-compatible HTTP server for a loaded checkpoint, and the hand-off of a checkpoint
to an engine that serves it at scale (vLLM, exllamav3).

Nothing here is imported by ``import anyquant``; the HTTP stack (Starlette, uvicorn, sse-starlette) is the
``anyquant[serve]`` extra, imported only when a server starts. :mod:`anyquant.serve.engines` builds engine
command lines without importing anything beyond the standard library.
"""

from __future__ import annotations

__all__: list[str] = []
