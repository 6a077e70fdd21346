"""The OpenAI-compatible HTTP API of ``anyquant serve``: a Starlette app over a :class:`~.scheduler.Scheduler`.

Routes: ``GET /health``, ``GET /metrics`` (Prometheus, :mod:`.metrics`), ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as
server-sent events ending in ``data: [DONE]`` with ``"stream": true``). Errors take OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` with the status that fits; no traceback leaves the server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from anyquant.plugin import AnyquantError, TokenLogprob
from anyquant_runtime.harmony import HarmonyStream, parse_harmony

from .reasoning import ThinkStream, split_thinking
from .scheduler import Finished, QueueFull, Request
from .schema import MAX_CHOICES, ChatRequest, CompletionRequest, RequestError, parse_json, validate
from .tools import ToolStream, parse_tool_calls

__all__ = ["MAX_CHOICES", "ApiError", "ServerConfig", "build_app"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    timeout: float = 600.0  # seconds a request may run, queueing included
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0  # seconds a request's body may take to arrive after its headers
    metrics: bool = True  # GET /metrics (Prometheus), open like /health: the key does not guard it
    #: a thinking model's ``<think>`` block as ``reasoning_content`` (``--reasoning-format auto``), else in content
    reasoning: bool = True


class ApiError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error"}
        self.type = kinds.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------- request parsing


@dataclass
class _Job:
    ids: list[int]
    params: Any
    max_tokens: int
    stream: bool
    include_usage: bool
    logprobs: bool = False  # report each token's log-probability (params.top_logprobs alternatives with it)
    n: int = 1  # choices, each its own request (seed + i when a seed is given)
    echo: str | None = None  # completions' echo: the prompt's text, put before each choice's text
    #: structured output: the field that asked (``response_format``, ``guided_json``, ...) and its format
    format: tuple[str, Any] | None = None
    grammar: Any = None  # the format compiled (off the event loop: :func:`_compiled`)
    #: tool calls: the format the chat template's model writes them in, parsed back from each answer
    tools: Any = None
    #: the chat template writes OpenAI's harmony format (gpt-oss): answers decoded with their channel markers and
    #: split into reasoning, content and tool calls (:mod:`.harmony`)
    harmony: bool = False
    tool_list: list[dict[str, Any]] = field(default_factory=list)  # the request's tools (qwen3_xml reads their types)
    #: a thinking model's answer (:mod:`.reasoning`): ``None``, not split; else whether it begins inside ``<think>``
    thinking: bool | None = None
    stats: Any = None  # the request's :class:`~.metrics.RequestStats` when the server keeps metrics


def _validated(app: _Server, body: Mapping[str, Any], chat: bool) -> ChatRequest | CompletionRequest:
    """The body against OpenAI's schema (:mod:`.schema`), token ids against the model's vocabulary: a 400 naming
    the first parameter that does not fit."""
    try:
        return validate(body, chat, vocab=lambda: int(app.adapter.vocab_size()))
    except RequestError as exc:
        raise ApiError(400, exc.message, exc.code, exc.param) from None


def _prompt_ids(
    app: _Server, request: ChatRequest | CompletionRequest, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The prompt's token ids; ``tools``: a chat request's tools to render (``None``: none offered)."""
    try:
        if isinstance(request, ChatRequest):
            messages = [m.template_dict() for m in request.messages]
            if tools is not None or request.reasoning_effort is not None:
                extra = {"reasoning_effort": request.reasoning_effort} if request.reasoning_effort is not None else {}
                return list(app.adapter.encode_chat(messages, tools, **extra))
            return list(app.adapter.encode(messages, chat=True))
        if isinstance(request.prompt, list):  # token ids, checked against the vocabulary by the schema
            return list(request.prompt)
        return list(app.adapter.encode(request.prompt, chat=False))
    except AnyquantError as exc:
        chat = isinstance(request, ChatRequest)
        raise ApiError(400, str(exc), "invalid_value", "messages" if chat else "prompt") from None


def _tool_dicts(request: ChatRequest) -> list[dict[str, Any]]:
    """The request's tools as chat templates and schemas read them: OpenAI's ``{"type": "function", ...}``."""
    return [tool.model_dump(exclude_none=True) for tool in request.tools or ()]


def _harmony(app: _Server) -> bool:
    """Whether the model's chat template writes OpenAI's harmony format and this engine decodes the answers with
    their markers (:mod:`.harmony`)."""
    from anyquant_runtime.harmony import is_harmony

    if not getattr(app.scheduler, "special_text", False) or not hasattr(app.adapter, "chat_template"):
        return False
    source = app.adapter.chat_template()
    return source is not None and is_harmony(source)


def _template_reads(app: _Server, request: ChatRequest) -> None:
    """A 400 when the request sets ``reasoning_effort`` and the chat template never reads it (OpenAI answers a
    model without reasoning the same way)."""
    from .tools import template_reads

    if request.reasoning_effort is None:
        return
    source = app.adapter.chat_template() if hasattr(app.adapter, "encode_chat") else None
    if source is None or not template_reads(source, "reasoning_effort"):
        raise ApiError(
            400,
            "reasoning_effort is not supported with this model (its chat template does not read it)",
            "unsupported_parameter",
            "reasoning_effort",
        )


def _tool_format(app: _Server, request: ChatRequest, harmony: bool = False) -> Any:
    """The tool-call format of the model's chat template (:mod:`.tools`; :data:`~.tools.HARMONY` for a harmony
    template), or ``None`` when the request offers no tools (or ``tool_choice: "none"``); a 400 when the engine
    or the template cannot take tools."""
    from .tools import HARMONY, detect_format, supports_tools

    mode = request.tool_mode()
    if mode == "none":
        return None
    if not hasattr(app.adapter, "encode_chat"):
        raise ApiError(400, "tools are not supported by this server's engine", "unsupported_parameter", "tools")
    source = app.adapter.chat_template()
    if source is None or not supports_tools(source):
        raise ApiError(400, "this model's chat template has no tool support", "unsupported_parameter", "tools")
    fmt = HARMONY if harmony else detect_format(source)
    if fmt is None:
        raise ApiError(
            400,
            "this model's chat template writes tool calls in a format anyquant serve does not parse "
            "(it parses Hermes/Qwen <tool_call>, Qwen3-Coder's XML, Llama 3 JSON, Mistral [TOOL_CALLS], DeepSeek's "
            "<｜tool▁calls▁begin｜> and DSML, Kimi K2's, GLM-4.5's, Granite's <|tool_call|>, functools[...], "
            "Functionary v3.1/v3.2's, pythonic [f(x=1)] lists and gpt-oss's harmony)",
            "unsupported_parameter",
            "tools",
        )
    if mode in ("required", "function"):
        asked = request.output_format()
        if asked is not None:
            name = asked[0]
            raise ApiError(
                400, f"one output constraint per request: tool_choice {mode} and {name}", "invalid_value", name
            )
        if not getattr(app.scheduler, "structured_output", False):
            raise ApiError(
                400,
                f"tool_choice {mode} is not supported by this server's engine (it needs constrained decoding)",
                "unsupported_parameter",
                "tool_choice",
            )
    return fmt


def _tool_constraint(request: ChatRequest, fmt: Any, tools: list[dict[str, Any]]) -> tuple[str, Any] | None:
    """``tool_choice: "required"`` or a named function as a grammar: the template's call markers around a JSON
    call of one of the tools (the named one), so the answer always parses as calls; ``None`` for ``auto``."""
    from anyquant_runtime.grammar import GrammarError, OutputFormat

    from .tools import MAX_PARALLEL_CALLS, call_schema

    mode = request.tool_mode()
    if mode not in ("required", "function"):
        return None
    name = request.tool_choice.function.name if mode == "function" else None  # type: ignore[union-attr]
    calls = MAX_PARALLEL_CALLS if mode == "required" and request.parallel_tool_calls is not False else 1
    try:
        if fmt.name == "harmony":  # one call a turn: its header naming the function, then its arguments
            from anyquant_runtime.harmony import call_options

            from .tools import functions

            return "tools", OutputFormat.tagged(call_options(functions(tools, name)))
        from .tools import XML_STYLES, named_calls

        if fmt.name in XML_STYLES:  # a tag around each required parameter (Qwen3-Coder's, GLM's, DeepSeek's DSML)
            from .tools import xml_calls

            return "tools", OutputFormat.xml_calls(xml_calls(tools, name), fmt.sep, calls, XML_STYLES[fmt.name])
        named = named_calls(tools, fmt, name, request.history_calls())
        if named is not None:  # the name outside the arguments' JSON (DeepSeek's, Kimi's, Functionary's)
            grammar = OutputFormat.named_calls(named.options, named.begin, named.end, calls, named.sep, named.first)
            return "tools", grammar
        schema = call_schema(tools, fmt, name)
        if fmt.array:  # one JSON array of calls after the marker
            schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": calls}
            grammar = OutputFormat.tool_calls(schema, fmt.begin, fmt.end)
        else:
            grammar = OutputFormat.tool_calls(schema, fmt.begin, fmt.end, fmt.sep, calls)
    except GrammarError as exc:
        raise ApiError(400, f"tools: {exc}", "invalid_value", "tools") from None
    return "tools", grammar


def _engine_refuses(app: _Server, request: ChatRequest | CompletionRequest) -> None:
    """What the schema allows but this server's engine cannot do: a 400 naming the parameter."""
    n = request.n or 1
    capacity = getattr(app.scheduler, "capacity", None)
    if capacity is not None and n > capacity:  # a 503 "retry later" that no retry could satisfy
        raise ApiError(
            400,
            f"n={n}: this server takes at most {capacity} requests at once (--max-batch and --max-queue)",
            "invalid_value",
            "n",
        )
    if not getattr(app.scheduler, "full_sampling", False):
        asked = [
            name
            for name in ("presence_penalty", "frequency_penalty", "min_p", "logit_bias")
            if getattr(request, name)  # neutral values (0, {}) are no request
        ]
        asked += ["logprobs"] if request.top() is not None else []
        if asked:
            name = asked[0]
            raise ApiError(400, f"{name} is not supported by this server's engine", "unsupported_parameter", name)
    asked_format = request.output_format()
    if asked_format is not None and not getattr(app.scheduler, "structured_output", False):
        name = asked_format[0]
        raise ApiError(400, f"{name} is not supported by this server's engine", "unsupported_parameter", name)
    echo = isinstance(request, CompletionRequest) and bool(request.echo)
    if echo and request.top() is not None and not getattr(app.scheduler, "prompt_scoring", False):
        raise ApiError(
            400, "echo with logprobs is not supported by this server's engine", "unsupported_parameter", "echo"
        )
    if request.asked_tokens() == 0 and not getattr(app.scheduler, "prompt_only", False):
        raise ApiError(
            400,
            "max_tokens=0 (echo's prompt alone) is not supported by this server's engine",
            "unsupported_parameter",
            "max_tokens",
        )


def _params(request: ChatRequest | CompletionRequest, harmony: bool = False) -> Any:
    """The request's sampling parameters; ``harmony``: its answer also stops at ``<|call|>`` and ``<|return|>``."""
    from anyquant.plugin import GenerationParams
    from anyquant_runtime.harmony import ENDS

    extras: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty", "min_p", "logit_bias"):
        value = getattr(request, name)
        if value:
            extras[name] = value
    top = request.top()
    stops = request.stops()
    try:
        return GenerationParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            seed=request.seed,
            stop=stops + (tuple(s for s in ENDS if s not in stops) if harmony else ()),
            logprobs=top is not None,
            top_logprobs=top or 0,
            **extras,
        )
    except AnyquantError as exc:  # the schema holds every bound GenerationParams checks: not reached
        raise ApiError(400, str(exc), "invalid_value") from None


def _output_format(request: ChatRequest | CompletionRequest) -> tuple[str, Any] | None:
    """The constraint the request asks for, as ``(field, OutputFormat)``; a 400 naming the field when it is too
    large to compile."""
    from anyquant_runtime.grammar import GrammarError, OutputFormat

    asked = request.output_format()
    if asked is None:
        return None
    name, value = asked
    try:
        if name == "response_format":
            schema = value.json_schema.schema_ if value.json_schema is not None else None
            fmt = OutputFormat.json_object() if schema is None else OutputFormat.json_schema(schema)
        elif name == "guided_json":
            fmt = OutputFormat.json_schema(value)
        elif name == "guided_regex":
            fmt = OutputFormat.regex(value)
        else:
            fmt = OutputFormat.choice(value)
    except GrammarError as exc:
        raise ApiError(400, f"{name}: {exc}", "invalid_value", name) from None
    return name, fmt


async def _compiled(app: _Server, name: str, fmt: Any) -> Any:
    """``fmt`` compiled for the model, in a worker thread (the event loop goes on): a 400 naming ``name`` when it
    cannot be compiled (or not in the time allowed), or when xgrammar is not installed."""
    from anyquant_runtime.grammar import GrammarError, GrammarUnavailable, unavailable

    reason = unavailable()
    if reason is not None:
        raise ApiError(400, f"{name}: {reason}", "unsupported_parameter", name)
    try:
        return await asyncio.to_thread(app.adapter.grammars().compile, fmt)
    except GrammarUnavailable as exc:
        raise ApiError(400, f"{name}: {exc}", "unsupported_parameter", name) from None
    except GrammarError as exc:
        raise ApiError(400, f"{name}: {exc}", "invalid_value", name) from None


def _job(app: _Server, body: Mapping[str, Any], chat: bool) -> _Job:
    request = _validated(app, body, chat)
    if request.model != app.config.model_name:
        raise ApiError(
            404,
            f"The model {request.model!r} does not exist; this server serves {app.config.model_name!r}",
            "model_not_found",
        )
    _engine_refuses(app, request)
    harmony = isinstance(request, ChatRequest) and _harmony(app)
    tools = tool_list = None  # the template's tool-call format, and the request's tools as the template reads them
    if isinstance(request, ChatRequest):
        _template_reads(app, request)
        tools = _tool_format(app, request, harmony)
    fmt = _output_format(request)
    if isinstance(request, ChatRequest) and tools is not None:
        tool_list = _tool_dicts(request)
        fmt = _tool_constraint(request, tools, tool_list) or fmt
    params = _params(request, harmony)
    top = request.top()
    echo = isinstance(request, CompletionRequest) and bool(request.echo)
    ids = _prompt_ids(app, request, tool_list)
    context = app.adapter.context
    if context is not None and len(ids) > context:
        raise ApiError(
            400,
            f"This model's maximum context length is {context} tokens; the prompt is {len(ids)} tokens",
            "context_length_exceeded",
            "messages" if chat else "prompt",
        )
    room = context + 1 - len(ids) if context is not None else None  # as generate: a full prompt still gets one
    asked = request.asked_tokens()
    if asked is None:
        if room is None:
            raise ApiError(
                400, "max_tokens is required: this model's context length is unknown", "invalid_value", "max_tokens"
            )
        asked = room
    max_tokens = min(asked, room) if room is not None else asked
    text = None
    if isinstance(request, CompletionRequest) and echo:
        text = request.prompt if isinstance(request.prompt, str) else app.adapter.decode(ids)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    job = _Job(ids, params, max_tokens, bool(request.stream), include_usage, top is not None, request.n or 1, text)
    job.format, job.tools, job.harmony, job.tool_list = fmt, tools, harmony, tool_list or []
    if isinstance(request, ChatRequest) and not harmony and fmt is None and app.config.reasoning:
        job.thinking = _thinking(app, ids)
    return job


def _thinking(app: _Server, ids: Sequence[int]) -> bool | None:
    """``None`` unless the chat template is a thinking model's (:mod:`.reasoning`); else whether the rendered prompt
    (its last tokens) leaves a ``<think>`` block open."""
    from .reasoning import begins_thinking, thinks

    source = app.adapter.chat_template() if hasattr(app.adapter, "chat_template") else None
    if source is None or not thinks(source):
        return None
    return begins_thinking(app.adapter.decode(ids[-16:]))


# ---------------------------------------------------------------------- the app


class _Server:
    def __init__(self, scheduler: Any, config: ServerConfig) -> None:
        self.scheduler = scheduler
        self.adapter = scheduler.adapter
        self.config = config
        self.created = int(time.time())


class _Run:
    """A submitted request (one choice) seen from the event loop: its text pieces, log-probabilities and end, in
    order, put on a queue the choices of one HTTP request share, each item with the choice's index."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[int, Any]], index: int, stats: Any = None
    ) -> None:
        self.loop = loop
        self.queue = queue
        self.index = index
        self.stats = stats  # :class:`~.metrics.RequestStats` or None
        self.prompt: list[TokenLogprob | None] | None = None  # echo with logprobs: the prompt's, when scored

    def _put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))

    def emit(self, text: str) -> None:
        if self.stats is not None:
            self.stats.token(self.index)
        self._put(text)

    def logprob(self, item: TokenLogprob) -> None:
        if self.stats is not None:
            self.stats.token(self.index)
        self._put(item)

    def prompt_logprobs(self, items: list[TokenLogprob | None]) -> None:
        self._put(_PromptScores(items))

    def finish(self, done: Finished) -> None:
        if self.stats is not None:
            self.stats.finished(self.index, done.reason, done.completion_tokens)
        self._put(done)


@dataclass(frozen=True)
class _PromptScores:
    items: list[TokenLogprob | None]


def _usage_of(done: Sequence[Finished]) -> dict[str, int]:
    """Usage over a request's choices: the prompt once, every choice's completion tokens (as OpenAI counts)."""
    prompt = done[0].prompt_tokens
    completion = sum(d.completion_tokens for d in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _ended_badly(done: Finished) -> ApiError | None:
    if done.reason == "timeout":
        return ApiError(504, "the request ran past the server's --timeout", "timeout")
    if done.reason == "error":
        detail = str(done.error) if isinstance(done.error, AnyquantError) else type(done.error).__name__
        return ApiError(500, f"generation failed: {detail}", "generation_error")
    return None


def build_app(scheduler: Any, config: ServerConfig) -> Any:
    """The Starlette application (anyquant-serve's dependencies) over ``scheduler``: a :class:`~.scheduler.Scheduler` or
    another engine's with the same ``submit``, ``adapter``, ``running`` and ``waiting``."""
    from sse_starlette.sse import EventSourceResponse
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    server = _Server(scheduler, config)
    metrics = None
    if config.metrics:
        try:
            from .metrics import Metrics

            metrics = Metrics(scheduler, config.model_name)
        except ImportError:  # an install without it (core's old [serve] extra had none)
            log.warning("GET /metrics is off: prometheus_client is not installed (pip install anyquant-serve)")

    def error(exc: ApiError) -> Response:
        headers = {"Retry-After": "1"} if exc.status == 503 else {"Connection": "close"} if exc.status == 408 else None
        # ASCII JSON: a message quoting what a client sent stays encodable whatever it held
        body = json.dumps(exc.body(), ensure_ascii=True)
        return Response(body, status_code=exc.status, headers=headers, media_type="application/json")

    def authorize(request: HttpRequest) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "Incorrect or missing API key (Authorization: Bearer KEY)", "invalid_api_key")

    async def read_json(request: HttpRequest) -> Mapping[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and (
            not (declared.isascii() and declared.isdigit())
            or len(declared) > 12
            or int(declared) > config.max_body_bytes
        ):
            raise ApiError(413, f"the request body is over {config.max_body_bytes} bytes", "request_too_large")
        chunks: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > config.max_body_bytes:
                    raise ApiError(413, f"the request body is over {config.max_body_bytes} bytes", "request_too_large")
                chunks.append(chunk)

        try:  # a client that sends its body slowly, or not at all, holds a connection and a task: not for long
            await asyncio.wait_for(read(), config.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within {config.body_timeout:g} s", "request_timeout"
            ) from None
        except ClientDisconnect:  # gone mid-body (or its framing refused by h11): nobody reads the answer
            raise ApiError(400, "the client went away before its request body arrived", "client_disconnected") from None
        try:
            return parse_json(b"".join(chunks))
        except RequestError as exc:
            raise ApiError(400, exc.message, exc.code, exc.param) from None

    async def health(request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "running": scheduler.running, "waiting": scheduler.waiting})

    async def metrics_page(request: HttpRequest) -> Response:
        assert metrics is not None
        body, kind = metrics.render()
        return Response(body, headers={"Content-Type": kind})

    async def models(request: HttpRequest) -> Response:
        try:
            authorize(request)
        except ApiError as exc:
            return error(exc)
        card = {"id": config.model_name, "object": "model", "created": server.created, "owned_by": "anyquant"}
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(request: HttpRequest, chat: bool) -> Response:
        works: list[Request] = []
        start = time.monotonic()
        try:
            authorize(request)
            body = await read_json(request)
            job = _job(server, body, chat)
            if job.format is not None:
                job.grammar = await _compiled(server, *job.format)
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
            deadline = time.monotonic() + config.timeout
            if metrics is not None:
                job.stats = metrics.request(job.n, start)
            choices: list[Request] = []
            for i in range(job.n):
                run = _Run(loop, queue, i, job.stats)
                params = job.params
                if i and params.seed is not None:  # choice i samples with seed + i: reproducible, not identical
                    params = replace(params, seed=(params.seed + i) % 2**63)  # past 2**63 - 1: from 0 again
                work = Request(job.ids, params, job.max_tokens, run.emit, run.finish, deadline)
                work.grammar = job.grammar  # each choice its own matcher over the one compiled grammar
                # harmony's channels, and a tool format whose markers are special tokens (DeepSeek's), need their text
                work.special = job.harmony or bool(job.tools is not None and job.tools.special)
                if job.logprobs:
                    work.logprob = run.logprob
                    if job.echo is not None:
                        work.prompt_logprobs, work.prompt_top = run.prompt_logprobs, params.top_logprobs
                choices.append(work)
            try:  # together, so the choices share a prefill (an engine without submit_many takes them one by one)
                if hasattr(scheduler, "submit_many"):
                    scheduler.submit_many(choices)
                else:
                    for work in choices:
                        scheduler.submit(work)
                        works.append(work)
            except QueueFull as exc:
                raise ApiError(503, str(exc), "queue_full") from None
            works = choices
            if job.stats is not None:
                job.stats.prompt(len(job.ids))
        except ApiError as exc:
            for work in works:
                work.cancel()
            return error(exc)
        except Exception:  # never a traceback to the client
            for work in works:
                work.cancel()
            log.exception("bad request")
            return error(ApiError(500, "internal error", "internal_error"))
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": ident, "created": int(time.time()), "model": config.model_name}
        shapes = _Shapes(chat, job.logprobs, server.adapter)
        if job.stream:
            return EventSourceResponse(
                _sse(queue, works, head, shapes, job),
                ping=15,
                shutdown_event=None,
                shutdown_grace_period=config.timeout,
            )
        try:
            answer: Response = await _whole(request, queue, works, head, shapes, job, error)
        finally:
            if job.stats is not None:
                job.stats.close()  # an error answer or a cancelled handler: the engine's reasons count
        return answer

    async def chat_completions(request: HttpRequest) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: HttpRequest) -> Response:
        return await completions(request, chat=False)

    async def not_found(request: HttpRequest, exc: Exception) -> Response:
        return error(ApiError(404, f"no route {request.method} {request.url.path}", "not_found"))

    async def not_allowed(request: HttpRequest, exc: Exception) -> Response:
        return error(ApiError(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"))

    async def internal(request: HttpRequest, exc: Exception) -> Response:
        log.exception("internal error", exc_info=exc)
        return error(ApiError(500, "internal error", "internal_error"))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        *([Route("/metrics", metrics_page, methods=["GET"])] if metrics is not None else []),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed, 500: internal})


class _Shapes:
    """OpenAI's two log-probability shapes, with each token's exact bytes from the adapter."""

    def __init__(self, chat: bool, logprobs: bool, adapter: Any) -> None:
        self.chat, self.logprobs, self.adapter = chat, logprobs, adapter

    def _token(self, token: int, text: str) -> tuple[str, list[int]]:
        """The token's text and bytes: a token holding part of a UTF-8 character (its text alone decodes to U+FFFD)
        is shown as OpenAI shows it, ``bytes:\\xe2\\x80``; its bytes are exact either way."""
        raw = self.adapter.token_bytes(token) if hasattr(self.adapter, "token_bytes") else text.encode("utf-8")
        if "\ufffd" in text and "\ufffd".encode() not in raw:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)

    def chat_logprobs(self, items: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The chat shape: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""

        def entry(token: int, text: str, logprob: float) -> dict[str, Any]:
            shown, raw = self._token(token, text)
            return {"token": shown, "logprob": logprob, "bytes": raw}

        content = [
            {**entry(lp.token_id, lp.text, lp.logprob), "top_logprobs": [entry(*alt) for alt in lp.top]} for lp in items
        ]
        return {"content": content, "refusal": None}

    def legacy_logprobs(self, items: Sequence[TokenLogprob | None], offset: int) -> tuple[dict[str, Any], int]:
        """The completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``: each token's
        character offset in the choice's text from ``offset``) and the offset after the last token. ``None`` items
        are the first prompt token under ``echo``, which nothing predicts: its values are ``null``."""
        shape: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in items:
            shape["text_offset"].append(offset)
            if lp is None:  # the first prompt token: ``null`` log-probabilities, its text from the echo
                shape["tokens"].append("")
                shape["token_logprobs"].append(None)
                shape["top_logprobs"].append(None)
                continue
            shape["tokens"].append(self._token(lp.token_id, lp.text)[0])
            shape["token_logprobs"].append(lp.logprob)
            shape["top_logprobs"].append({self._token(i, t)[0]: v for i, t, v in lp.top})
            offset += len(lp.text)
        return shape, offset

    def first_prompt_token(self, shape: dict[str, Any], echo: str, prompt: list[TokenLogprob | None]) -> None:
        """The first prompt token's text: what the echoed prompt holds before the second token's text."""
        if not prompt or prompt[0] is not None or not shape["tokens"] or shape["tokens"][0] != "":
            return
        rest = sum(len(lp.text) for lp in prompt[1:] if lp is not None)
        first = echo[: max(0, len(echo) - rest)]
        shape["tokens"][0] = first
        shape["text_offset"] = [0] + [o + len(first) for o in shape["text_offset"][1:]]


@dataclass
class _Choice:
    pieces: list[str]
    logprobs: list[TokenLogprob]
    prompt: list[TokenLogprob | None]
    done: Finished | None = None


def _choice(shapes: _Shapes, job: _Job, index: int, c: _Choice) -> dict[str, Any]:
    assert c.done is not None
    text = "".join(c.pieces)
    reason = "length" if c.done.reason == "length" else "stop"
    if shapes.chat and job.harmony:
        answer = parse_harmony(text, job.tools is not None)
        message: dict[str, Any] = answer.message()
        reason = "tool_calls" if answer.calls else reason
        out: dict[str, Any] = {"index": index, "message": message}
    elif shapes.chat:
        reasoning = None
        if job.thinking is not None:
            reasoning, text = split_thinking(text, job.thinking)
        message = {"role": "assistant", "content": text}
        if job.tools is not None:
            content, calls = parse_tool_calls(text, job.tools, job.tool_list)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                reason = "tool_calls"
            elif job.tools.lead:  # Functionary v3.2's "all\n" before content, dropped as its stream drops it
                message["content"] = content or ""
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        out = {"index": index, "message": message}
    else:
        out = {"index": index, "text": (job.echo or "") + text}
    shape = None
    if shapes.logprobs and shapes.chat:
        shape = shapes.chat_logprobs(c.logprobs)
    elif shapes.logprobs:
        items: list[TokenLogprob | None] = [*c.prompt, *c.logprobs] if job.echo is not None else [*c.logprobs]
        shape = shapes.legacy_logprobs(items, 0)[0]
        if job.echo is not None:
            shapes.first_prompt_token(shape, job.echo, c.prompt)
    out.update(finish_reason=reason, logprobs=shape)
    return out


async def _whole(
    request: Any,
    queue: asyncio.Queue[tuple[int, Any]],
    works: Sequence[Request],
    head: dict[str, Any],
    shapes: _Shapes,
    job: _Job,
    error: Any,
) -> Any:
    """A non-streamed answer: wait for every choice's end (cancelling the work if the client goes away)."""
    from starlette.responses import JSONResponse

    choices = [_Choice([], [], []) for _ in works]
    try:
        while any(c.done is None for c in choices):
            try:
                index, item = await asyncio.wait_for(queue.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    for work in works:
                        work.cancel()
                continue
            c = choices[index]
            if isinstance(item, Finished):
                c.done = item
            elif isinstance(item, _PromptScores):
                c.prompt = item.items
            elif isinstance(item, TokenLogprob):
                c.logprobs.append(item)
            else:
                c.pieces.append(item)
    finally:
        for work in works:
            work.cancel()  # a no-op once finished; stops the work when this handler is cancelled
    for c in choices:
        bad = _ended_badly(c.done)  # type: ignore[arg-type]
        if bad is not None:
            return error(bad)
    obj = "chat.completion" if shapes.chat else "text_completion"
    body = [_choice(shapes, job, i, c) for i, c in enumerate(choices)]
    if job.stats is not None:
        for i, answer in enumerate(body):
            job.stats.outcome(i, answer["finish_reason"])
    usage = _usage_of([c.done for c in choices if c.done is not None])
    return JSONResponse({**head, "object": obj, "choices": body, "usage": usage})


async def _sse(
    queue: asyncio.Queue[tuple[int, Any]], works: Sequence[Request], head: dict[str, Any], shapes: _Shapes, job: _Job
) -> AsyncIterator[str]:
    chat = shapes.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    pending: list[list[TokenLogprob | None]] = [[] for _ in works]  # each choice's tokens since its last chunk
    offsets = [0] * len(works)
    done: list[Finished | None] = [None] * len(works)
    # tool calls: each choice's content sent until a call may start, its calls streamed as they are generated
    calls: list[ToolStream] | None = None
    if chat and job.tools is not None and not job.harmony:
        calls = [ToolStream(job.tools, job.tool_list) for _ in works]
    # harmony (gpt-oss): each choice's text split into reasoning, content and tool calls as it is generated
    channels: list[HarmonyStream] | None = None
    if chat and job.harmony:
        channels = [HarmonyStream(job.tools is not None) for _ in works]
    # a thinking model: each choice's <think> block sent as reasoning_content, the rest as content (or tool calls)
    thoughts: list[ThinkStream] | None = None
    if chat and job.thinking is not None:
        thoughts = [ThinkStream(job.thinking) for _ in works]

    def tool_chunks(index: int, content: str, deltas: list[dict[str, Any]]) -> Iterator[str]:
        """A choice's content, then its ``delta.tool_calls`` entries as OpenAI streams them, one a chunk: a call's
        index, id, type and name (empty arguments), then its arguments' text piece by piece (:class:`ToolStream`)."""
        if content:
            yield chunk([piece(index, content, None)])
        for delta in deltas:
            yield chunk([{"index": index, "delta": {"tool_calls": [delta]}, "finish_reason": None, "logprobs": None}])

    def text_chunks(index: int, text: str, final: bool = False) -> Iterator[str]:
        """A chat choice's next text (``final``: its end): its reasoning, then its content or tool calls."""
        if thoughts is not None:
            step = thoughts[index].finish() if final else thoughts[index].feed(text)
            if step[0]:
                yield from channel_chunks(index, [{"reasoning_content": step[0]}])
            text = step[1]
        if calls is not None:
            if text:
                yield from tool_chunks(index, *calls[index].feed(text))
            if final:
                yield from tool_chunks(index, *calls[index].finish())
        elif text:
            yield chunk([piece(index, text, None)])

    def channel_chunks(index: int, deltas: list[dict[str, Any]]) -> Iterator[str]:
        """A harmony choice's deltas (:class:`~.harmony.HarmonyStream`), one a chunk; the log-probabilities of the
        tokens behind them with the first."""
        for delta in deltas:
            first = piece(index, None, None)
            first["delta"] = delta
            yield chunk([first])

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return json.dumps({**head, "object": obj, "choices": choices, **extra}, ensure_ascii=False)

    def piece(index: int, text: str | None, reason: str | None, first: bool = False) -> dict[str, Any]:
        shape = None
        if shapes.logprobs and not first:
            if chat:
                shape = shapes.chat_logprobs([lp for lp in pending[index] if lp is not None])
            else:
                shape, offsets[index] = shapes.legacy_logprobs(pending[index], offsets[index])
            pending[index].clear()
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "finish_reason": reason, "logprobs": shape}
        return {"index": index, "text": text or "", "finish_reason": reason, "logprobs": shape}

    try:
        if chat:
            for index in range(len(works)):
                yield chunk([piece(index, "", None, first=True)])
        elif job.echo is not None and not job.logprobs:
            for index in range(len(works)):
                yield chunk([piece(index, job.echo, None)])
        while any(d is None for d in done):
            index, item = await queue.get()
            if isinstance(item, Finished):
                done[index] = item
                bad = _ended_badly(item)
                if bad is not None:
                    yield json.dumps(bad.body())
                    break
                reason = "length" if item.reason == "length" else "stop"
                if channels is not None:
                    for out in channel_chunks(index, channels[index].finish()):
                        yield out
                    reason = channels[index].reason(reason)
                if calls is not None or thoughts is not None:
                    for out in text_chunks(index, "", final=True):
                        yield out
                if calls is not None:
                    reason = calls[index].reason(reason)
                if job.stats is not None:
                    job.stats.outcome(index, reason)
                yield chunk([piece(index, None if chat else "", reason)])
                continue
            if isinstance(item, _PromptScores):  # echo with logprobs: the prompt and its scores, first
                pending[index].extend(item.items)
                first = piece(index, job.echo, None)
                if first["logprobs"] is not None and job.echo is not None:
                    shapes.first_prompt_token(first["logprobs"], job.echo, item.items)
                    offsets[index] = len(job.echo)
                yield chunk([first])
                continue
            if isinstance(item, TokenLogprob):
                pending[index].append(item)
                continue
            if channels is not None:
                for out in channel_chunks(index, channels[index].feed(item)):
                    yield out
                continue
            if calls is not None or thoughts is not None:
                for out in text_chunks(index, item):
                    yield out
                continue
            yield chunk([piece(index, item, None)])
        else:
            if job.include_usage:
                yield chunk([], usage=_usage_of([d for d in done if d is not None]))
        yield "[DONE]"
    finally:
        for work in works:
            work.cancel()  # the client went away (or the stream ended): the scheduler drops it at its next step
        if job.stats is not None:
            job.stats.close()
