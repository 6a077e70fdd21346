"""The optional compiled GGUF-block GEMV (anyquant_cpu.kernels): exact against an integer
reference, and close to the dequantized weight (dequantized by the gguf package, a peer) times x.

Skipped where the kernel is not built (anyquant-cpu installed without it; ``make test`` requires it)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from anyquant_cpu import kernels

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason="anyquant kernels not built")

TYPES = ["Q4_0", "Q4_1", "Q8_0"]
ISAS = [i for i in range(len(kernels.ISA_NAMES)) if i <= max(kernels.isa(), 0)]


def _blocks(type_name: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random weights quantized to GGUF blocks by the gguf package: (uint8 blocks, dequantized float32)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2.0, (rows, 1))).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = quants.quantize(w, qtype)
    return torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1), quants.dequantize(raw, qtype)


def _quantize_x(x: torch.Tensor, passes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> codes [M, K/32, 32] (int64) and their scales [M, K/32], as the op documents."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)
    if passes == 1:
        return q.to(torch.int64), d.squeeze(-1)
    low = torch.round((blocks - q * d) * inv * 256).clamp(-127, 127)
    return q.to(torch.int64) * 256 + low.to(torch.int64), d.squeeze(-1) / 256


def experts_reference(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    experts: int,
    linear: Callable[[torch.Tensor, int, int], torch.Tensor],
    inter: int,
) -> torch.Tensor:
    """``ggml_experts``' arithmetic from its linears (``linear(x, i, rows)``: expert ``i // 3``'s gate, up, down): per
    row, ``0 + w * down(silu(gate x) * up x)`` over its chosen experts in ascending order, an index past ``experts``
    skipped."""
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        out = torch.zeros(1, x.shape[1])
        for pos, e in sorted(enumerate(index[t].tolist()), key=lambda item: item[1]):
            if e < experts:
                row = x[t : t + 1]
                m = torch.nn.functional.silu(linear(row, 3 * e, inter)) * linear(row, 3 * e + 1, inter)
                out = out + linear(m, 3 * e + 2, x.shape[1]) * weights[t, pos]
        want[t] = out[0]
    return want


def check_experts(
    make_blocks: Callable[..., tuple[torch.Tensor, object]],
    forms: list[tuple[str, str, bool]],
    hidden: int,
    inter: int,
    index: torch.Tensor,
    isa: int,
    passes: int,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[int]]:
    """``ggml_experts`` gives bit for bit :func:`experts_reference` of the module path's ``ggml_gemv`` calls: experts
    ``forms`` (each its gate / up type, its down type, whether interleaved) of ``make_blocks(type_name, rows, cols,
    seed=...)[0]``, on ``index.shape[0]`` rows of ``hidden`` activations. Returns (x, weights, blocks, types)."""
    blocks: list[torch.Tensor] = []
    types: list[int] = []
    for e, (gate_up, down, il) in enumerate(forms):
        for j, (type_name, rows, cols) in enumerate(
            [(gate_up, inter, hidden), (gate_up, inter, hidden), (down, hidden, inter)]
        ):
            raw = make_blocks(type_name, rows, cols, seed=10 * e + j)[0]
            code = kernels.GGML_TYPES[type_name][0]
            blocks.append(kernels.interleave(raw, type_name, rows, cols) if il else raw)  # type: ignore[arg-type]
            types.append(code + kernels.INTERLEAVED if il else code)

    def linear(x: torch.Tensor, i: int, rows: int) -> torch.Tensor:
        return torch.ops.anyquant.ggml_gemv(x, blocks[i], types[i], rows, x.shape[-1], isa, passes)

    gen = torch.Generator().manual_seed(passes)
    x = torch.randn(index.shape[0], hidden, generator=gen)
    weights = torch.rand(*index.shape, generator=gen)
    got = torch.ops.anyquant.ggml_experts(x, index, weights, blocks, types, inter, isa, passes)
    assert torch.equal(got, experts_reference(x, index, weights, len(forms), linear, inter))
    return x, weights, blocks, types


def _integer_reference(
    type_name: str, raw: torch.Tensor, x: torch.Tensor, rows: int, cols: int, passes: int = 2
) -> torch.Tensor:
    """Integer block sums in int64 from the raw bytes, then the scales in float64."""
    size = kernels.GGML_TYPES[type_name][1]
    blk = raw.reshape(rows, cols // 32, size)
    d = blk[..., :2].contiguous().view(torch.float16).squeeze(-1).double()  # [N, B]
    xq, dx = _quantize_x(x.float(), passes)  # [M, B, 32], [M, B]
    if type_name == "Q8_0":
        wq = blk[..., 2:].contiguous().view(torch.int8).to(torch.int64)
    else:
        qs = blk[..., size - 16 :].to(torch.int64)
        wq = torch.cat([qs & 15, qs >> 4], -1)  # low nibbles are elements 0..15, high ones 16..31
    dot = torch.einsum("nbj,mbj->mnb", wq, xq)  # exact int64 per block
    sx = xq.sum(-1)  # [M, B]
    if type_name == "Q4_0":
        dot = dot - 8 * sx.unsqueeze(1)
    y = (d.unsqueeze(0) * dx.double().unsqueeze(1) * dot.double()).sum(-1)
    if type_name == "Q4_1":
        m = blk[..., 2:4].contiguous().view(torch.float16).squeeze(-1).double()
        y = y + (m.unsqueeze(0) * (dx.double() * sx.double()).unsqueeze(1)).sum(-1)
    return y


@pytest.mark.parametrize("isa", ISAS, ids=[kernels.ISA_NAMES[i] for i in ISAS])
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8, 13])  # the vector paths take 8 (AVX512-VL) or 4 rows a pass
@pytest.mark.parametrize("cols", [320, 352])  # an even and an odd number of blocks per row
@pytest.mark.parametrize("passes", [1, 2])
def test_exact_against_integer_reference(type_name: str, isa: int, m: int, cols: int, passes: int) -> None:
    rows = 91 + m  # groups of 8 rows and a last partial group of 0 to 7 (the vector paths take 8 at a time)
    raw, _ = _blocks(type_name, rows, cols, seed=m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0  # an all-zero block: scale 0
    x[-1, 40] = 1e3  # one large element: every other element of its block rounds to small codes
    got = kernels.gemv(x, raw, type_name, rows, cols, isa, passes)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (m, rows)
    want = _integer_reference(type_name, raw, x, rows, cols, passes)
    # float32 accumulation of exact integer block sums: rounding only
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))


@pytest.mark.parametrize("isa", ISAS, ids=[kernels.ISA_NAMES[i] for i in ISAS])
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("interleave", [False, True])
def test_each_row_is_what_it_is_alone(type_name: str, isa: int, interleave: bool) -> None:
    """Activation rows multiplied together (8 a pass, then 4, then the rest) give bit for bit what each gives alone:
    what keeps a server's batched step each request's own numbers."""
    rows, cols, m = 40, 320, 13
    raw, _ = _blocks(type_name, rows, cols, seed=3)
    code = kernels.GGML_TYPES[type_name][0]
    blocks = torch.ops.anyquant.ggml_interleave(raw, code, rows, cols, True) if interleave else raw
    code += 1000 if interleave else 0
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(5))
    together = torch.ops.anyquant.ggml_gemv(x, blocks, code, rows, cols, isa, 2)
    alone = torch.cat([torch.ops.anyquant.ggml_gemv(x[i : i + 1], blocks, code, rows, cols, isa, 2) for i in range(m)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize(("passes", "bound"), [(1, 1e-2), (2, 1e-4)])
def test_close_to_dequantized_weight(type_name: str, passes: int, bound: float) -> None:
    rows, cols = 64, 2048
    raw, w = _blocks(type_name, rows, cols, seed=7)
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(1))
    got = kernels.gemv(x, raw, type_name, rows, cols, -1, passes)
    want = x.double() @ torch.from_numpy(w).double().T
    err = float((got.double() - want).abs().max() / want.abs().max())
    # the activations' rounding (half a step of max|x|/127 per element in one pass, /256 of that in two),
    # not the weights'
    assert err < bound, err
    assert err > bound / 1000  # the activations really are quantized (a float path would be ~1e-7)


def test_bf16_input_and_batch_shape() -> None:
    rows, cols = 32, 64
    raw, _ = _blocks("Q4_0", rows, cols, seed=3)
    x = torch.randn(2, 1, cols).to(torch.bfloat16)
    got = kernels.gemv(x, raw, "Q4_0", rows, cols)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and got.shape == (2, 1, rows)
    want = _integer_reference("Q4_0", raw, x.reshape(2, cols), rows, cols)
    assert torch.allclose(got.reshape(2, rows).double(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


def test_bad_input_is_refused() -> None:
    raw, _ = _blocks("Q4_0", 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="blocks hold"):
        kernels.gemv(torch.randn(1, 64), raw[:-1], "Q4_0", 4, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.gemv(torch.randn(1, 48), raw, "Q4_0", 4, 48)
    with pytest.raises(RuntimeError, match="block type 10 is not"):  # Q2_K: not a type of the kernel
        torch.ops.anyquant.ggml_gemv(torch.randn(1, 64), raw, 10, 4, 64)


@pytest.mark.parametrize("isa", ISAS, ids=[kernels.ISA_NAMES[i] for i in ISAS])
@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("passes", [1, 2])
def test_cat_is_each_weight_side_by_side(isa: int, m: int, passes: int) -> None:
    """ggml_gemv_cat (the decode step's q/k/v and gate/up) gives bitwise each weight's ggml_gemv, for weights of
    different types and row counts (partial groups of 8 included) split over threads together."""
    cols = 320
    parts = [("Q4_0", 40), ("Q8_0", 13), ("Q4_1", 64), ("Q4_0", 5)]
    blocks = [_blocks(t, rows, cols, seed=i)[0] for i, (t, rows) in enumerate(parts)]
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    got = kernels.gemv_cat(x, [(b, t, r) for b, (t, r) in zip(blocks, parts, strict=True)], isa, passes)
    want = torch.cat([kernels.gemv(x, b, t, r, cols, isa, passes) for b, (t, r) in zip(blocks, parts, strict=True)], 1)
    assert got.shape == (m, sum(r for _, r in parts)) and torch.equal(got, want)
    ref = torch.cat([_integer_reference(t, b, x, r, cols, passes) for b, (t, r) in zip(blocks, parts, strict=True)], 1)
    assert torch.allclose(got.double(), ref, rtol=0, atol=2e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("isa", ISAS, ids=[kernels.ISA_NAMES[i] for i in ISAS])
@pytest.mark.parametrize("type_name", [*TYPES, "GQ4"])
@pytest.mark.parametrize("rows", [8, 45])  # whole groups of 8; and 5 of them with 5 rows left as they are
@pytest.mark.parametrize("cols", [320, 2112])  # one column tile of the form; two (64 blocks and 2)
def test_interleaved_form_gives_bitwise_the_same(isa: int, type_name: str, rows: int, cols: int) -> None:
    """The interleaved form (the kernel reads it with type + INTERLEAVED) gives the blocks back exactly and the
    same output bit for bit, at every M (the 8-row path's 1 to 4 rows at a time) and activation passes, rows wider
    than one of its column tiles included."""
    raw = _blocks("Q4_1" if type_name == "GQ4" else type_name, rows, cols, seed=rows)[0]  # GQ4: 20-byte blocks
    code = kernels.GGML_TYPES[type_name][0]
    il = kernels.interleave(raw, type_name, rows, cols)
    assert il.shape == raw.shape and torch.equal(kernels.interleave(il, type_name, rows, cols, False), raw)
    assert not torch.equal(il, raw)
    for m in (1, 3, 6):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        for passes in (1, 2):
            want = torch.ops.anyquant.ggml_gemv(x, raw, code, rows, cols, isa, passes)
            got = torch.ops.anyquant.ggml_gemv(x, il, code + kernels.INTERLEAVED, rows, cols, isa, passes)
            assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="is not Q4_0"):
        torch.ops.anyquant.ggml_interleave(il, code + kernels.INTERLEAVED, rows, cols)


@pytest.mark.parametrize("type_name", [*TYPES, "GQ4"])
@pytest.mark.parametrize(("heads", "head_rows"), [(1, 16), (4, 64), (2, 128)])
@pytest.mark.parametrize("cols", [320, 2112])
def test_interleave_reads_permuted_q_k_rows(type_name: str, heads: int, head_rows: int, cols: int) -> None:
    """``qk_heads``: the interleaved form of rows stored as llama.cpp's converter permutes a "llama" file's Q/K rows
    (within each head, stored row 2 i + p holds row p head_rows / 2 + i) is bitwise that of the rows un-permuted
    first (what the GGUF loader did before: a copy)."""
    rows = heads * head_rows
    raw = _blocks("Q4_1" if type_name == "GQ4" else type_name, rows, cols, seed=heads)[0]
    stored = raw.reshape(rows, -1)
    unpermuted = stored.reshape(heads, head_rows // 2, 2, -1).transpose(1, 2).reshape(rows, -1).contiguous()
    want = kernels.interleave(unpermuted.reshape(-1), type_name, rows, cols)
    got = kernels.interleave(raw, type_name, rows, cols, True, heads)
    assert torch.equal(got, want)  # type: ignore[arg-type]
    code = kernels.GGML_TYPES[type_name][0]
    with pytest.raises(RuntimeError, match="qk_heads"):
        torch.ops.anyquant.ggml_interleave(raw, code, rows, cols, False, heads)  # the forward direction only
    with pytest.raises(RuntimeError, match="qk_heads"):
        torch.ops.anyquant.ggml_interleave(raw, code, rows, cols, True, rows // 8)  # heads of 8 rows


def test_block_linear_takes_permuted_rows_only_to_interleave() -> None:
    from anyquant_cpu.kernels.linear import BlockLinear

    raw = _blocks("Q4_0", 32, 64, seed=3)[0]
    with pytest.raises(ValueError, match="interleave=True"):
        BlockLinear(raw, "Q4_0", 32, 64, small_rows=4, qk_heads=2)
    stored = raw.reshape(32, -1)
    unpermuted = stored.reshape(2, 8, 2, -1).transpose(1, 2).reshape(-1).contiguous()
    fused = BlockLinear(raw, "Q4_0", 32, 64, small_rows=4, interleave=True, qk_heads=2)
    plain = BlockLinear(unpermuted, "Q4_0", 32, 64, small_rows=4, interleave=True)
    assert torch.equal(fused.blocks, plain.blocks) and torch.equal(fused.raw_blocks(), unpermuted)


@pytest.mark.parametrize("isa", ISAS, ids=[kernels.ISA_NAMES[i] for i in ISAS])
@pytest.mark.parametrize("passes", [1, 2])
def test_experts_is_each_chosen_expert_in_order(isa: int, passes: int) -> None:
    """ggml_experts (a MoE layer's chosen experts, one call) gives bit for bit what the module path computes from
    ggml_gemv calls: per row, its experts in ascending order (ties in top-k order; an index outside the experts
    skipped), ``0 + w * down(silu(gate x) * up x)`` each; experts of different types and forms, several rows."""
    hidden, inter = 320, 96
    forms = [("Q4_0", False), ("Q8_0", True), ("Q4_1", True), ("Q4_0", True)]
    index = torch.tensor([[2, 0], [3, 3], [1, 4]])  # a repeated expert; 4: not one of the 4 (skipped)
    experts = [(type_name, type_name, il) for type_name, il in forms]
    x, weights, blocks, types = check_experts(_blocks, experts, hidden, inter, index, isa, passes)
    with pytest.raises(RuntimeError, match="gate, up and down"):
        torch.ops.anyquant.ggml_experts(x, index, weights, blocks[:4], types[:4], inter, isa, passes)
    with pytest.raises(RuntimeError, match="blocks hold"):
        torch.ops.anyquant.ggml_experts(x, index, weights, blocks, types, inter + 32, isa, passes)


def test_cat_refuses_bad_parts() -> None:
    raw, _ = _blocks("Q4_0", 8, 64, seed=0)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="one each"):
        torch.ops.anyquant.ggml_gemv_cat(x, [raw], [2, 2], [8])
    with pytest.raises(RuntimeError, match="blocks hold"):
        torch.ops.anyquant.ggml_gemv_cat(x, [raw, raw[:-1]], [2, 2], [8, 8])
    with pytest.raises(RuntimeError, match="block type 10 is not"):  # Q2_K
        torch.ops.anyquant.ggml_gemv_cat(x, [raw], [10], [8])


def test_scripted_call() -> None:
    """TorchScript (the decode step) can call the op."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.anyquant.ggml_gemv(x, w, 2, 4, 64)

    raw, _ = _blocks("Q4_0", 4, 64, seed=0)
    x = torch.randn(1, 64)
    assert torch.equal(torch.jit.script(f)(x, raw), f(x, raw))


# ------------------------------------------------------------------ GQ4: GPTQ / AWQ int4 repacked at load


def _gq4(rows: int, cols: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random group-quantized int4 weight as cpu-fast's FastInt4Linear holds a GPTQ / AWQ layer, and as the GQ4
    blocks made from it: (blocks, the reference's exact weight round_to(float16, s (q - z)), s (q - z) in float64)."""
    from anyquant_cpu.engine import FastInt4Linear
    from anyquant_cpu.kernels.linear import GroupInt4BlockLinear

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (cols, rows), generator=gen)
    zeros = torch.randint(0, 16, (cols // group, rows), generator=gen)
    scales = (torch.rand(cols // group, rows, generator=gen) * 0.02 + 1e-3).half()
    fast = FastInt4Linear(codes, zeros, scales)
    block = GroupInt4BlockLinear.from_fast(fast)
    product = (codes.double() - zeros.double().repeat_interleave(group, 0)) * scales.double().repeat_interleave(
        group, 0
    )
    return block.raw_blocks(), fast.dequantize(), product.t()


@pytest.mark.parametrize("isa", ISAS, ids=[kernels.ISA_NAMES[i] for i in ISAS])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("passes", [1, 2])
def test_gq4_exact_against_integer_reference(isa: int, group: int, m: int, passes: int) -> None:
    rows, cols = 77, 384 if group != 32 else 352  # odd rows; 11 blocks per row: the 512-bit path's odd tail
    raw, _, _ = _gq4(rows, cols, group, seed=m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0
    got = kernels.gemv(x, raw, "GQ4", rows, cols, isa, passes)
    assert isinstance(got, torch.Tensor) and got.shape == (m, rows)
    blk = raw.reshape(rows, cols // 32, 20)
    d = blk[..., 0:2].contiguous().view(torch.float16).squeeze(-1).double()
    z = blk[..., 2:4].contiguous().view(torch.float16).squeeze(-1).double()
    qs = blk[..., 4:].to(torch.int64)
    wq = torch.cat([qs & 15, qs >> 4], -1)
    xq, dx = _quantize_x(x, passes)
    dot = torch.einsum("nbj,mbj->mnb", wq, xq).double() - z.unsqueeze(0) * xq.sum(-1).double().unsqueeze(1)
    want = (d.unsqueeze(0) * dx.double().unsqueeze(1) * dot).sum(-1)
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))


@pytest.mark.parametrize("isa", ISAS, ids=[kernels.ISA_NAMES[i] for i in ISAS])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize(("passes", "bound"), [(1, 1e-2), (2, 1e-4)])
def test_gq4_close_to_the_dequantized_weight(isa: int, group: int, passes: int, bound: float) -> None:
    """Against s (q - z) (what the blocks hold) within the activations' rounding, and against the reference's
    float16 weight within that plus its rounding (a relative 2**-11 per weight at most: ~4e-4 here)."""
    rows, cols = 93, 2048
    raw, exact, product = _gq4(rows, cols, group, seed=group)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(1))
    got = kernels.gemv(x, raw, "GQ4", rows, cols, isa, passes)
    assert isinstance(got, torch.Tensor)
    want = x.double() @ product.T
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert bound / 1000 < err < bound, err
    ref = x.double() @ exact.double().T
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < bound + 1e-3


def test_gq4_linear_paths_and_refusals() -> None:
    """GroupInt4BlockLinear: few rows on the kernel, many rows on the exact weight; the exact weight is
    FastInt4Linear's; act-order and scales float16 cannot hold are refused (they stay on torch's kernel)."""
    from anyquant_cpu.engine import FastInt4Linear
    from anyquant_cpu.kernels.linear import GroupInt4BlockLinear

    gen = torch.Generator().manual_seed(3)
    k, n = 256, 64
    codes = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // 64, n), generator=gen)
    scales = (torch.rand(k // 64, n, generator=gen) * 0.02 + 1e-3).half()
    bias = torch.randn(n, generator=gen)
    fast = FastInt4Linear(codes, zeros, scales, bias=bias, small_rows=4)
    block = GroupInt4BlockLinear.from_fast(fast)
    assert torch.equal(block.dequantize(), fast.dequantize()) and block.dequantize().dtype == torch.float16
    with torch.no_grad():
        x = torch.randn(9, k, generator=gen)
        exact = x @ fast.dequantize().float().T + bias
        many = block(x)  # 9 rows > small_rows: the exact weight's float32 GEMM, as FastInt4Linear's
        assert float((many - exact).abs().max() / exact.abs().max()) < 1e-6
        assert float((many - fast(x)).abs().max() / exact.abs().max()) < 1e-6
        few = block(x[:3])
        assert float((few - exact[:3]).abs().max() / exact[:3].abs().max()) < 1e-3
    perm = torch.randperm(k, generator=gen)
    g_idx = (perm // 64).to(torch.int32)  # columns scattered over the groups: act-order
    shuffled = FastInt4Linear(codes, zeros, scales, g_idx)
    assert "act-order" in str(GroupInt4BlockLinear.unsupported_reason(shuffled))
    tiny = FastInt4Linear(codes, zeros, (scales.float() * 1e-6).to(torch.bfloat16))  # under float16's range
    assert "float16" in str(GroupInt4BlockLinear.unsupported_reason(tiny))
    with pytest.raises(ValueError, match="act-order"):
        GroupInt4BlockLinear.from_fast(shuffled)


@pytest.mark.skipif((__import__("os").cpu_count() or 1) < 2, reason="one CPU")
def test_rows_split_over_torchs_threads() -> None:
    """The op runs its rows on torch's intra-op threads (a build without OpenMP ran on one), and each worker reads
    the caller's quantized activations (a per-thread buffer seen from the workers was empty): 1 and 2 threads
    give the same output, the integer reference's."""
    before = torch.get_num_threads()
    rows, cols = 1024, 320  # 64 grains of 16 rows: both threads take some
    raw, _ = _blocks("Q4_0", rows, cols, seed=5)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(6))
    try:
        torch.set_num_threads(2)
        assert kernels.threads() == 2
        two = kernels.gemv(x, raw, "Q4_0", rows, cols)
        torch.set_num_threads(1)
        assert kernels.threads() == 1
        one = kernels.gemv(x, raw, "Q4_0", rows, cols)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    want = _integer_reference("Q4_0", raw, x, rows, cols)
    assert float((two.double() - want).abs().max() / want.abs().max()) < 1e-6


@pytest.mark.parametrize("width", [576, 1024, 64, 17])
def test_rms_norm_against_float64(width: int) -> None:
    """``anyquant::rms_norm`` (cpu-fast's decode-path RMSNorm): each row ``x / sqrt(mean(x^2) + eps) * w`` within
    float32 rounding of a float64 reference, any leading shape and strides; a zero row stays zero; wrong inputs refused."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(width)
    x = torch.randn(3, 2, width, generator=gen) * 4
    x[1, 0] = 0
    w = torch.randn(width, generator=gen)
    got = torch.ops.anyquant.rms_norm(x, w, 1e-6)
    want = F.rms_norm(x.double(), [width], w.double(), 1e-6)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6
    assert torch.equal(got[1, 0], torch.zeros(width))
    strided = x.transpose(0, 1)
    assert torch.equal(torch.ops.anyquant.rms_norm(strided, w, 1e-6), got.transpose(0, 1))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.anyquant.rms_norm(x.double(), w.double(), 1e-6)
    with pytest.raises(RuntimeError, match="last dimension"):
        torch.ops.anyquant.rms_norm(x, w[1:], 1e-6)


def test_rms_norm_module_takes_the_kernel_up_to_its_rows() -> None:
    """The native RMSNorm with ``kernel_rows`` (cpu-fast's decode path): the kernel's op up to that many rows,
    torch's exact ``rms_norm`` (transformers' arithmetic) above; 0 (the exact backends): always torch's."""
    import torch.nn.functional as F

    from anyquant_runtime.layers import RMSNorm

    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(1, 9, 96, generator=torch.Generator().manual_seed(2)) * 3
    exact = F.rms_norm(x, [96], norm.weight, 1e-5)
    kernel = torch.ops.anyquant.rms_norm(x, norm.weight, 1e-5)

    def ran_kernel(rows: int) -> bool:
        with torch.profiler.profile() as prof:
            y = norm(x[:, :rows])
        assert torch.equal(y, (kernel if norm.kernel_rows >= rows else exact)[:, :rows])
        return any(event.name == "anyquant::rms_norm" for event in prof.events())

    assert not ran_kernel(1) and not ran_kernel(9)
    norm.kernel_rows = 8
    assert ran_kernel(1) and ran_kernel(8) and not ran_kernel(9)


@pytest.mark.parametrize("type_name", [*TYPES, "GQ4"])
@pytest.mark.parametrize("interleave", [False, True], ids=["stored", "interleaved"])
@pytest.mark.parametrize("cols", [128, 2112])  # one column tile of the interleaved form; two
def test_dequantize_is_the_formats_own_bit_for_bit(type_name: str, interleave: bool, cols: int) -> None:
    """``anyquant::ggml_dequantize`` (the prompt path's weight, one pass over the blocks as held): the gguf package's
    dequantization (a peer) bit for bit for Q4_0/Q4_1/Q8_0, GQ4's the reference's round_to(float16, s (q - z))
    (FastInt4Linear's exact weight), from either form (91 rows: a last group of 3 past the interleaved ones), then
    rounded to bfloat16 or float16 as torch's ``.to()`` rounds."""
    rows = 91
    if type_name == "GQ4":
        raw, exact, _ = _gq4(rows, cols, 64, seed=3)
        want, round_to = exact.float(), torch.float16
    else:
        raw, deq = _blocks(type_name, rows, cols, seed=4)
        want, round_to = torch.from_numpy(deq).reshape(rows, cols), None
    code = kernels.GGML_TYPES[type_name][0]
    if interleave:
        raw = kernels.interleave(raw, type_name, rows, cols)
        code += kernels.INTERLEAVED
    assert isinstance(raw, torch.Tensor)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = torch.ops.anyquant.ggml_dequantize(raw, code, rows, cols, round_to or dtype).to(dtype)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype)), dtype
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.anyquant.ggml_dequantize(raw, code, rows, cols, torch.float64)


@pytest.mark.parametrize("isa", ISAS, ids=[kernels.ISA_NAMES[i] for i in ISAS])
@pytest.mark.parametrize("passes", [1, 2])
def test_q8_0_from_a_formats_own_codes(isa: int, passes: int) -> None:
    """A format's int8 codes (compressed-tensors' symmetric int8 reaches -128) and one float16 scale per block as
    Q8_0 blocks: the kernel gives the integer reference's sums, -128 included (AVX2's sign trick reads it as 128)."""
    from anyquant_cpu.kernels.linear import q8_0_from_codes

    rows, cols = 19, 96
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int64).to(torch.int8)
    codes[:, 0] = -128
    d = (torch.rand(rows, cols // 32, generator=g) * 0.01 + 1e-3).to(torch.float16)
    raw = q8_0_from_codes(codes, d).reshape(-1)
    x = torch.randn(3, cols, generator=g)
    got = kernels.gemv(x, raw, "Q8_0", rows, cols, isa, passes)
    want = _integer_reference("Q8_0", raw, x, rows, cols, passes)
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))
    weight = codes.float() * d.float().repeat_interleave(32, dim=1)
    exact = torch.ops.anyquant.ggml_dequantize(raw, kernels.GGML_TYPES["Q8_0"][0], rows, cols, torch.float32)
    assert torch.equal(exact, weight)


def test_q4_1_from_codes_is_the_gguf_layout() -> None:
    """``q4_1_from_codes`` writes what llama.cpp's Q4_1 means: the gguf package's dequantizer reads ``q d + m``."""
    from anyquant_cpu.kernels.linear import q4_1_from_codes

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (7, 64), generator=g)
    d = torch.rand(7, 2, generator=g).to(torch.float16)
    m = (torch.rand(7, 2, generator=g) - 0.5).to(torch.float16)
    raw = q4_1_from_codes(codes, d, m)
    got = quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_1).reshape(7, 64)
    want = codes.float() * d.float().repeat_interleave(32, 1) + m.float().repeat_interleave(32, 1)
    assert np.array_equal(got, want.numpy())


@pytest.mark.skipif(not kernels.lut_available(), reason="lut4_gemv not built")
@pytest.mark.parametrize(
    "isa",
    [i for i in range(3) if i <= max(kernels.lut_isa(), 0)],
    ids=["scalar", "avx2", "avx512"][: max(kernels.lut_isa(), 0) + 1],
)
@pytest.mark.parametrize("group", [16, 32, 48, 64, 80])
@pytest.mark.parametrize("m", [1, 3, 5])
def test_lut4_gemv_is_the_table_weights_product(isa: int, group: int, m: int) -> None:
    """4-bit codes into a 16-entry table times a scale per group: the float64 product of the same float32 weights,
    to float32 summation rounding, on every path (NF4's table, codes 0..15 everywhere, scales of mixed sizes; groups
    that are not a multiple of 32 too: the vector paths once read the wrong scales there)."""
    from anyquant_cpu.kernels.lut import Lut4Linear, lut4_codes

    g = torch.Generator().manual_seed(group + m)
    n, k = 37, 192 if 192 % group == 0 else 960
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * torch.logspace(-3, 1, k // group)
    lut = torch.tensor(
        [
            -1.0,
            -0.696,
            -0.525,
            -0.395,
            -0.284,
            -0.185,
            -0.091,
            0.0,
            0.0796,
            0.161,
            0.246,
            0.338,
            0.441,
            0.563,
            0.723,
            1.0,
        ]
    )
    x = torch.randn(m, k, generator=g)
    w = lut[codes] * scales.repeat_interleave(group, dim=1)  # float32 weights, as the op forms them
    for rnd, dtype in ((0, torch.float32), (1, torch.bfloat16), (2, torch.float16)):
        got = torch.ops.anyquant.lut4_gemv(x, lut4_codes(codes), scales, lut, group, rnd, isa)
        want = x.double() @ w.to(dtype).double().T  # each weight rounded as asked, then exact sums
        assert torch.allclose(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max())), rnd
    layer = Lut4Linear(codes, scales, lut, group=group, round_to=torch.bfloat16)
    assert torch.equal(layer.dequantize(), w.to(torch.bfloat16))


@pytest.mark.skipif(not kernels.lut_available(), reason="lut4_gemv not built")
@pytest.mark.parametrize(
    "isa",
    [i for i in range(3) if i <= max(kernels.lut_isa(), 0)],
    ids=["scalar", "avx2", "avx512"][: max(kernels.lut_isa(), 0) + 1],
)
def test_lut4_gemv_forms_tiny_and_subnormal_weights_exactly(isa: int) -> None:
    """Each formed weight exactly ``round(table[q] * s)``, read back column by column with one-hot activations (one
    product per sum), for scales whose weights are subnormal in float32 and in bfloat16 (a vector rounding that
    flushes subnormals to zero must not be taken for them), signed zeros and normal scales in the same rows."""
    from anyquant_cpu.kernels.lut import lut4_codes

    g = torch.Generator().manual_seed(3)
    n, k, group = 24, 128, 32
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.tensor([1e-39, 3e-41, 2.5e-38, 0.0, -0.0, 0.7, 1e-30, 4.0]).repeat(n * k // group // 8 + 1)
    scales = scales[torch.randperm(scales.numel(), generator=g)][: n * k // group].reshape(n, k // group)
    lut = torch.linspace(-1.0, 1.0, 16)
    x = torch.eye(k)[:16]
    for rnd, dtype in ((0, torch.float32), (1, torch.bfloat16), (2, torch.float16)):
        w = (lut[codes] * scales.repeat_interleave(group, dim=1)).to(dtype).float()
        got = torch.ops.anyquant.lut4_gemv(x, lut4_codes(codes), scales, lut, group, rnd, isa)
        assert torch.equal(got, w[:, :16].T.contiguous()), rnd


@pytest.mark.skipif(not kernels.lut_available(), reason="lut4_gemv not built")
def test_lut4_gemv_refuses_bad_shapes() -> None:
    x = torch.randn(1, 64)
    codes = torch.zeros(4, 32, dtype=torch.uint8)
    lut = torch.zeros(16)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.anyquant.lut4_gemv(x, codes, torch.zeros(4, 3), lut, 32)
    with pytest.raises(RuntimeError, match="group"):
        torch.ops.anyquant.lut4_gemv(x, codes, torch.zeros(4, 2), lut, 24)
    with pytest.raises(RuntimeError, match="codes"):
        torch.ops.anyquant.lut4_gemv(torch.randn(1, 96), codes, torch.zeros(4, 3), lut, 32)


@pytest.mark.skipif(not kernels.lut_available(), reason="lut4_gemv not built")
@pytest.mark.parametrize("isa", [0, 2] if kernels.lut_isa() == 2 else [0])
@pytest.mark.parametrize("rnd", [0, 1])
def test_fp8_gemv_is_the_e4m3_weights_product(isa: int, rnd: int) -> None:
    """Every E4M3 code but NaN (subnormals, zeros of both signs, 448), scales per group: float64 of the same weights."""
    g = torch.Generator().manual_seed(7 + rnd)
    codes = torch.arange(256, dtype=torch.int64).repeat(40)[: 29 * 320].reshape(29, 320)
    codes = codes[:, torch.randperm(320, generator=g)].to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    scales = torch.rand(29, 320 // 64, generator=g) + 0.05
    x = torch.randn(3, 320, generator=g)
    w = codes.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(64, dim=1)
    got = torch.ops.anyquant.fp8_gemv(x, codes, scales, 64, rnd, isa)
    want = x.double() @ (w.to(torch.bfloat16) if rnd else w).double().T
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.skipif(not kernels.lut_available(), reason="lut4_gemv not built")
@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_exact_weight_ops_are_the_torch_decode(group: int) -> None:
    """``lut4_dequant`` / ``fp8_dequant`` (what a prompt's GEMM multiplies) give the layers' torch decode bit for bit:
    every table and E4M3 code (subnormals, both zeros, 448), every rounding."""
    from anyquant_cpu.kernels import lut

    g = torch.Generator().manual_seed(group)
    n, k = 37, 512
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * torch.logspace(-3, 2, k // group)
    table = torch.randn(16, generator=g)
    fp = torch.arange(256, dtype=torch.int64).repeat(n * k // 256 + 1)[: n * k].reshape(n, k).to(torch.uint8)
    fp[(fp & 0x7F) == 0x7F] = 0
    for dtype, rnd in ((torch.float32, 0), (torch.bfloat16, 1), (torch.float16, 2)):
        layer = lut.Lut4Linear(codes, scales, table, group=group, round_to=dtype)
        q = torch.stack((layer.codes.reshape(n, k // 32, 16) & 0x0F, layer.codes.reshape(n, k // 32, 16) >> 4), dim=2)
        want = (table[q.reshape(n, k).long()] * scales.repeat_interleave(group, dim=1)).to(dtype)
        got = torch.ops.anyquant.lut4_dequant(layer.codes, layer.scales, layer.lut, group, rnd)
        assert got.dtype == torch.float32 and torch.equal(got.to(dtype), want), (dtype, "lut4")
        assert torch.equal(layer.dequantize(), want)
        e4m3 = lut.E4M3Linear(fp.view(torch.float8_e4m3fn), scales, group=group, round_to=dtype)
        want = (fp.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(group, dim=1)).to(dtype)
        got = torch.ops.anyquant.fp8_dequant(fp, scales, group, rnd)
        assert torch.equal(got.to(dtype), want), (dtype, "fp8")
        assert torch.equal(e4m3.dequantize(), want)


@pytest.mark.skipif(not kernels.lut_available(), reason="lut4_gemv not built")
@pytest.mark.parametrize(
    "isa",
    [i for i in range(3) if i <= max(kernels.lut_isa(), 0)],
    ids=["scalar", "avx2", "avx512"][: max(kernels.lut_isa(), 0) + 1],
)
@pytest.mark.parametrize("m", [1, 3, 6])
def test_lut4_gemv_cat_is_each_weight_side_by_side(isa: int, m: int) -> None:
    """lut4_gemv_cat (the decode step's q/k/v and gate/up of a 4-bit table format): bit for bit each weight's
    lut4_gemv, side by side, with each weight's own table, group and row count (tasks of 16 rows crossing weights)."""
    from anyquant_cpu.kernels.lut import lut4_codes

    g = torch.Generator().manual_seed(m)
    k = 192
    shapes = [(37, 16), (8, 64), (21, 32), (16, 192)]  # rows, group
    codes = [lut4_codes(torch.randint(0, 16, (n, k), generator=g)) for n, _ in shapes]
    tables = [
        torch.cat((torch.randn(16, generator=g), torch.rand(n * k // grp, generator=g) + 0.1)) for n, grp in shapes
    ]
    x = torch.randn(m, k, generator=g)
    for rnd in (0, 1, 2):
        want = torch.cat(
            [
                torch.ops.anyquant.lut4_gemv(x, c, t[16:].view(c.shape[0], -1), t[:16], grp, rnd, isa)
                for c, t, (_, grp) in zip(codes, tables, shapes, strict=True)
            ],
            1,
        )
        got = torch.ops.anyquant.lut4_gemv_cat(x, codes, tables, [grp for _, grp in shapes], rnd, isa)
        assert got.shape == (m, sum(n for n, _ in shapes)) and torch.equal(got, want), rnd
