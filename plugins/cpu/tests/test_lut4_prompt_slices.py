"""The prompt path of :class:`~anyquant_cpu.kernels.lut.Lut4Linear` / ``E4M3Linear`` forms its exact weight a slice
of output rows at a time into one buffer (issue #40, memory): its output is bit for bit the whole weight's GEMM (what
it computed before), in float32 and bfloat16, for row counts that are not a multiple of the slice, and no slice (the
largest temporary) goes past its budget; the kernel's ``*_dequant_out`` write ``*_dequant(...).to(dtype)`` bit for
bit."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from anyquant_cpu import kernels
from anyquant_cpu.kernels import lut
from anyquant_cpu.kernels.lut import SLICE_ROWS, E4M3Linear, Lut4Linear, prompt_slices

NF4 = torch.tensor(
    [-1.0, -0.696, -0.525, -0.395, -0.284, -0.185, -0.091, 0.0, 0.0796, 0.161, 0.246, 0.338, 0.441, 0.563, 0.723, 1.0]
)


def _lut4(n: int, k: int, round_to: torch.dtype, seed: int, **kwargs: Any) -> Lut4Linear:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // 64, generator=g) * 0.1 + 0.01
    return Lut4Linear(codes, scales, NF4, group=64, round_to=round_to, **kwargs)


def _e4m3(n: int, k: int, round_to: torch.dtype, seed: int, **kwargs: Any) -> E4M3Linear:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (n, k), generator=g).to(torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0  # no NaN
    scales = torch.rand(n, k // 64, generator=g) * 0.01 + 0.001
    return E4M3Linear(bits.view(torch.float8_e4m3fn), scales, group=64, round_to=round_to, **kwargs)


def _whole(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The prompt path as it was: the whole exact weight, one GEMM in the prefill dtype."""
    dtype = layer.prefill_dtype or x.dtype
    x2 = x.reshape(-1, layer.in_features)
    return torch.mm(x2.to(dtype), layer.exact_weight(dtype).t()).to(x.dtype).reshape(*x.shape[:-1], -1)


class _Recorder:
    """Wraps a layer's ``dequantize_rows_into``: the rows of each slice it forms and its buffer's bytes (one buffer:
    every slice a view of the same storage); ``exact_weight`` and the float32 ``*_dequant`` ops refused (the kernel
    path writes into the buffer; :meth:`fallback` allows ``dequantize_rows``, the path without the kernel)."""

    def __init__(self, layer: Any, monkeypatch: pytest.MonkeyPatch, fallback: bool = False) -> None:
        self.slices: list[tuple[int, int]] = []
        self.bytes: list[int] = []
        self.storages: set[int] = set()
        inner = layer.dequantize_rows_into

        def into(r0: int, r1: int, out: torch.Tensor) -> None:
            self.slices.append((r0, r1))
            self.bytes.append(out.untyped_storage().nbytes())
            self.storages.add(out.untyped_storage().data_ptr())
            inner(r0, r1, out)

        def refused(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise AssertionError("the prompt path formed a weight outside its buffer")

        monkeypatch.setattr(layer, "dequantize_rows_into", into)
        monkeypatch.setattr(layer, "exact_weight", refused)
        if not fallback:
            monkeypatch.setattr(layer, "dequantize_rows", refused)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 128, 1000, 901, 963, 5632, 32001])
@pytest.mark.parametrize("k", [32, 2048, 5632])
def test_slices_cover_the_rows_none_narrow(n: int, k: int) -> None:
    budget = 256 * 1024
    got = prompt_slices(n, k, budget)
    rows = max(SLICE_ROWS, budget // (4 * k) // SLICE_ROWS * SLICE_ROWS)
    assert got[0][0] == 0 and got[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
    if n <= rows:
        assert got == [(0, n)]
        return
    assert all(r1 - r0 == rows for r0, r1 in got[:-1])
    assert SLICE_ROWS <= got[-1][1] - got[-1][0] < rows + SLICE_ROWS


@pytest.mark.skipif(not kernels.lut_available(), reason="lut4_gemv not built")
@pytest.mark.parametrize("make", [_lut4, _e4m3], ids=["lut4", "e4m3"])
@pytest.mark.parametrize("round_to", [torch.bfloat16, torch.float32], ids=["bf16-weights", "f32-weights"])
@pytest.mark.parametrize(
    ("x_dtype", "prefill"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)],
    ids=["f32", "bf16", "f32-in-bf16-prefill"],
)
@pytest.mark.parametrize(
    ("n", "m"),
    [(1024, 65), (1000, 200), (901, 513), (963, 77)],
    ids=["whole-slices", "tail-104", "tail-5-joins", "tail-67"],
)
def test_sliced_prompt_is_the_whole_weight_gemm_bitwise(
    make: Any,
    round_to: torch.dtype,
    x_dtype: torch.dtype,
    prefill: torch.dtype | None,
    n: int,
    m: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    k = 256
    layer = make(n, k, round_to, seed=n + m, prefill_dtype=prefill)
    size = (prefill or x_dtype).itemsize
    layer.prompt_slice_bytes = 128 * size * k  # slices of 128 rows
    x = torch.randn(1, m, k, generator=torch.Generator().manual_seed(m)).to(x_dtype)
    want = _whole(layer, x)
    record = _Recorder(layer, monkeypatch)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == want.dtype == x_dtype and got.shape == (1, m, n)
    assert torch.equal(got, want)
    assert record.slices == prompt_slices(n, k, layer.prompt_slice_bytes, size) and len(record.slices) > 1
    assert len(record.storages) == 1  # one buffer
    last = record.slices[-1][1] - record.slices[-1][0]
    assert max(record.bytes) == max(128, last) * k * size < n * k * size  # never the whole weight


@pytest.mark.skipif(not kernels.lut_available(), reason="lut4_gemv not built")
@pytest.mark.parametrize(
    ("n", "k", "dtype"),
    [
        (5632, 2048, torch.bfloat16),
        (2048, 5632, torch.bfloat16),
        (2048, 5632, torch.float32),
        (5640, 2048, torch.float32),
    ],
    ids=["gate-bf16", "down-bf16", "down-f32", "odd-rows-f32"],
)
def test_model_sized_layers_default_budget(n: int, k: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1.1B model's MLP shapes with the default budget: bit for bit, and the largest temporary about
    ``PROMPT_SLICE_BYTES`` (the whole float32 weight is 46 MB)."""
    layer = _lut4(n, k, torch.bfloat16, seed=k)
    x = torch.randn(97, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = _whole(layer, x)
    record = _Recorder(layer, monkeypatch)
    with torch.inference_mode():
        got = layer(x)
    assert torch.equal(got, want)
    assert len(record.slices) > 1 and max(record.bytes) <= lut.PROMPT_SLICE_BYTES + SLICE_ROWS * k * dtype.itemsize
    assert max(record.bytes) * 2 <= n * k * dtype.itemsize  # the float32 + bfloat16 copies were 3x the bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_prompt_without_the_compiled_dequant(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch decode (no compiled ``lut4_dequant``) slices the same rows: the same output bit for bit."""
    layer = _lut4(905, 128, torch.bfloat16, seed=5)
    layer.prompt_slice_bytes = 128 * dtype.itemsize * 128
    x = torch.randn(70, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = _whole(layer, x)
    monkeypatch.setattr(lut, "_dequant_op", lambda: False)
    monkeypatch.setattr(lut, "_dequant_out_op", lambda: False)
    record = _Recorder(layer, monkeypatch, fallback=True)
    assert torch.equal(layer(x), want)
    assert record.slices[-1] == (768, 905) and max(record.bytes) < 905 * 128 * dtype.itemsize


@pytest.mark.skipif(not kernels.lut_available(), reason="lut4_gemv not built")
def test_one_slice_and_autograd() -> None:
    """A weight within one slice: one slice, the same values; an input autograd records takes the whole-weight GEMM
    (``out=`` records no gradient): the same values, and a gradient."""
    layer = _lut4(300, 64, torch.float32, seed=3, bias=torch.randn(300))
    assert prompt_slices(300, 64) == [(0, 300)]
    x = torch.randn(80, 64, requires_grad=True)
    want = _whole(layer, x.detach()) + layer.bias
    layer.prompt_slice_bytes = 64 * 4 * 64
    y = layer(x)
    y.sum().backward()
    assert x.grad is not None and torch.equal(y.detach(), want)
    with torch.no_grad():
        assert torch.equal(layer(x), want)
    layer.prompt_slice_bytes = lut.PROMPT_SLICE_BYTES
    with torch.no_grad():
        assert torch.equal(layer(x), want)


@pytest.mark.skipif(not lut._dequant_out_op(), reason="lut4_dequant_out not built")
@pytest.mark.parametrize("group", [16, 32, 64, 512])
def test_dequant_out_ops_are_the_dequant_ops_converted(group: int) -> None:
    """``lut4_dequant_out`` / ``fp8_dequant_out`` write ``lut4_dequant(...).to(round dtype).to(out dtype)`` bit for
    bit (every rounding into every output dtype: conversions to nearest even, subnormal and overflowing weights, signed
    zeros), into rows of one buffer; wrong buffers refused."""
    g = torch.Generator().manual_seed(group)
    n, k = 37, 1024
    codes = torch.randint(0, 256, (n, k // 2), generator=g).to(torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * torch.logspace(-40, 3, k // group).clamp(min=1e-45)
    scales[0, 0], scales[-1, -1] = 0.0, -0.0
    table = torch.randn(16, generator=g)
    table[3], table[4], table[5] = 0.0, -0.0, 3 * 65504.0
    bits = torch.randint(0, 256, (n, k), generator=g).to(torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0
    for rnd, rdt in ((0, torch.float32), (1, torch.bfloat16), (2, torch.float16)):
        lut4 = torch.ops.anyquant.lut4_dequant(codes, scales, table, group, rnd)
        fp8 = torch.ops.anyquant.fp8_dequant(bits, scales, group, rnd)
        for odt in (torch.float32, torch.bfloat16, torch.float16):
            buf = torch.full((n + 5, k), 7.0, dtype=odt)
            torch.ops.anyquant.lut4_dequant_out(codes[3:], scales[3:], table, group, rnd, buf[: n - 3])
            assert torch.equal(buf[: n - 3], lut4[3:].to(rdt).to(odt)), (rnd, odt, "lut4")
            assert bool((buf[n - 3 :] == 7.0).all())  # nothing past the rows asked for
            torch.ops.anyquant.fp8_dequant_out(bits, scales, group, rnd, buf[:n])
            assert torch.equal(buf[:n], fp8.to(rdt).to(odt)), (rnd, odt, "fp8")
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.anyquant.lut4_dequant_out(codes, scales, table, group, 0, torch.empty(n, k + 32))
    with pytest.raises(RuntimeError, match="out is float32"):
        torch.ops.anyquant.lut4_dequant_out(codes, scales, table, group, 0, torch.empty(n, k, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.anyquant.fp8_dequant_out(bits, scales, group, 0, torch.empty(k, n).t())
