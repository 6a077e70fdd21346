"""The experts' prompt path where prompts run bfloat16 GEMMs: an expert with up to ``EXPERT_SMALL_ROWS_16BIT`` tokens
runs the block kernel (two int8 activation passes: within 1e-4 of the exact experts, closer than the bfloat16 GEMM it
replaces), more tokens the exact weights and the GEMM; float32 prompts keep ``EXPERT_SMALL_ROWS``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import anyquant as sdk
from anyquant_cpu.engine import EXPERT_SMALL_ROWS, EXPERT_SMALL_ROWS_16BIT, expert_small_rows
from tests.peers.recorded import rel_error

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAME = "gptoss_mxfp4"
EXPERTS = "model.layers.1.mlp.experts"


def _lut_available() -> bool:
    from anyquant_cpu import kernels

    return kernels.lut_available()


def test_rows_follow_the_prompt_gemm_dtype() -> None:
    assert expert_small_rows(torch.bfloat16, torch.float32) == EXPERT_SMALL_ROWS_16BIT
    assert expert_small_rows(None, torch.bfloat16) == EXPERT_SMALL_ROWS_16BIT
    assert expert_small_rows(torch.float32, torch.bfloat16) == EXPERT_SMALL_ROWS
    assert expert_small_rows(None, torch.float32) == EXPERT_SMALL_ROWS


@pytest.mark.skipif(not _lut_available(), reason="the compiled 4-bit table kernel is not built")
def test_prompt_experts_within_the_kernel_tolerance_of_the_exact_ones() -> None:
    fast_model = sdk.load(FIXTURES / NAME, backend="cpu-fast", cpu_fast_head="dense")
    exact = sdk.load(FIXTURES / NAME, backend="dequantized").module.get_submodule(EXPERTS)
    fast = fast_model.module.get_submodule(EXPERTS)
    prefill = fast_model.info["cpu_fast"]["prefill_dtype"]
    want_rows = EXPERT_SMALL_ROWS_16BIT if prefill in ("bfloat16", "float16") else EXPERT_SMALL_ROWS
    assert {m.small_rows for m in (*fast.gate_up, *fast.down)} == {want_rows}
    # the user's rows win over the default
    mine = sdk.load(FIXTURES / NAME, backend="cpu-fast", cpu_fast_head="dense", cpu_fast_small_rows=2)
    assert {m.small_rows for m in mine.module.get_submodule(EXPERTS).gate_up} == {2}
    torch.manual_seed(0)
    for tokens in (12, 40):  # ~6 and ~20 tokens an expert: the kernel where the GEMM would be bfloat16
        x = torch.randn(tokens, 128)
        idx = torch.randint(0, 4, (tokens, 2))
        w = torch.rand(tokens, 2)
        got, want = fast(x, idx, w), exact(x, idx, w)
        assert rel_error(got, want) <= (1e-4 if want_rows > tokens else 3e-2), tokens


@pytest.mark.skipif(not _lut_available(), reason="the compiled 4-bit table kernel is not built")
def test_long_prompts_hand_the_freed_heap_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of ``TRIM_TOKENS`` tokens trims the C heap after its experts once the process grew ``TRIM_GROWTH``
    since the last trim; shorter calls never do; the outputs are the same either way."""
    import anyquant.plugin
    import anyquant_mxfp4.experts as packed

    fast = sdk.load(FIXTURES / NAME, backend="cpu-fast", cpu_fast_head="dense").module.get_submodule(EXPERTS)
    calls: list[int] = []
    monkeypatch.setattr(anyquant.plugin, "release_free_heap", lambda: calls.append(1) or True)
    torch.manual_seed(0)
    x = torch.randn(packed.TRIM_TOKENS, 128)
    idx, w = torch.randint(0, 4, (packed.TRIM_TOKENS, 2)), torch.rand(packed.TRIM_TOKENS, 2)
    monkeypatch.setattr(packed, "_trimmed_at", [0])
    first = fast(x, idx, w)
    assert calls == [1]
    assert torch.equal(fast(x, idx, w), first) and calls == [1]  # grown less than TRIM_GROWTH since: no trim
    fast(x[:8], idx[:8], w[:8])
    assert calls == [1]
