"""The OpenAI-compatible HTTP API of ``anyquant serve``: a Starlette app over a :class:`~.scheduler.Scheduler`.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as
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
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import AnyquantError
from ..results import TokenLogprob
from .scheduler import Finished, QueueFull, Request

__all__ = ["ApiError", "ServerConfig", "build_app"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    timeout: float = 600.0  # seconds a request may run, queueing included
    max_body_bytes: int = 1 << 20


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


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ApiError(400, f"{name}={value!r}: expected a number in [{lo:g}, {hi:g}]", "invalid_value", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ApiError(400, f"{name}={value!r}: expected an integer >= {lo}", "invalid_value", name)
    return value


def _unsupported(body: Mapping[str, Any], name: str, neutral: Sequence[Any]) -> None:
    value = body.get(name)
    if value is not None and value not in neutral:
        raise ApiError(400, f"{name}={value!r} is not supported by anyquant serve", "unsupported_parameter", name)


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: only text content parts are supported", "invalid_value", where)
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{where}: expected a string or a list of text parts", "invalid_value", where)


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: expected a non-empty list of {role, content}", "invalid_value", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}]: expected an object with a string role", "invalid_value", "messages")
        out.append({"role": m["role"], "content": _text_of(m.get("content") or "", f"messages[{i}].content")})
    return out


def _prompt_ids(app: _Server, body: Mapping[str, Any], chat: bool) -> list[int]:
    try:
        if chat:
            return list(app.adapter.encode(_messages(body), chat=True))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list (what clients send for a single prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = app.adapter.vocab_size()
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", "invalid_value", "prompt")
            return [int(t) for t in prompt]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(
                400, "prompt: expected one non-empty string or one list of token ids", "invalid_value", "prompt"
            )
        return list(app.adapter.encode(prompt, chat=False))
    except AnyquantError as exc:
        raise ApiError(400, str(exc), "invalid_value", "messages" if chat else "prompt") from None


def _job(app: _Server, body: Mapping[str, Any], chat: bool) -> _Job:
    from ..protocols import GenerationParams

    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "model: expected the served model's id (GET /v1/models)", "invalid_value", "model")
    if model != app.config.model_name:
        raise ApiError(
            404, f"The model '{model}' does not exist; this server serves '{app.config.model_name}'", "model_not_found"
        )
    if _integer(body, "n", 1) not in (None, 1):
        raise ApiError(400, "n: only n=1 is supported", "unsupported_parameter", "n")
    extras, logprobs = _sampling(app, body, chat)
    _unsupported(body, "echo", (False,))
    _unsupported(body, "best_of", (1,))
    _unsupported(body, "suffix", ("",))
    _unsupported(body, "tools", ([],))
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        raise ApiError(400, "response_format: only text is supported", "unsupported_parameter", "response_format")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
    if stop is not None and (not all(isinstance(s, str) and s for s in stops) or len(stops) > 4):
        raise ApiError(400, "stop: expected a string or up to 4 non-empty strings", "invalid_value", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream: expected true or false", "invalid_value", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise ApiError(400, "stream_options: expected an object", "invalid_value", "stream_options")
    try:
        params = GenerationParams(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
            top_k=int(_integer(body, "top_k", 0) or 0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-9, 10.0),
            seed=_integer(body, "seed", 0),
            stop=stops,
            logprobs=logprobs is not None,
            top_logprobs=logprobs or 0,
            **extras,
        )
    except AnyquantError as exc:
        raise ApiError(400, str(exc), "invalid_value") from None
    asked = _integer(body, "max_completion_tokens", 1) if chat else None
    asked = asked if asked is not None else _integer(body, "max_tokens", 1)
    ids = _prompt_ids(app, body, chat)
    context = app.adapter.context
    if context is not None and len(ids) > context:
        raise ApiError(
            400,
            f"This model's maximum context length is {context} tokens; the prompt is {len(ids)} tokens",
            "context_length_exceeded",
            "messages" if chat else "prompt",
        )
    room = context + 1 - len(ids) if context is not None else None  # as generate: a full prompt still gets one
    if asked is None:
        if room is None:
            raise ApiError(400, "max_tokens is required: this model's context length is unknown", "invalid_value")
        asked = room
    max_tokens = min(asked, room) if room is not None else asked
    return _Job(ids, params, max_tokens, stream, bool(options.get("include_usage")), logprobs is not None)


def _sampling(app: _Server, body: Mapping[str, Any], chat: bool) -> tuple[dict[str, Any], int | None]:
    """The sampling and log-probability parameters beyond the basic ones: ``GenerationParams`` keywords for the
    non-neutral ones, and how many alternatives to report per token (``None``: no log-probabilities). Chat takes
    ``logprobs: true`` with ``top_logprobs: k``, completions ``logprobs: k`` (OpenAI's two shapes); k in [0, 20]."""
    extras: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, 0.0, -2.0, 2.0)
        if value:
            extras[name] = value
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    if min_p >= 1:
        raise ApiError(400, f"min_p={min_p!r}: expected a number in [0, 1)", "invalid_value", "min_p")
    if min_p:
        extras["min_p"] = min_p
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise ApiError(400, "logit_bias: expected an object of token ids to numbers", "invalid_value", "logit_bias")
        vocab = app.adapter.vocab_size()
        table: dict[int, float] = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < vocab):
                raise ApiError(
                    400, f"logit_bias: {key!r} is not a token id in [0, {vocab})", "invalid_value", "logit_bias"
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ApiError(
                    400,
                    f"logit_bias[{key!r}]={value!r}: expected a number in [-100, 100]",
                    "invalid_value",
                    "logit_bias",
                )
            table[int(key)] = float(value)
        if table:
            extras["logit_bias"] = table
    logprobs: int | None = None
    if chat:
        asked = body.get("logprobs")
        if asked is not None and not isinstance(asked, bool):
            raise ApiError(400, f"logprobs={asked!r}: expected true or false", "invalid_value", "logprobs")
        top = _bounded(body, "top_logprobs", 20)
        if top and not asked:
            raise ApiError(400, "top_logprobs needs logprobs: true", "invalid_value", "top_logprobs")
        logprobs = (top or 0) if asked else None
    else:
        logprobs = _bounded(body, "logprobs", 20)
    unsupported: list[str] = [
        n for n in ("presence_penalty", "frequency_penalty", "min_p", "logit_bias") if n in extras
    ]
    unsupported += ["logprobs"] if logprobs is not None else []
    if unsupported and not getattr(app.scheduler, "full_sampling", False):
        name = unsupported[0]
        raise ApiError(400, f"{name} is not supported by this server's engine", "unsupported_parameter", name)
    return extras, logprobs


def _bounded(body: Mapping[str, Any], name: str, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise ApiError(400, f"{name}={value!r}: expected an integer in [0, {hi}]", "invalid_value", name)
    return value


# ---------------------------------------------------------------------- the app


class _Server:
    def __init__(self, scheduler: Any, config: ServerConfig) -> None:
        self.scheduler = scheduler
        self.adapter = scheduler.adapter
        self.config = config
        self.created = int(time.time())


class _Run:
    """A submitted request seen from the event loop: its text pieces and its end, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[str | TokenLogprob | Finished] = asyncio.Queue()

    def emit(self, text: str) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, text)

    def logprob(self, item: TokenLogprob) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def finish(self, done: Finished) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, done)


def _usage(done: Finished) -> dict[str, int]:
    total = done.prompt_tokens + done.completion_tokens
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens, "total_tokens": total}


def _ended_badly(done: Finished) -> ApiError | None:
    if done.reason == "timeout":
        return ApiError(504, "the request ran past the server's --timeout", "timeout")
    if done.reason == "error":
        detail = str(done.error) if isinstance(done.error, AnyquantError) else type(done.error).__name__
        return ApiError(500, f"generation failed: {detail}", "generation_error")
    return None


def build_app(scheduler: Any, config: ServerConfig) -> Any:
    """The Starlette application (``anyquant[serve]``) over ``scheduler``: a :class:`~.scheduler.Scheduler` or
    another engine's with the same ``submit``, ``adapter``, ``running`` and ``waiting``."""
    from sse_starlette.sse import EventSourceResponse
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    server = _Server(scheduler, config)

    def error(exc: ApiError) -> Response:
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def authorize(request: HttpRequest) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "Incorrect or missing API key (Authorization: Bearer KEY)", "invalid_api_key")

    async def read_json(request: HttpRequest) -> Mapping[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > config.max_body_bytes):
            raise ApiError(413, f"the request body is over {config.max_body_bytes} bytes", "request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise ApiError(413, f"the request body is over {config.max_body_bytes} bytes", "request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON", "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_json")
        return body

    async def health(request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "running": scheduler.running, "waiting": scheduler.waiting})

    async def models(request: HttpRequest) -> Response:
        try:
            authorize(request)
        except ApiError as exc:
            return error(exc)
        card = {"id": config.model_name, "object": "model", "created": server.created, "owned_by": "anyquant"}
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(request: HttpRequest, chat: bool) -> Response:
        try:
            authorize(request)
            body = await read_json(request)
            job = _job(server, body, chat)
            run = _Run(asyncio.get_running_loop())
            deadline = time.monotonic() + config.timeout
            work = Request(job.ids, job.params, job.max_tokens, run.emit, run.finish, deadline)
            if job.logprobs:
                work.logprob = run.logprob
            try:
                scheduler.submit(work)
            except QueueFull as exc:
                raise ApiError(503, str(exc), "queue_full") from None
        except ApiError as exc:
            return error(exc)
        except Exception:  # never a traceback to the client
            log.exception("bad request")
            return error(ApiError(500, "internal error", "internal_error"))
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": ident, "created": int(time.time()), "model": config.model_name}
        if job.stream:
            return EventSourceResponse(
                _sse(run, work, head, chat, job.include_usage, job.logprobs),
                ping=15,
                shutdown_event=None,
                shutdown_grace_period=config.timeout,
            )
        answer: Response = await _whole(request, run, work, head, chat, error, job.logprobs)
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
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed, 500: internal})


def _chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat shape: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**entry(lp.text, lp.logprob), "top_logprobs": [entry(text, value) for _, text, value in lp.top]}
        for lp in items
    ]
    return {"content": content, "refusal": None}


def _legacy_logprobs(items: Sequence[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
    """The completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``: each token's
    character offset in the answer from ``offset``) and the offset after the last token."""
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(lp.text)
    shape = {
        "tokens": [lp.text for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{text: value for _, text, value in lp.top} for lp in items],
        "text_offset": offsets,
    }
    return shape, offset


async def _whole(
    request: Any, run: _Run, work: Request, head: dict[str, Any], chat: bool, error: Any, logprobs: bool
) -> Any:
    """A non-streamed answer: wait for the end (cancelling the work if the client goes away)."""
    from starlette.responses import JSONResponse

    pieces: list[str] = []
    lps: list[TokenLogprob] = []
    try:
        while True:
            try:
                item = await asyncio.wait_for(run.queue.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    work.cancel()
                continue
            if isinstance(item, Finished):
                break
            if isinstance(item, TokenLogprob):
                lps.append(item)
            else:
                pieces.append(item)
    finally:
        work.cancel()  # a no-op once finished; stops the work when this handler is cancelled
    bad = _ended_badly(item)
    if bad is not None:
        return error(bad)
    text = "".join(pieces)
    reason = "length" if item.reason == "length" else "stop"
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice, obj = {"index": 0, "text": text}, "text_completion"
    shape = None if not logprobs else _chat_logprobs(lps) if chat else _legacy_logprobs(lps, 0)[0]
    choice.update(finish_reason=reason, logprobs=shape)
    return JSONResponse({**head, "object": obj, "choices": [choice], "usage": _usage(item)})


async def _sse(
    run: _Run, work: Request, head: dict[str, Any], chat: bool, include_usage: bool, logprobs: bool
) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    pending: list[TokenLogprob] = []  # the tokens since the last chunk: they go out with the next one
    offset = 0

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return json.dumps({**head, "object": obj, "choices": choices, **extra}, ensure_ascii=False)

    def piece(text: str | None, reason: str | None, first: bool = False) -> dict[str, Any]:
        nonlocal offset
        shape = None
        if logprobs and not first:
            shape = _chat_logprobs(pending) if chat else None
            if not chat:
                shape, offset = _legacy_logprobs(pending, offset)
            pending.clear()
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": shape}
        return {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": shape}

    try:
        if chat:
            yield chunk([piece("", None, first=True)])
        while True:
            item = await run.queue.get()
            if isinstance(item, Finished):
                break
            if isinstance(item, TokenLogprob):
                pending.append(item)
                continue
            yield chunk([piece(item, None)])
        bad = _ended_badly(item)
        if bad is not None:
            yield json.dumps(bad.body())
        else:
            yield chunk([piece(None if chat else "", "length" if item.reason == "length" else "stop")])
            if include_usage:
                yield chunk([], usage=_usage(item))
        yield "[DONE]"
    finally:
        work.cancel()  # the client went away (or the stream ended): the scheduler drops it at its next step
