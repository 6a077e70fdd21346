"""load() for the CPU runs on a thread of its own that ends with it: the calling thread keeps no OpenMP pool of
torch's, which made a second thread's parallel regions (an async call's worker, a server's scheduler) sleep between
regions (docs/quickstart.md)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import anyquant
from anyquant import api
from anyquant.errors import CheckpointError
from anyquant.testing.tiny import make_tiny_dense


def test_a_cpu_load_runs_on_a_thread_that_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    seen: list[threading.Thread] = []
    real = api.get_loader

    def get_loader(*args: object, **kwargs: object) -> object:
        seen.append(threading.current_thread())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(api, "get_loader", get_loader)
    make_tiny_dense(tmp_path / "m")
    model = anyquant.load(tmp_path / "m", device="cpu")
    assert len(seen) == 1 and seen[0] is not threading.current_thread() and not seen[0].is_alive()
    assert model.generate("hi", max_new_tokens=2) is not None  # a working model, used from this thread
    model.close()


def test_its_errors_and_arguments_reach_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict[str, object], threading.Thread]] = []

    def fake(path: str, **kwargs: object) -> object:
        calls.append((path, kwargs, threading.current_thread()))
        if path == "bad":
            raise CheckpointError("bad: not a checkpoint")
        return "loaded"

    monkeypatch.setattr(api, "_load", fake)
    assert anyquant.load("x", device="cpu", dtype="bfloat16", cpu_fast_tables="memory") == "loaded"
    path, kwargs, thread = calls[-1]
    assert path == "x"
    assert thread is not threading.current_thread()
    assert kwargs["dtype"] == "bfloat16" and kwargs["cpu_fast_tables"] == "memory" and kwargs["check"] is False
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        anyquant.load("bad", device="cpu")
    # a GPU load stays on the calling thread: CUDA's current device is that thread's
    anyquant.load("x", device="cuda:1")
    assert calls[-1][2] is threading.current_thread()
