"""The compiled GGUF-block GEMV on the K-quants' super-blocks (Q4_K, Q5_K, Q6_K: 256 weights each, read as llama.cpp
stores them): against the exact dequantized weight (the gguf package's dequantizer, a peer; bitwise the GGUF
plugin's) in float64, on every vector path this host has and the portable scalar one, in both forms (as stored and
interleaved), beside the other block types in one call, and in the MoE op.

Random super-blocks: random bytes (every 6-bit scale and min, every int8 Q6_K scale, every code) with finite
float16 d / dmin. The GGUF files llama.cpp quantized are in ``plugins/gguf/tests/test_gguf_kquant_kernel.py``.

Skipped where the kernel is not built (``python -m anyquant.runtime.kernels build``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anyquant.runtime import kernels

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from core.tests.test_kernels import _quantize_x, experts_reference  # noqa: E402  (the op's references, shared)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="anyquant kernels not built")

K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
ISAS = [i for i in range(len(kernels.ISA_NAMES)) if i <= max(kernels.isa(), 0)]
ISA_IDS = [kernels.ISA_NAMES[i] for i in ISAS]
#: where each type's float16 scales lie in its super-block (d; Q4_K / Q5_K: dmin)
_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _k_blocks(type_name: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random super-blocks: (uint8 blocks, the exact weight as float32 by the gguf package's dequantizer)."""
    _, size, weights = kernels.GGML_TYPES[type_name]
    assert weights == 256 and cols % 256 == 0
    gen = torch.Generator().manual_seed(seed)
    n = rows * cols // 256
    raw = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=gen)
    row_scale = torch.rand(rows, 1, generator=gen).repeat_interleave(cols // 256, 0).reshape(n) * 2 + 0.05
    for at, spread in zip(_HALVES[type_name], (1e-2, 5e-3), strict=False):  # d, then dmin (either sign)
        value = (torch.rand(n, generator=gen) - (0.0 if at == _HALVES[type_name][0] else 0.3)) * spread * row_scale
        raw[:, at : at + 2] = value.to(torch.float16).view(torch.uint8).view(n, 2)
    exact = quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[type_name]).reshape(rows, cols)
    return raw.reshape(-1), torch.from_numpy(np.ascontiguousarray(exact))


def _codes_reference(x: torch.Tensor, w: torch.Tensor, passes: int) -> torch.Tensor:
    """What the op computes, in float64: the activations' codes times the exact weight per block of 32, scaled."""
    xq, dx = _quantize_x(x.float(), passes)
    wb = w.double().reshape(w.shape[0], -1, 32)
    return torch.einsum("nbj,mbj,mb->mn", wb, xq.double(), dx.double())


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("type_name", K_TYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("cols", [256, 768])  # one super-block a row; three
@pytest.mark.parametrize("passes", [1, 2])
def test_k_exact_against_the_codes_reference(type_name: str, isa: int, m: int, cols: int, passes: int) -> None:
    """Every path computes the activations' codes times the exact weight: float32 rounding only (each sub-block's
    integer sums exact, its scales d sc / dmin m exact in float32)."""
    rows = 91 + m  # groups of 8 rows and a last partial group (the vector paths take 8 at a time)
    raw, w = _k_blocks(type_name, rows, cols, seed=m + cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0  # an all-zero block: scale 0
    x[-1, 40] = 1e3  # one large element: every other element of its block rounds to small codes
    got = kernels.gemv(x, raw, type_name, rows, cols, isa, passes)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (m, rows)
    want = _codes_reference(x, w, passes)
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))


@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("type_name", K_TYPES)
@pytest.mark.parametrize(("passes", "bound"), [(1, 1e-2), (2, 1e-4)])
def test_k_within_the_contract_of_the_exact_weight(type_name: str, isa: int, passes: int, bound: float) -> None:
    """The exactness contract of the block kernel (issue #42): two activation passes within 1e-4 of the largest output
    of the exact weight's product (float64), at 1, 3, 8 and 64 rows; no gain error (the fitted gain ``g`` of the
    output against the exact one: ``|g - 1|`` far below the bound). One pass: llama.cpp's int8 activations, 1e-2."""
    rows, cols = 93, 2048
    raw, w = _k_blocks(type_name, rows, cols, seed=11)
    dot = norm = 0.0
    for m in (1, 3, 8, 64):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        got = kernels.gemv(x, raw, type_name, rows, cols, isa, passes)
        assert isinstance(got, torch.Tensor)
        want = x.double() @ w.double().T
        err = _relative(got, want)
        assert bound / 1000 < err < bound, (m, err)  # the activations really are quantized (a float path: ~1e-7)
        dot, norm = dot + float((got.double() * want).sum()), norm + float((want * want).sum())
    # over every output (one x's rounding moves all of a row's outputs alike through Q4_K's offsets: a few 1e-6 of
    # either sign at one row); a wrong scale, min or sign would be a gain error of 1e-2 or more
    assert abs(dot / norm - 1) < bound / 20, dot / norm


@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("type_name", K_TYPES)
@pytest.mark.parametrize("rows", [8, 45])  # whole groups of 8; and 5 of them with 5 rows left as they are
@pytest.mark.parametrize("cols", [256, 2304])  # one column tile of the form (8 super-blocks); two (8 and 1)
def test_k_interleaved_form_gives_bitwise_the_same(isa: int, type_name: str, rows: int, cols: int) -> None:
    """The interleaved form gives the super-blocks back exactly and the same output bit for bit, at every M (the 8-row
    path's 1 to 4 rows at a time) and activation passes, rows wider than one of its column tiles included."""
    raw = _k_blocks(type_name, rows, cols, seed=rows)[0]
    code = kernels.GGML_TYPES[type_name][0]
    il = kernels.interleave(raw, type_name, rows, cols)
    assert isinstance(il, torch.Tensor) and il.shape == raw.shape and not torch.equal(il, raw)
    assert torch.equal(kernels.interleave(il, type_name, rows, cols, False), raw)  # type: ignore[arg-type]
    for m in (1, 3, 6):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        for passes in (1, 2):
            want = torch.ops.anyquant.ggml_gemv(x, raw, code, rows, cols, isa, passes)
            got = torch.ops.anyquant.ggml_gemv(x, il, code + kernels.INTERLEAVED, rows, cols, isa, passes)
            assert torch.equal(got, want)


@pytest.mark.parametrize("type_name", K_TYPES)
def test_k_interleave_reads_permuted_q_k_rows(type_name: str) -> None:
    """``qk_heads`` on super-blocks: the interleaved form of llama.cpp's permuted Q/K rows is bitwise that of the rows
    un-permuted first."""
    heads, head_rows, cols = 4, 32, 512
    rows = heads * head_rows
    raw = _k_blocks(type_name, rows, cols, seed=heads)[0]
    unpermuted = raw.reshape(heads, head_rows // 2, 2, -1).transpose(1, 2).reshape(-1).contiguous()
    want = kernels.interleave(unpermuted, type_name, rows, cols)
    assert torch.equal(kernels.interleave(raw, type_name, rows, cols, True, heads), want)  # type: ignore[arg-type]


@pytest.mark.parametrize("type_name", K_TYPES)
@pytest.mark.parametrize("interleave", [False, True], ids=["stored", "interleaved"])
@pytest.mark.parametrize("cols", [256, 2304])
def test_k_dequantize_is_the_formats_own_bit_for_bit(type_name: str, interleave: bool, cols: int) -> None:
    """``ggml_dequantize`` (the prompt path's weight): the gguf package's dequantization bit for bit, from either form
    (91 rows: a last group of 3 past the interleaved ones), then rounded to bfloat16 / float16 as torch rounds."""
    rows = 91
    raw, want = _k_blocks(type_name, rows, cols, seed=4)
    code = kernels.GGML_TYPES[type_name][0]
    if interleave:
        raw = kernels.interleave(raw, type_name, rows, cols)  # type: ignore[assignment]
        code += kernels.INTERLEAVED
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = torch.ops.anyquant.ggml_dequantize(raw, code, rows, cols, dtype)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype)), dtype


def _q8_0(rows: int, cols: int, seed: int) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))).reshape(-1)


@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("passes", [1, 2])
def test_k_cat_beside_other_types(isa: int, m: int, passes: int) -> None:
    """ggml_gemv_cat (the decode step's q/k/v and gate/up of a Q4_K_M file: Q4_K beside Q6_K, or Q8_0) gives bitwise
    each weight's ggml_gemv, for K-quants and 32-weight blocks, stored and interleaved, partial groups of 8 included."""
    cols = 512
    spec = [("Q4_K", 40, False), ("Q8_0", 13, False), ("Q6_K", 29, True), ("Q4_K", 16, True), ("Q5_K", 5, False)]
    parts: list[tuple[torch.Tensor, int, int]] = []
    for i, (type_name, rows, il) in enumerate(spec):
        raw = _q8_0(rows, cols, i) if type_name == "Q8_0" else _k_blocks(type_name, rows, cols, seed=i)[0]
        code = kernels.GGML_TYPES[type_name][0]
        if il:
            raw = kernels.interleave(raw, type_name, rows, cols)  # type: ignore[assignment]
            code += kernels.INTERLEAVED
        parts.append((raw, code, rows))
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    blocks, codes, rows_ = [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]
    got = torch.ops.anyquant.ggml_gemv_cat(x, blocks, codes, rows_, isa, passes)
    want = torch.cat([torch.ops.anyquant.ggml_gemv(x, b, c, r, cols, isa, passes) for b, c, r in parts], 1)
    assert got.shape == (m, sum(rows_)) and torch.equal(got, want)


@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("passes", [1, 2])
def test_k_experts_is_each_chosen_expert_in_order(isa: int, passes: int) -> None:
    """ggml_experts with K-quant experts (a Q4_K_M MoE file: gate / up Q4_K, down Q4_K or Q6_K) gives bit for bit the
    module path's ggml_gemv calls: per row its experts in ascending order, ``0 + w * down(silu(gate x) * up x)``."""
    hidden, inter = 512, 256
    forms = [("Q4_K", "Q6_K", True), ("Q4_K", "Q4_K", False), ("Q5_K", "Q6_K", True)]
    blocks: list[torch.Tensor] = []
    types: list[int] = []
    for e, (gate_up, down, il) in enumerate(forms):
        for j, (type_name, rows, cols) in enumerate(
            [(gate_up, inter, hidden), (gate_up, inter, hidden), (down, hidden, inter)]
        ):
            raw = _k_blocks(type_name, rows, cols, seed=10 * e + j)[0]
            code = kernels.GGML_TYPES[type_name][0]
            blocks.append(kernels.interleave(raw, type_name, rows, cols) if il else raw)  # type: ignore[arg-type]
            types.append(code + kernels.INTERLEAVED if il else code)

    def linear(x: torch.Tensor, i: int, rows: int) -> torch.Tensor:
        return torch.ops.anyquant.ggml_gemv(x, blocks[i], types[i], rows, x.shape[-1], isa, passes)

    gen = torch.Generator().manual_seed(passes)
    x = torch.randn(3, hidden, generator=gen)
    index = torch.tensor([[2, 0], [1, 1], [0, 3]])  # a repeated expert; 3: not one of the 3 (skipped)
    weights = torch.rand(3, 2, generator=gen)
    got = torch.ops.anyquant.ggml_experts(x, index, weights, blocks, types, inter, isa, passes)
    assert torch.equal(got, experts_reference(x, index, weights, len(forms), linear, inter))


def test_k_refusals() -> None:
    """A K-quant's rows are whole super-blocks of 256 columns, its blocks their exact size."""
    from anyquant.runtime.kernels.linear import BlockLinear

    raw, _ = _k_blocks("Q4_K", 4, 512, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.anyquant.ggml_gemv(torch.randn(1, 288), raw[: 4 * 144], 12, 4, 288)
    with pytest.raises(RuntimeError, match="blocks hold"):
        kernels.gemv(torch.randn(1, 512), raw[:-1], "Q4_K", 4, 512)
    with pytest.raises(RuntimeError, match="blocks hold"):
        kernels.gemv(torch.randn(1, 512), raw, "Q6_K", 4, 512)  # 144-byte super-blocks read as 210-byte ones
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernels.gemv_cat(torch.randn(1, 32), [(raw[:144], "Q4_K", 1), (_q8_0(1, 32, 0), "Q8_0", 1)])
    with pytest.raises(ValueError, match="do not hold"):
        BlockLinear(raw, "Q4_K", 16, 128, small_rows=4)  # 4 x 512 as 16 x 128: the same bytes, not whole super-blocks
    assert kernels.block_nbytes("Q6_K", 4, 512) == 4 * 2 * 210 and kernels.block_nbytes("Q4_0", 4, 512) == 4 * 16 * 18


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_block_linear_paths(type_name: str) -> None:
    """BlockLinear on super-blocks: few rows on the kernel (within the contract), many rows the exact weight's GEMM;
    interleaved at load gives the same outputs and the blocks back."""
    from anyquant.runtime.kernels.linear import BlockLinear

    n, k = 40, 512
    raw, w = _k_blocks(type_name, n, k, seed=5)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    stored = BlockLinear(raw, type_name, n, k, bias, small_rows=4)
    interleaved = BlockLinear(raw, type_name, n, k, bias, small_rows=4, interleave=True)
    assert torch.equal(interleaved.raw_blocks(), raw)
    assert interleaved.ggml_type == kernels.GGML_TYPES[type_name][0] + kernels.INTERLEAVED
    assert torch.equal(stored.exact_weight(), w) and torch.equal(interleaved.exact_weight(), w)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3))
    exact = x.double() @ w.double().T + bias.double()
    with torch.no_grad():
        many = stored(x)  # 9 rows > small_rows: the exact weight's float32 GEMM
        assert _relative(many, exact) < 1e-6 and torch.equal(interleaved(x), many)
        few = stored(x[:3])
        assert _relative(few, exact[:3]) < 1e-4 and torch.equal(interleaved(x[:3]), few)


@pytest.mark.skipif((__import__("os").cpu_count() or 1) < 2, reason="one CPU")
def test_k_rows_split_over_threads() -> None:
    """1 and 2 threads give the same output (each row's arithmetic does not depend on the split)."""
    before = torch.get_num_threads()
    rows, cols = 1024, 512
    raw, _ = _k_blocks("Q6_K", rows, cols, seed=5)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(6))
    try:
        torch.set_num_threads(2)
        two = kernels.gemv(x, raw, "Q6_K", rows, cols)
        torch.set_num_threads(1)
        one = kernels.gemv(x, raw, "Q6_K", rows, cols)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
