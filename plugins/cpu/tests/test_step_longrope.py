"""Phi-3's LongRoPE and the compiled decode step (:mod:`anyquant_cpu.step`): the step computes no rotary table of
its own, it turns queries and keys by the ``cos``/``sin`` that :meth:`NativeCausalLM.rotary` gives it (LongRoPE's
row by row: short or long factors, scaled by the attention factor). So decode steps that cross the original context
are bitwise the module path's, on Phi-3 itself (whose fused ``qkv_proj``/``gate_up_proj`` layers run through their
modules) and on a layer the step does compile, given LongRoPE's tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant
from anyquant.testing.tiny import make_tiny_dense
from anyquant_runtime.native import LongRope, NativeCausalLM, longrope_inv_freq
from tests.decoding import random_int4_linears

pytestmark = pytest.mark.slow

ORIGINAL = 32
LONGROPE = {
    "max_position_embeddings": 512,
    "original_max_position_embeddings": ORIGINAL,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(16)],
        "long_factor": [1.0 + 0.5 * i for i in range(16)],
    },
}


def _steps(model: anyquant.LoadedModel, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.module(ids[:, :prompt], use_cache=True)
        logits = []
        for i in range(prompt, ids.shape[1]):
            out = model.module(ids[:, i : i + 1], use_cache=True, cache=out.cache)
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


def _both_paths(
    model: anyquant.LoadedModel, ids: torch.Tensor, prompt: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, Any, int]:
    """The decode steps' logits on the compiled step (built afresh) and, checked bitwise equal, on the module path;
    the step; and how many layers ran through their modules on the first (the prompt's included)."""
    from anyquant_runtime import native

    calls, forward = [0], native.DecoderLayer.forward

    def counted(layer: torch.nn.Module, *args: Any) -> torch.Tensor:
        calls[0] += 1
        return forward(layer, *args)

    monkeypatch.setattr(native.DecoderLayer, "forward", counted)
    model.module.__dict__.pop("_step", None)
    fast = _steps(model, ids, prompt)
    step, modules = model.module.__dict__["_step"], calls[0]
    model.module.__dict__["_step"] = None  # the module path
    assert torch.equal(_steps(model, ids, prompt), fast)
    del model.module.__dict__["_step"]
    monkeypatch.undo()
    return fast, step, modules


def test_phi3_longrope_steps_are_the_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3 with LongRoPE on cpu-fast int4 linears: rows at positions short of and past the original context,
    steps crossing it; no layer is the step's (fused projections), the logits are the module path's."""
    model = anyquant.load(make_tiny_dense(tmp_path / "m", model_type="phi3", sliding_window=None, **LONGROPE))
    assert isinstance(model.module, NativeCausalLM) and model.module.config.longrope is not None
    random_int4_linears(model.module.model.layers)
    ids = torch.randint(0, 200, (2, 44), generator=torch.Generator().manual_seed(3))
    _, step, modules = _both_paths(model, ids, 20, monkeypatch)
    assert step is None and modules == 2 * 25  # Phi-3's layers: the module path (the prompt, 24 steps)


@pytest.mark.parametrize("rows", [1, 3])
def test_compiled_layers_take_the_models_longrope_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """A Llama whose layers the step compiles, given LongRoPE's tables (its ``longrope`` and long inverse frequencies
    set as a Phi-3 config would set them): decode steps from a 20-token prompt across position 32 bitwise the module
    path's, and not the default rotary's (the step did use the model's tables)."""
    from anyquant_cpu.step import DecodeStep

    model = anyquant.load(make_tiny_dense(tmp_path / "m"), runtime="native")
    random_int4_linears(model.module.model.layers)
    ids = torch.randint(0, 200, (rows, 44), generator=torch.Generator().manual_seed(4))
    plain, _, _ = _both_paths(model, ids, 20, monkeypatch)
    module = model.module
    config = module.config
    factors = LONGROPE["rope_parameters"]
    assert isinstance(factors, dict)
    config.longrope = LongRope(tuple(factors["short_factor"]), tuple(factors["long_factor"]), ORIGINAL, 1.3)
    module.inv_freq = longrope_inv_freq(config, config.longrope.short_factor)
    module.long_inv_freq = longrope_inv_freq(config, config.longrope.long_factor)
    fast, step, modules = _both_paths(model, ids, 20, monkeypatch)
    assert isinstance(step, DecodeStep) and None not in step.layers and modules == 2  # the prompt's layers only
    assert not torch.equal(fast, plain)
