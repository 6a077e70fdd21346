"""Servers for the serve tests: ``anyquant serve`` as a real process, or its app in a thread (one launcher for all)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(*args: str, timeout: float = 180) -> tuple[subprocess.Popen[bytes], str]:
    """``anyquant serve ARGS --port P`` from this checkout's sources, once ``/health`` answers: the process and its
    base URL. A server that exits first raises with the end of its stderr."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [
            str(ROOT / "core" / "src"),
            *[str(p / "src") for p in sorted((ROOT / "plugins").iterdir())],
            env.get("PYTHONPATH", ""),
        ]
    )
    cmd = [sys.executable, "-m", "anyquant.cli", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-3000:]}")  # type: ignore[union-attr]
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def stop(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """SIGTERM (the server's graceful shutdown), then a kill if it has not exited in ``timeout`` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def serving(*args: str) -> Iterator[str]:
    """:func:`start` for a ``with`` block or a fixture: the base URL, the process stopped after."""
    proc, base = start(*args)
    try:
        yield base
    finally:
        stop(proc)


@contextlib.contextmanager
def in_thread(app: Any, limits: Any = None) -> Iterator[tuple[int, Any]]:
    """``app`` under anyquant serve's uvicorn configuration (``uvicorn_config``, ``GuardedServer``) on a free port in
    a thread: the port and the server; the rate-limit log filters it installs are removed after."""
    from anyquant_serve.http import RATE_LIMITED, GuardedServer, Limits, RateLimitFilter, uvicorn_config

    port = free_port()
    config = uvicorn_config(
        app, "127.0.0.1", port, limits or Limits(), graceful=1, log_level="warning", log_config=None
    )
    server = GuardedServer(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield port, server
    finally:
        server.should_exit = True
        thread.join(10)
        for name in RATE_LIMITED:
            for f in [f for f in logging.getLogger(name).filters if isinstance(f, RateLimitFilter)]:
                logging.getLogger(name).removeFilter(f)


def with_special_tokens(dest: Path, markers: list[str], template: str | None = None) -> Path:
    """A copy of the bundled GGUF whose unused special tokens 3.. are renamed to ``markers`` (control tokens, so a
    plain decode drops them, as in gpt-oss's and DeepSeek's tokenizers), with ``template`` as its chat template when
    given."""
    import pytest

    gguf = pytest.importorskip("gguf")
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    import anyquant

    reader = gguf.GGUFReader(str(anyquant.default_model()))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    tokens = reader.fields[gguf.Keys.Tokenizer.LIST].contents()
    types = reader.fields[gguf.Keys.Tokenizer.TOKEN_TYPE].contents()
    assert all(types[3 + i] == gguf.TokenType.CONTROL for i in range(len(markers)))
    tokens[3 : 3 + len(markers)] = markers
    writer = gguf.GGUFWriter(str(dest), arch=arch, endianess=reader.endianess)
    writer.data_alignment = reader.alignment
    array = gguf.GGUFValueType.ARRAY
    new = {gguf.Keys.Tokenizer.LIST: MetadataDetails(array, tokens, sub_type=gguf.GGUFValueType.STRING)}
    if template is not None:
        new[gguf.Keys.Tokenizer.CHAT_TEMPLATE] = MetadataDetails(gguf.GGUFValueType.STRING, template)
    copy_with_new_metadata(reader, writer, new, [])
    return dest
