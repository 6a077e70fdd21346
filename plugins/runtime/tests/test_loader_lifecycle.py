"""The order of :class:`anyquant.TransformersLoader`'s steps, as a third-party loader sees them: ``plan``
(the backend) first, ``prepare`` once before the build's hooks, ``finish`` after the model is made, and one
load's state on its context, never on the loader."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from anyquant import Probe, Registry, TransformersLoader
from anyquant.protocols import Detection, LoadOptions
from anyquant.testing.tiny import make_tiny_dense
from anyquant_runtime.loaded import LoadedModel
from anyquant_runtime.loaders import LoadContext, LoadPlan


class Recording(TransformersLoader):
    """A third party's loader that records each step (and keeps every linear dense)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def plan(self, probe: Probe, detection: Detection, options: LoadOptions, device: Any) -> LoadPlan:
        self.calls.append("plan")
        plan = super().plan(probe, detection, options, device)
        plan.state["facts"] = "read once"
        return plan

    def choose_backend(self, requested: str, device: Any) -> str:
        self.calls.append("choose_backend")
        return super().choose_backend(requested, device)

    def tokenizer(self, probe: Probe, options: LoadOptions) -> Any:
        self.calls.append("tokenizer")
        return super().tokenizer(probe, options)

    def prepare(self, ctx: LoadContext) -> None:
        assert ctx.state == {"facts": "read once"}
        self.calls.append("prepare")
        ctx.state["prepared"] = True

    def _asked(self, hook: str, ctx: LoadContext) -> None:
        assert ctx.state.get("prepared"), f"{hook} asked before prepare"
        self.calls.append(hook)

    def make_linear(self, ctx: LoadContext) -> Callable[[str, Any], Any] | None:
        self._asked("make_linear", ctx)
        return None

    def runtime(self, ctx: LoadContext) -> str:
        self._asked("runtime", ctx)
        return super().runtime(ctx)

    def keep_embedding_dtype(self, ctx: LoadContext) -> bool:
        self._asked("keep_embedding_dtype", ctx)
        return False

    def file_tables(self, ctx: LoadContext) -> bool:
        self._asked("file_tables", ctx)
        return False

    def finish(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        self.calls.append("finish")
        loaded.info = {**loaded.info, "state": dict(ctx.state)}
        return super().finish(loaded, ctx)


def test_steps_run_in_order_with_the_state_on_the_context(tmp_path: Path) -> None:
    root = make_tiny_dense(tmp_path / "m")
    probe = Probe.open(root)
    detection = Registry(entry_points=False).detect(probe)
    loader = Recording()
    for _ in range(2):  # a second load starts from a fresh state
        loader.calls.clear()
        loaded = loader.load(probe, detection, LoadOptions(device="cpu"))
        assert loader.calls == [
            "plan",
            "choose_backend",
            "tokenizer",
            "prepare",
            "make_linear",
            "runtime",
            "keep_embedding_dtype",
            "file_tables",
            "finish",
        ]
        assert loaded.backend == "reference"
        assert loaded.info["state"] == {"facts": "read once", "prepared": True}
    assert vars(loader) == {"calls": loader.calls}  # nothing of a load was kept on the loader


class Minimal(TransformersLoader):
    """A loader written before ``plan``/``prepare``/``finish``: its two-argument ``choose_backend`` still decides."""

    def __init__(self) -> None:
        self.chosen: list[str] = []

    def choose_backend(self, requested: str, device: Any) -> str:
        self.chosen.append(requested)
        return "reference"


def test_a_loader_without_the_new_steps_loads_as_before(tmp_path: Path) -> None:
    root = make_tiny_dense(tmp_path / "m")
    probe = Probe.open(root)
    loader = Minimal()
    loaded = loader.load(probe, Registry(entry_points=False).detect(probe), LoadOptions(device="cpu"))
    assert loader.chosen == ["auto"] and loaded.backend == "reference"
    assert loaded.generate("a", max_new_tokens=2)


def test_the_build_hands_freed_heap_pages_back_every_few_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build returns the heap's freed pages (its reads and repacking temporaries) every ``TRIM_LAYERS`` decoder
    layers, so a large model's load does not pile them up under its peak: a model with twice the layers asks for it
    once more."""
    import anyquant._memory
    from anyquant_runtime.build import TRIM_LAYERS

    calls: list[int] = []
    real = anyquant._memory.release_free_heap
    monkeypatch.setattr(anyquant._memory, "release_free_heap", lambda: calls.append(1) or real())

    def trims(layers: int) -> int:
        calls.clear()
        anyquant.load(make_tiny_dense(tmp_path / f"l{layers}", num_hidden_layers=layers), backend="reference")
        return len(calls)

    assert trims(2 * TRIM_LAYERS) - trims(TRIM_LAYERS) == 1
