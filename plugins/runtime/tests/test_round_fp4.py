"""``round_fp4`` (its step grid rounded half to even) against the tie rule written out step by step (compressed-tensors' and vLLM's
``cast_to_fp4``: 0.25, 1.25, 2.5, 5 round down; 0.75, 1.75, 3.5 up), element for element in every float dtype, at
each bound and its neighbours, signs, zeros, infinities and NaN."""

from __future__ import annotations

import pytest
import torch

from anyquant_runtime.activations import round_fp4

#: (value, upper bound, bound included), ascending; above the last bound, 6
STEPS = ((0.0, 0.25, True), (0.5, 0.75, False), (1.0, 1.25, True), (1.5, 1.75, False), (2.0, 2.5, True))
STEPS += ((3.0, 3.5, False), (4.0, 5.0, True))


def written_out(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    out = torch.full_like(a, 6.0)
    for value, bound, included in reversed(STEPS):
        out = torch.where(a <= bound if included else a < bound, torch.full_like(a, value), out)
    return out * torch.sign(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_fp4_is_the_tie_rule(dtype: torch.dtype) -> None:
    bounds = torch.tensor([b for _, b, _ in STEPS], dtype=dtype)
    special = torch.tensor([0.0, -0.0, 6.0, 7.0, float("inf"), -float("inf"), float("nan")], dtype=dtype)
    x = torch.cat(
        [
            (torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 3).to(dtype),
            special,
            *(
                s * t
                for s in (1, -1)
                for t in (bounds, torch.nextafter(bounds, bounds + 1), torch.nextafter(bounds, bounds - 1))
            ),
        ]
    )
    got, want = round_fp4(x), written_out(x)
    assert got.dtype == dtype
    assert torch.equal(got.nan_to_num(99.0), want.nan_to_num(99.0))
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 and the NaNs' signs too
    assert torch.equal(
        round_fp4(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])), torch.tensor([0, 1, 1, 2, 2, 4, 4.0])
    )
