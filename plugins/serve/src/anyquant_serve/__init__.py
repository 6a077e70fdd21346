"""``anyquant serve``: an OpenAI-compatible HTTP server for a loaded checkpoint, and the hand-off of a checkpoint
to an engine that serves it at scale (vLLM, exllamav3).

The anyquant-serve distribution: ``anyquant serve`` registers through the ``anyquant_register_commands`` hook
(:mod:`anyquant_serve.plugin`, this distribution's entry point). The HTTP stack (Starlette, uvicorn, sse-starlette)
is this distribution's dependency, imported only when a server starts. The vLLM command lines are core's
(``anyquant.plugin.vllm_plan``, which ``anyquant advise`` writes too), standard library only.
"""

from __future__ import annotations

__all__: list[str] = []
