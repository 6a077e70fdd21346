"""The HTTP/1.1 side of ``anyquant serve``: uvicorn with its h11 protocol, plus what an exposed server needs and
uvicorn 0.55 does not have (imports uvicorn and h11; only when a server starts).

- A **header timeout**: a connection has ``header_timeout`` seconds, from when it opens or its previous answer
  ends, to send a request line and headers; then it is closed (with a 408 in OpenAI's error shape when part of a
  request came). uvicorn has ``timeout_keep_alive`` for idle connections between requests, nothing for a request
  whose headers trickle in (slowloris).
- A **connection limit** below the file-descriptor limit: past ``max_connections`` open connections, the one that
  has waited longest for its request's headers (idle or half-sent) is closed to make room; when every connection
  is running a request, the new one is answered 503 (``Retry-After: 1``) and closed. uvicorn's
  ``limit_concurrency`` answers 503 only once a request's headers are complete, so half-sent connections are never
  counted against it, and they held every descriptor (EMFILE) before.
- **OpenAI-shaped errors for what h11 refuses** before the app sees a request (a malformed ``Content-Length``,
  headers over ``--max-header-kb``: 400 and 431 with ``{"error": {...}}`` instead of uvicorn's plain text).
- **Rate-limited error logs**: a message repeated within ``interval`` seconds (asyncio's ``socket.accept() out of
  system resource``, uvicorn's ``Invalid HTTP request received.``) is logged once, then counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "GuardedServer",
    "Limits",
    "RateLimitFilter",
    "connection_budget",
    "error_response",
    "guarded_protocol",
    "uvicorn_config",
]

log = logging.getLogger(__name__)

#: descriptors kept for everything but client connections (model files, logs, the event loop, torch's threads)
FD_RESERVE = 64
#: how many connections asyncio accepts in one turn of its loop (the ``backlog`` it is given)
BACKLOG = 64
#: the kernel's queue of connections waiting to be accepted (uvicorn's default backlog): they hold no descriptor
#: of this process, so the queue is long while each turn accepts only :data:`BACKLOG` of them
LISTEN_QUEUE = 2048
#: turns of the loop a socket is open before its protocol can close it (accepted; the protocol made; connection_made;
#: closed): up to this many backlogs of sockets are open beyond the connections the protocol counts
IN_FLIGHT_TURNS = 4


@dataclass(frozen=True)
class Limits:
    """What one client may hold. ``anyquant serve`` shows these defaults in ``--help``."""

    header_timeout: float = 10.0  # seconds to send a request line and headers
    max_connections: int = 512  # open connections at once (kept below the descriptor limit)
    keep_alive: int = 5  # seconds an idle connection stays open between requests (uvicorn's timeout_keep_alive)
    max_header_bytes: int = 16 * 1024  # request line and headers (h11's max_incomplete_event_size)


def error_response(status: int, message: str, code: str, extra_headers: str = "") -> bytes:
    """A whole HTTP/1.1 response that closes the connection, its body OpenAI's error shape (ASCII JSON)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    reason = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}.get(status, "")
    reason = reason or ("Service Unavailable" if status == 503 else "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"{extra_headers}connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _Connection(h11.Connection):
    """h11's connection, keeping the protocol error it raised (its status hint: 431 for headers too long)."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.error = exc
            raise


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout, a connection limit and OpenAI-shaped protocol errors
    (:func:`guarded_protocol` makes one with its :class:`Limits`)."""

    limits: ClassVar[Limits] = Limits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, self.limits.max_header_bytes)
        self.waiting_since: float | None = None  # when it began waiting for a request's headers; None while one runs
        self.partial = False  # part of the awaited request has arrived
        self.header_timer: asyncio.TimerHandle | None = None

    # a connection opens: within the limit, or make room, or refuse
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) <= self.limits.max_connections:
            self._await_request()
            return
        live = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and not c.transport.is_closing()]
        if len(live) > self.limits.max_connections:
            waiting = [c for c in live if c is not self and c.waiting_since is not None]
            if not waiting:
                log.warning("%d connections, each running a request: a new one was answered 503", len(live) - 1)
                self.transport.write(
                    error_response(
                        503,
                        f"the server holds {self.limits.max_connections} connections (--max-connections), each "
                        "running a request; retry later",
                        "too_many_connections",
                        "retry-after: 1\r\n",
                    )
                )
                self.transport.close()
                return
            oldest = min(waiting, key=lambda c: c.waiting_since or 0.0)
            log.warning(
                "at --max-connections %d: closed the connection that waited longest for its headers", len(live) - 1
            )
            oldest.transport.abort()
        self._await_request()

    def _await_request(self) -> None:
        self._cancel_timer()
        self.waiting_since, self.partial = time.monotonic(), False
        self.header_timer = self.loop.call_later(self.limits.header_timeout, self._header_timeout)

    def _cancel_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timeout(self) -> None:
        self.header_timer = None
        if self.waiting_since is None or self.transport.is_closing():
            return
        asked = self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE  # not discarding a body
        if self.partial and asked:  # an idle connection is closed without a word (a client may be about to reuse it)
            seconds = self.limits.header_timeout
            message = f"the request's headers did not arrive within {seconds:g} s (--header-timeout)"
            self.transport.write(error_response(408, message, "request_timeout"))
        log.info("closed a connection that sent no complete request headers in %g s", self.limits.header_timeout)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.waiting_since is not None:
            self.partial = True
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived: the app has it now
            self._cancel_timer()
            self.waiting_since = None

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._await_request()  # the next request's headers: from now (a pipelined one cancels this at once)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.waiting_since = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """What h11 refuses (uvicorn answers it in plain text): OpenAI's error shape, 431 for headers too long."""
        error = getattr(self.conn, "error", None)
        status = 431 if error is not None and error.error_status_hint == 431 else 400
        if status == 431:
            detail = f"the request line and headers are over {self.limits.max_header_bytes} bytes (--max-header-kb)"
            code = "headers_too_large"
        else:
            detail = "malformed HTTP request" + (f": {str(error)[:200]}" if error is not None else "")
            code = "invalid_http"
        self._cancel_timer()
        self.waiting_since = None
        self.transport.write(error_response(status, detail, code))
        self.transport.close()


def guarded_protocol(limits: Limits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn builds per connection, with these limits."""
    protocol: type[GuardedH11Protocol] = type("AnyquantH11Protocol", (GuardedH11Protocol,), {"limits": limits})
    return protocol


def connection_budget(wanted: int, backlog: int = BACKLOG) -> tuple[int, str | None]:
    """``wanted`` connections, or fewer when the soft descriptor limit (``ulimit -n``) cannot hold them with the
    listen backlog and :data:`FD_RESERVE`; the soft limit is raised towards the hard one first. With a note when
    lowered."""
    try:
        import resource
    except ImportError:  # Windows: no descriptor limit of this kind
        return wanted, None
    extra = IN_FLIGHT_TURNS * backlog + FD_RESERVE + _open_fds()
    need = wanted + extra
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted, None
    fit = max(1, soft - extra)
    note = (
        f"--max-connections {wanted} lowered to {fit}: the descriptor limit (ulimit -n) is {soft}, and sockets "
        f"being accepted or closed ({IN_FLIGHT_TURNS} x the listen backlog of {backlog}) and the process's own "
        "files need the rest"
    )
    return fit, note


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


class RateLimitFilter(logging.Filter):
    """Lets a message (its logger, level and first line of its format) through at most once per ``interval``
    seconds; the next one that passes says how many like it were held back."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval, self.clock = interval, clock
        self.seen: dict[tuple[str, int, str], tuple[float, int]] = {}
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg).split("\n", 1)[0][:200])
        now = self.clock()
        with self.lock:
            last = self.seen.get(key)
            if last is not None and now - last[0] < self.interval:
                self.seen[key] = (last[0], last[1] + 1)
                return False
            held = last[1] if last is not None else 0
            self.seen[key] = (now, 0)
            if len(self.seen) > 1024:  # many distinct messages: forget the oldest half
                for old in sorted(self.seen, key=lambda k: self.seen[k][0])[:512]:
                    del self.seen[old]
        if held:
            record.msg = f"{record.getMessage()} [{held} more like this in {self.interval:g} s not logged]"
            record.args = None
        return True


#: the loggers whose repeated errors are rate-limited (a flood of connections must not become a flood of logs)
RATE_LIMITED = ("asyncio", "uvicorn.error", "anyquant_serve.app", "anyquant_serve.http", "anyquant_serve.scheduler")


class GuardedServer(uvicorn.Server):
    """uvicorn's server, its listening sockets' kernel queue lengthened to :data:`LISTEN_QUEUE` once started:
    asyncio gives one number to both ``listen()`` and how many connections it accepts per turn, and the second must
    stay small (:data:`BACKLOG`) to bound the descriptors a burst of connections opens before they are counted."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                try:
                    with socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno())) as same:
                        same.listen(LISTEN_QUEUE)  # the same listening socket: listen() again sets its queue
                except (OSError, ValueError):  # a platform where a socket cannot be duplicated: the short queue stays
                    log.debug("could not lengthen the listen queue", exc_info=True)


def uvicorn_config(
    app: Any, host: str, port: int, limits: Limits, graceful: float, log_level: str = "info", **extra: Any
) -> Any:
    """uvicorn's Config for ``anyquant serve``: the guarded h11 protocol, the listen backlog it counts with, the
    keep-alive timeout, and rate-limited error logs (filters added once uvicorn has configured its loggers)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(limits),
        backlog=BACKLOG,
        timeout_keep_alive=limits.keep_alive,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_graceful_shutdown=int(graceful),
        log_level=log_level,
        lifespan="off",
        ws="none",  # no WebSocket routes: an upgrade request is an ordinary request
        **extra,
    )
    limiter = RateLimitFilter()
    for name in RATE_LIMITED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(limiter)
    return config
