"""``anyquant serve``: an OpenAI-compatible HTTP server for a checkpoint (built in), or the hand-off to vLLM or
exllamav3 (``--engine``). The entry point of the anyquant-serve distribution: the command registers through the
``anyquant_register_commands`` hook, as core's built-in commands do."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from anyquant.plugin import (
    CommandRegistrar,
    MissingDependencyError,
    ParameterError,
    add_load_flags,
    add_option_flag,
    hookimpl,
    options_from,
)

from .scheduler import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB, DEFAULT_SCORE_CHUNK

__all__ = ["anyquant_register_commands", "build_parser_for_tests"]

log = logging.getLogger(__name__)

INSTALL = "pip install anyquant-serve"  # its dependencies are the HTTP stack


@hookimpl
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    cli.add_command("serve", "serve a checkpoint over an OpenAI-compatible HTTP API", _configure, _run)


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", default=None, help="checkpoint (default: the bundled SmolLM2 model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $ANYQUANT_API_KEY)")
    p.add_argument("--model-name", default=None, help="the model id clients ask for (default: the file/folder name)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the running batch (then 503)")
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take, queueing included")
    p.add_argument("--max-body-kb", type=int, default=1024, help="largest request body accepted")
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="memory for recent prompts' KV caches, which a prompt beginning the same way reuses in whole "
        f"--prefill-chunk chunks, least recently used dropped first; 0: off (default {DEFAULT_PREFIX_CACHE_MB:g})",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        help="prompt positions per prefill forward and the most prefilled between two decode steps of the running "
        f"requests; 0: each prompt in one forward (default {DEFAULT_PREFILL_CHUNK}; 512: generate's forwards, bitwise)",
    )
    p.add_argument(
        "--score-chunk",
        type=int,
        default=DEFAULT_SCORE_CHUNK,
        help="prompt positions per scoring forward (echo with logprobs): at most this many x the vocabulary of "
        f"logits held at once (default {DEFAULT_SCORE_CHUNK}: generate's forwards, bitwise its scores)",
    )
    # what one client may hold (a slow or idle client must not hold the server): docs/serving.md, "Exposing"
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection has to send its request line and headers, from opening or its previous "
        "answer; then it is closed (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request's body may take to arrive after its headers; then 408 (default 30)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=512,
        help="open connections at most, kept below the file-descriptor limit; past it the one waiting longest "
        "for its headers is closed, or the new one answered 503 (default 512)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=int,
        default=5,
        help="seconds an idle connection stays open between requests (default 5)",
    )
    p.add_argument(
        "--max-header-kb", type=int, default=16, help="largest request line and headers; more is a 431 (default 16)"
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="render chats with this Jinja template file instead of the checkpoint's (e.g. one that describes "
        "tools to a model whose own template does not; at most 1 MiB; --engine vllm: passed as vLLM's "
        "--chat-template) (default: the checkpoint's)",
    )
    p.add_argument(
        "--reasoning-format",
        choices=("auto", "none"),
        default="auto",
        help="a thinking model's <think> block: auto (default) returns it as message.reasoning_content, none leaves "
        "it in content (gpt-oss's harmony channels are always split)",
    )
    p.add_argument(
        "--engine",
        choices=("anyquant", "vllm", "exllamav3"),
        default="anyquant",
        help="anyquant's own server (default) or a peer engine's",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm: GPUs per model replica")
    p.add_argument("--max-model-len", type=int, default=None, help="vllm/exllamav3: context (default: the model's)")
    p.add_argument("--tokenizer", default=None, help="vllm, GGUF: the base model's tokenizer (folder or id)")
    p.add_argument("--print-command", action="store_true", help="vllm: print the engine command, do not run it")
    add_load_flags(p)
    p.add_argument("--format", default=None, help="assert this format (error if the tensors disagree)")
    add_option_flag(p, "a load option of the format's loader", "-o cpu_fast_tables=memory")


def build_parser_for_tests() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="anyquant serve")
    _configure(p)
    return p


def _run(args: argparse.Namespace) -> int:
    from anyquant import default_model

    path = str(args.path or default_model())
    api_key = args.api_key or os.environ.get("ANYQUANT_API_KEY") or None
    name = args.model_name or _default_name(path)
    if args.engine != "anyquant":
        given = [f for f, v in (("--backend", args.backend), ("--device", args.device)) if v != "auto"]
        given += ["-o"] if args.option else []
        given += ["--chat-template"] if args.chat_template and args.engine != "vllm" else []
        if given:
            raise ParameterError(f"--engine {args.engine} does not take {', '.join(given)} (the built-in server's)")
    if args.engine == "vllm":
        return _run_vllm(args, path, name, api_key)
    if args.print_command:
        raise ParameterError("--print-command prints an engine's command: use it with --engine vllm")
    for flag, value in (("--max-queue", args.max_queue), ("--max-batch", args.max_batch - 1), ("--port", args.port)):
        if value < 0:
            raise ParameterError(f"{flag}: expected a positive number")
    if args.timeout <= 0 or args.max_body_kb <= 0:
        raise ParameterError("--timeout and --max-body-kb must be positive")
    if args.prefill_chunk < 0 or not 0 <= args.prefix_cache_mb < float("inf"):  # NaN too
        raise ParameterError("--prefill-chunk and --prefix-cache-mb: expected 0 or more (a finite number of MB)")
    if args.score_chunk < 1:
        raise ParameterError(f"--score-chunk {args.score_chunk}: expected 1 or more")
    _need_http_stack()
    limits = _limits(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use it", args.host)
    scheduler: Any
    if args.engine == "exllamav3":
        from anyquant import detect

        from .exl3 import Exl3Scheduler

        fmt = detect(path).format
        if fmt != "exl3":
            raise ParameterError(f"--engine exllamav3 serves EXL3 checkpoints; {path} is {fmt}")
        scheduler = Exl3Scheduler(path, max_batch=args.max_batch, max_queue=args.max_queue, context=args.max_model_len)
    else:
        from anyquant import load

        from .scheduler import ModelAdapter, Scheduler

        flags = {"backend": "--backend", "device": "--device", "dtype": "--dtype", "format": "--format"}
        options = options_from(args.option, {**flags, "registry": "the Python API"})
        print(f"anyquant serve: loading {path} ...", file=sys.stderr, flush=True)
        template = _chat_template_file(args.chat_template)
        model = load(path, format=args.format, backend=args.backend, device=args.device, dtype=args.dtype, **options)
        adapter = ModelAdapter(model)
        if template is not None:
            adapter.use_chat_template(template)
        scheduler = Scheduler(
            adapter,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            prefill_chunk=args.prefill_chunk,
            prefix_cache_mb=args.prefix_cache_mb,
            score_chunk=args.score_chunk,
        )
    from .app import ServerConfig, build_app

    config = ServerConfig(
        name,
        api_key,
        args.timeout,
        args.max_body_kb * 1024,
        args.body_timeout,
        reasoning=args.reasoning_format == "auto",
    )
    return _serve(build_app(scheduler, config), scheduler, args.host, args.port, args.timeout, limits, name)


#: the largest ``--chat-template`` file read (real templates are 2-20 KB)
CHAT_TEMPLATE_MAX_BYTES = 1 << 20


def _chat_template_file(path: str | None) -> str | None:
    """``--chat-template``'s text (read before the model loads, so a bad path fails at once), or ``None``."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(CHAT_TEMPLATE_MAX_BYTES + 1)
    except OSError as exc:
        raise ParameterError(f"--chat-template {path}: {exc.strerror or exc}") from None
    if len(data) > CHAT_TEMPLATE_MAX_BYTES:
        raise ParameterError(f"--chat-template {path}: larger than {CHAT_TEMPLATE_MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ParameterError(f"--chat-template {path}: not UTF-8 text") from None
    if not text.strip():
        raise ParameterError(f"--chat-template {path}: the file is empty")
    return text


def _default_name(path: str) -> str:
    """The model name clients send by default: a Hub id's ``owner/name`` (never its revision: ``@refs/pr/1`` is not
    a name), else the folder's or file's name."""
    from anyquant.plugin import parse_model_id

    mid = None if Path(path).exists() else parse_model_id(path)
    return mid.repo_id if mid is not None else Path(path).name


def _limits(args: argparse.Namespace) -> Any:
    """The per-client limits of the built-in server (:class:`~anyquant_serve.http.Limits`), checked."""
    for flag, value in (
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
        ("--max-connections", args.max_connections),
        ("--keep-alive-timeout", args.keep_alive_timeout),
        ("--max-header-kb", args.max_header_kb),
    ):
        if not value > 0:  # NaN too
            raise ParameterError(f"{flag}: expected a positive number, got {value}")
    from .http import Limits

    return Limits(args.header_timeout, args.max_connections, args.keep_alive_timeout, args.max_header_kb * 1024)


def _serve(
    app: Any, scheduler: Any, host: str, port: int, timeout: float, limits: Any = None, name: str | None = None
) -> int:
    from .http import GuardedServer, Limits, connection_budget, uvicorn_config

    limits = limits or Limits()
    fit, note = connection_budget(limits.max_connections)
    if note is not None:
        log.warning("%s", note)
        limits = replace(limits, max_connections=fit)
    # SIGTERM / Ctrl-C: uvicorn stops accepting, lets in-flight requests finish (up to --timeout), then exits
    config = uvicorn_config(app, host, port, limits, graceful=int(timeout) + 5)
    server = GuardedServer(config)
    model = f", model {name!r} (what clients send as `model`)" if name else ""
    print(f"anyquant serve: http://{host}:{port}/v1{model} (Ctrl-C or SIGTERM to stop)", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        scheduler.close(timeout)
    return 0


def _need_http_stack() -> None:
    import importlib.util

    missing = [m for m in ("starlette", "uvicorn", "sse_starlette", "pydantic") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingDependencyError(f"anyquant serve needs {', '.join(missing).replace('_', '-')}: {INSTALL}")


def _run_vllm(args: argparse.Namespace, path: str, name: str, api_key: str | None) -> int:
    from .detected import vllm_command

    plan = vllm_command(
        path,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        host=args.host,
        port=args.port,
        api_key=api_key,
        served_model_name=name,
        chat_template=args.chat_template,
    )
    for note in plan.notes:
        print(f"note: {note}", file=sys.stderr)
    shown = plan.command() if api_key is None else plan.command().replace(shlex.quote(api_key), "***")
    if args.print_command:
        print(shown)
        return 0
    import shutil

    exe = shutil.which("vllm")
    if exe is None:
        raise MissingDependencyError(
            "vllm is not installed (it needs a CUDA machine: pip install vllm); "
            f"the command would be:\n  {shown}\n(--print-command prints it without running)"
        )
    print(f"$ {shown}", file=sys.stderr, flush=True)
    os.execv(exe, plan.argv())
    return 0  # not reached
