"""cpu-fast's Q8_0 head built a slice at a time (``FastHead._set_q8_0``): the same bytes as quantizing the whole
weight and copying it into the kernel's interleaved form (the two whole copies and the float32 temporaries of 8,192
rows it replaced were the NF4 load's peak), for widths of one and several column tiles and rows past the last whole
group of 8."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def _kernels() -> bool:
    from anyquant_cpu import kernels

    return kernels.available()


@pytest.mark.skipif(not _kernels(), reason="the compiled block kernel is not built")
@pytest.mark.parametrize(
    ("rows", "cols"), [(8 * 37 + 5, 1024), (8 * 20 + 3, 4096), (8 * 19, 2880), (77, 2048), (5, 64)]
)
@pytest.mark.parametrize("interleave", [True, False])
def test_sliced_q8_0_head_is_the_whole_copy(rows: int, cols: int, interleave: bool, monkeypatch: Any) -> None:
    from anyquant_cpu.engine import FastHead
    from anyquant_cpu.kernels import GGML_TYPES, INTERLEAVED
    from anyquant_cpu.kernels.linear import q8_0_blocks

    torch.manual_seed(rows)
    weight = torch.randn(rows, cols, dtype=torch.bfloat16)
    code = GGML_TYPES["Q8_0"][0]
    want = q8_0_blocks(weight).reshape(-1)
    if interleave:
        want = torch.ops.anyquant.ggml_interleave(want, code, rows, cols, True)
    monkeypatch.setattr(FastHead, "Q8_SLICE", 16 * cols)  # slices of 16 rows: several, and a partial last one
    head = FastHead(weight, decode="q8_0", interleave=interleave)
    assert head.ggml_type == code + (INTERLEAVED if interleave else 0)
    assert head.blocks is not None and torch.equal(head.blocks, want)
    x = torch.randn(2, cols)
    assert torch.allclose(
        head(x), x @ weight.float().t(), rtol=0, atol=0.05 * float((x @ weight.float().t()).abs().max())
    )
