"""The prompt path of the block-kernel linears (:class:`~anyquant_cpu.kernels.linear.BlockLinear`: GGUF blocks,
Q8_0 of int8 formats, mlx's Q4_1, MXFP4, GQ4) forms its exact weight a slice of output rows at a time, as
``Lut4Linear``'s does (issue #40, memory: a quantized 49152x2048 head formed 400 MB of float32 per prompt): bit for bit
the whole weight's GEMM, in float32 and bfloat16, interleaved or read in place, for row counts that are not a
multiple of the slice; no slice is the whole weight."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from anyquant_cpu import kernels
from anyquant_cpu.kernels.linear import SLICE_ROWS, prompt_slices
from tests.decoding import random_ggml_blocks

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the compiled block kernel is not built")


def _gguf(type_name: str, n: int, k: int, interleave: bool, seed: int, **kw: Any) -> Any:
    """Random blocks of ``type_name`` (random codes and sub-block scales, float16 scales in 2**-10 .. 2**-6)."""
    from anyquant_cpu.engine import GGUFBlockLinear

    blocks = random_ggml_blocks(type_name, n, k, seed)
    return GGUFBlockLinear(blocks, type_name, n, k, None, interleave=interleave, **kw)


def _affine4(n: int, k: int, interleave: bool, seed: int, **kw: Any) -> Any:
    from anyquant_cpu.engine import Affine4BlockLinear
    from anyquant_cpu.kernels.linear import q4_1_from_codes

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    m = (torch.rand(n, k // 32, generator=g) * -0.1).to(torch.bfloat16)
    blocks = q4_1_from_codes(codes, d.to(torch.float16), m.to(torch.float16))
    return Affine4BlockLinear(blocks, n, k, None, scale_dtype=torch.bfloat16, interleave=interleave, **kw)


def _mxfp4(n: int, k: int, interleave: bool, seed: int, **kw: Any) -> Any:
    from anyquant_cpu.engine import MXFP4BlockLinear

    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 17), generator=g, dtype=torch.uint8)
    blocks[..., 0] = torch.randint(118, 128, (n, k // 32), generator=g, dtype=torch.uint8)  # 2**-9 .. 2**0
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    return MXFP4BlockLinear(
        blocks.reshape(-1), n, k, None, table=table, round_to=torch.bfloat16, interleave=interleave, **kw
    )


def _gq4(n: int, k: int, interleave: bool, seed: int, **kw: Any) -> Any:
    from anyquant_cpu.kernels.linear import GroupInt4BlockLinear, gq4_blocks

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).to(torch.float16)
    zeros = torch.randint(0, 16, (n, k // 32), generator=g).to(torch.float16)
    blocks = gq4_blocks(codes, scales, zeros).reshape(-1)
    return GroupInt4BlockLinear(blocks, n, k, torch.float16, interleave=interleave, **kw)


MAKERS = {
    "Q4_0": lambda n, k, il, seed, **kw: _gguf("Q4_0", n, k, il, seed, **kw),
    "Q4_K": lambda n, k, il, seed, **kw: _gguf("Q4_K", n, k, il, seed, **kw),
    "Q6_K": lambda n, k, il, seed, **kw: _gguf("Q6_K", n, k, il, seed, **kw),
    "Q8_0": lambda n, k, il, seed, **kw: _gguf("Q8_0", n, k, il, seed, **kw),
    "mlx-Q4_1": _affine4,
    "MXFP4": _mxfp4,
    "GQ4": _gq4,
}


def _whole(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The prompt path as it was: the whole exact weight, one GEMM in the prefill dtype."""
    dtype = layer.prefill_dtype or x.dtype
    x2 = x.reshape(-1, layer.in_features)
    return torch.mm(x2.to(dtype), layer.exact_weight(dtype).t()).to(x.dtype).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "in-place"])
@pytest.mark.parametrize(
    ("x_dtype", "prefill"), [(torch.float32, None), (torch.float32, torch.bfloat16)], ids=["f32", "bf16-prefill"]
)
@pytest.mark.parametrize(("n", "m"), [(1000, 80), (963, 77)], ids=["tail-104", "tail-67"])
def test_sliced_prompt_is_the_whole_weight_gemm_bitwise(
    kind: str, interleave: bool, x_dtype: torch.dtype, prefill: torch.dtype | None, n: int, m: int
) -> None:
    k = 256
    layer = MAKERS[kind](n, k, interleave, n + m, small_rows=8, prefill_dtype=prefill)
    size = (prefill or x_dtype).itemsize
    layer.prompt_slice_bytes = 128 * size * k  # slices of 128 rows
    slices = prompt_slices(n, k, layer.prompt_slice_bytes, size)
    assert len(slices) > 1 and min(r1 - r0 for r0, r1 in slices) >= SLICE_ROWS
    formed: list[int] = []
    inner = layer.exact_rows

    def recorded(raw: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        formed.append(rows)
        out: torch.Tensor = inner(raw, rows, dtype)
        return out

    layer.exact_rows = recorded
    x = torch.randn(1, m, k, generator=torch.Generator().manual_seed(m)).to(x_dtype)
    want = _whole(layer, x)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == x_dtype and torch.equal(got, want)
    assert formed == [r1 - r0 for r0, r1 in slices] and max(formed) < n  # never the whole weight at once


@pytest.mark.parametrize("kind", list(MAKERS))
def test_rows_are_the_whole_weights_rows(kind: str) -> None:
    """``exact_rows`` of any row range of the stored blocks is those rows of ``exact_weight``, in each dtype."""
    n, k = 200, 256
    layer = MAKERS[kind](n, k, True, 7, small_rows=8)
    raw = layer.raw_blocks().reshape(-1)
    row_bytes = raw.numel() // n
    for dtype in (torch.float32, torch.bfloat16):
        whole = layer.exact_weight(dtype)
        for r0, r1 in ((0, 64), (64, 200), (8, 72), (199, 200)):
            assert torch.equal(layer.exact_rows(raw[r0 * row_bytes : r1 * row_bytes], r1 - r0, dtype), whole[r0:r1])
