"""Helpers shared by the tests: the decode path one token at a time, and relative error."""

from __future__ import annotations

from typing import Any

import torch


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float32."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def stepwise_logits(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits computed one token at a time through the KV cache (the decode path, 1 row per linear)."""
    from anyquant_runtime.generate import _cache_keyword

    kw = _cache_keyword(module)
    out = module(ids[:, :1], use_cache=True)
    steps = [out.logits]
    for i in range(1, ids.shape[1]):
        out = module(ids[:, i : i + 1], use_cache=True, **{kw: getattr(out, kw)})
        steps.append(out.logits)
    return torch.cat(steps, dim=1)


def logits_after_prompt(model: Any, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """The logits of ``ids[:, prompt:]`` fed one token at a time through a native model's cache (``model``: a
    :class:`~anyquant.LoadedModel`) after the prompt ``ids[:, :prompt]`` in one forward."""
    with torch.no_grad():
        out = model.module(ids[:, :prompt], use_cache=True)
        logits = []
        for i in range(prompt, ids.shape[1]):
            out = model.module(ids[:, i : i + 1], use_cache=True, cache=out.cache)
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


def assert_step_is_module_path(model: Any, vocab: int, kind: str = "mixed_layer") -> None:
    """A native cpu-fast ``model``'s compiled decode step plans every layer (as ``kind``'s function) and gives its
    module path's logits bit for bit over 20 decode steps of a batch of two after a 40-token prompt."""
    from anyquant_cpu.step import DecodeStep

    ids = torch.randint(0, vocab, (2, 60), generator=torch.Generator().manual_seed(7))
    model.module.__dict__.pop("_step", None)  # planned afresh on the first decode step
    fast = logits_after_prompt(model, ids, 40)
    step = model.module.__dict__["_step"]
    assert isinstance(step, DecodeStep) and None not in step.layers
    assert {getattr(function, "name", getattr(function, "__name__", "")) for function, _ in step.layers} == {kind}
    model.module.__dict__["_step"] = None  # the module path
    slow = logits_after_prompt(model, ids, 40)
    del model.module.__dict__["_step"]
    assert torch.equal(fast, slow)


def random_int4_linears(layers: Any, seed: int = 5) -> None:
    """Every linear of ``layers`` with 32 or more outputs replaced by a cpu-fast int4 linear of random codes, zeros and
    scales (its bias kept); skips the test where torch's int4 CPU kernel does not run."""
    import pytest

    from anyquant_cpu.engine import FastInt4Linear, int4pack_status

    status = int4pack_status()
    if not status.available:
        pytest.skip(f"no int4 CPU kernel here: {status.reason}")
    gen = torch.Generator().manual_seed(seed)
    for layer in layers:
        for name, lin in list(layer.named_modules()):
            if not isinstance(lin, torch.nn.Linear) or lin.out_features < 32:
                continue
            k, n = lin.in_features, lin.out_features
            codes = torch.randint(0, 16, (k, n), generator=gen)
            zeros = torch.randint(0, 16, (k // 32, n), generator=gen)
            scales = (torch.rand(k // 32, n, generator=gen) * 0.02).half()
            b = None if lin.bias is None else lin.bias.detach().clone()
            parent, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(parent), leaf, FastInt4Linear(codes, zeros, scales, bias=b))


#: where each GGML type's float16 scales sit in its block (random bytes elsewhere are valid codes and int8 scales)
GGML_HALVES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
}


def random_ggml_blocks(type_name: str, rows: int, dim: int, seed: int) -> torch.Tensor:
    """Flat uint8 GGML blocks of ``type_name`` (:data:`GGML_HALVES`) for a ``[rows, dim]`` weight: random codes and
    sub-block scales, float16 scales in 2**-10 .. 2**-6 (no NaN, no inf)."""
    from anyquant_cpu import kernels

    _, size, weights = kernels.GGML_TYPES[type_name]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, dim // weights, size), generator=g, dtype=torch.uint8)
    for at in GGML_HALVES[type_name]:
        half = (torch.rand(rows, dim // weights, generator=g) * 0.015 + 0.001).to(torch.float16)
        blocks[..., at : at + 2] = half.view(torch.uint8).reshape(rows, dim // weights, 2)
    return blocks.reshape(-1)
