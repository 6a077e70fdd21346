"""The model's public calls end the calling thread's OpenMP worker pool when they return (anyquant._openmp): a second
thread's parallel regions then run with no more OpenMP threads than asked for. Checked by the process's live threads
(a pool's workers are threads of their own), against the same calls with the release turned off."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant
from anyquant import _openmp
from anyquant.errors import CheckpointError
from anyquant.testing.tiny import make_tiny_dense

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task (Linux)")


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _new_threads(call: Callable[[], Any]) -> int:
    """How many threads ``call`` leaves alive when run on a fresh thread that stays alive (with 2 OpenMP threads)."""
    done, finish, box = threading.Event(), threading.Event(), []

    def run() -> None:
        torch.set_num_threads(2)
        before = _tasks()
        call()
        box.append(len(_tasks() - before))
        done.set()
        finish.wait(30)  # alive while counted: a thread's pool ends with it

    t = threading.Thread(target=run)
    t.start()
    assert done.wait(120)
    finish.set()
    t.join()
    return int(box[0])


@pytest.fixture
def two_threads() -> Any:
    if _openmp._find_pause() is None:
        pytest.skip("no libgomp with omp_pause_resource_all in this process")
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_release_ends_the_calling_threads_pool(two_threads: None) -> None:
    x = torch.randn(1 << 20)
    assert _new_threads(lambda: torch.exp(x)) == 1  # the pool's one worker (the test can fail)
    assert _new_threads(lambda: (torch.exp(x), _openmp.release_thread_pool())) == 0
    with _openmp.pool_released():
        pass  # no pool: nothing to end, no error
    assert _new_threads(lambda: list(_openmp.released_after(torch.exp(x) for _ in range(2)))) == 0


def test_load_and_each_model_call_leave_no_pool(
    two_threads: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    make_tiny_dense(tmp_path / "m")
    box: list[Any] = []
    assert _new_threads(lambda: box.append(anyquant.load(tmp_path / "m", device="cpu"))) == 0
    model = box[0]
    model.generate("hi", max_new_tokens=2)  # lazy threads of the first call (if any) are made now
    calls: dict[str, Callable[[], Any]] = {
        "generate": lambda: model.generate("hello there", max_new_tokens=3),
        "generate_batch": lambda: model.generate_batch(["a b", "c"], max_new_tokens=2),
        "stream": lambda: list(model.stream("hello", max_new_tokens=3)),
        "stream closed early": lambda: next(iter(model.stream("hello", max_new_tokens=5))),
        "complete": lambda: model.complete("hello", max_new_tokens=3),
        "loglikelihood": lambda: model.loglikelihood([("hello", " there")]),
        "loglikelihood_rolling": lambda: model.loglikelihood_rolling(["hello there"]),
    }
    for name, call in calls.items():
        assert _new_threads(call) == 0, name
    monkeypatch.setattr(_openmp, "_find_pause", lambda: None)  # the release off: the same call keeps its pool
    assert _new_threads(calls["generate"]) == 1
    model.close()


def test_a_failed_load_still_releases(two_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(1 << 20)

    def failing(path: str, **kwargs: object) -> object:
        torch.exp(x)
        raise CheckpointError("bad: not a checkpoint")

    monkeypatch.setattr(anyquant.api, "_load", failing)

    def call() -> None:
        with pytest.raises(CheckpointError, match="not a checkpoint"):
            anyquant.load("bad", device="cpu")

    assert _new_threads(call) == 0
