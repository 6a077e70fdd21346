"""The compiled GGUF-block GEMV on the K-quants' super-blocks (Q4_K, Q5_K, Q6_K: 256 weights each, read as llama.cpp
stores them): against the exact dequantized weight (the gguf package's dequantizer, a peer; bitwise the GGUF
plugin's) in float64, on every vector path this host has and the portable scalar one, in both forms (as stored and
interleaved), beside the other block types in one call, and in the MoE op. The same checks run on the table types
and Q5_0 / Q5_1 (:data:`I_TYPES`, against the GGUF plugin's dequantizer; their own checks are in
``test_kernels_more_types.py``).

Random super-blocks: random bytes (every 6-bit scale and min, every int8 Q6_K scale, every code) with finite
float16 d / dmin. The GGUF files llama.cpp quantized are in ``plugins/gguf/tests/test_gguf_kquant_kernel.py``.

Skipped where the kernel is not built (anyquant-cpu installed without it; ``make test`` requires it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anyquant_cpu import kernels

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from plugins.cpu.tests.test_kernels import _quantize_x, check_experts  # noqa: E402  (the op's references, shared)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="anyquant kernels not built")

K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
#: the table types IQ4_NL, IQ4_XS (a super-block of 256) and MXFP4, and Q5_0 / Q5_1 (``test_kernels_more_types.py``)
I_TYPES = ["IQ4_NL", "IQ4_XS", "MXFP4", "Q5_0", "Q5_1"]
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


def _i_blocks(
    type_name: str, rows: int, cols: int, seed: int, *, exponents: tuple[int, int] = (120, 130)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks: (uint8 blocks, the exact weight as float32 by the GGUF plugin's dequantizer; skipped without
    it). MXFP4's E8M0 exponents in ``exponents`` (inclusive), a row's exponents spread over the range."""
    dequant = pytest.importorskip("anyquant_gguf.dequant")
    _, size, weights = kernels.GGML_TYPES[type_name]
    assert cols % weights == 0
    gen = torch.Generator().manual_seed(seed)
    n = rows * cols // weights
    raw = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=gen)
    if type_name == "MXFP4":
        raw[:, 0] = torch.randint(exponents[0], exponents[1] + 1, (n,), dtype=torch.uint8, generator=gen)
    else:  # d (either sign), scaled per row
        row_scale = torch.rand(rows, 1, generator=gen).repeat_interleave(cols // weights, 0).reshape(n) * 2 + 0.05
        value = (torch.rand(n, generator=gen) - 0.3) * (3e-3 if type_name == "IQ4_XS" else 1e-2) * row_scale
        raw[:, 0:2] = value.to(torch.float16).view(torch.uint8).view(n, 2)
        if type_name == "Q5_1":  # m: an offset of either sign, about the size of the codes' spread
            m = (torch.rand(n, generator=gen) - 0.5) * 16 * (value.abs() + 1e-4)
            raw[:, 2:4] = m.to(torch.float16).view(torch.uint8).view(n, 2)
    raw = raw.reshape(-1).contiguous()
    exact = dequant.dequantize_blocks_torch(raw, dequant.GGMLQuantizationType[type_name], (rows, cols))
    return raw, exact


def _blocks(
    type_name: str, rows: int, cols: int, seed: int, *, exponents: tuple[int, int] = (120, 130)
) -> tuple[torch.Tensor, torch.Tensor]:
    """A K-quant's random super-blocks (:func:`_k_blocks`), else an :data:`I_TYPES` type's (:func:`_i_blocks`)."""
    if type_name in K_TYPES:
        return _k_blocks(type_name, rows, cols, seed)
    return _i_blocks(type_name, rows, cols, seed, exponents=exponents)


def _codes_reference(x: torch.Tensor, w: torch.Tensor, passes: int) -> torch.Tensor:
    """What the op computes, in float64: the activations' codes times the exact weight per block of 32, scaled."""
    xq, dx = _quantize_x(x.float(), passes)
    wb = w.double().reshape(w.shape[0], -1, 32)
    return torch.einsum("nbj,mbj,mb->mn", wb, xq.double(), dx.double())


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("type_name", K_TYPES + I_TYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("cols", [256, 768])  # one super-block a row; three
@pytest.mark.parametrize("passes", [1, 2])
def test_exact_against_the_codes_reference(type_name: str, isa: int, m: int, cols: int, passes: int) -> None:
    """Every path computes the activations' codes times the exact weight: float32 rounding only (each (sub-)block's
    integer sums exact, its scales d sc / dmin m, d, d (ls - 32) or 2^(e-128) exact in float32; Q5_1's m times the
    codes' sum)."""
    rows = 91 + m  # groups of 8 rows and a last partial group (the vector paths take 8 at a time)
    raw, w = _blocks(type_name, rows, cols, seed=m + cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0  # an all-zero block: scale 0
    x[-1, 40] = 1e3  # one large element: every other element of its block rounds to small codes
    got = kernels.gemv(x, raw, type_name, rows, cols, isa, passes)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (m, rows)
    want = _codes_reference(x, w, passes)
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))


@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("type_name", K_TYPES + I_TYPES)
@pytest.mark.parametrize(("passes", "bound"), [(1, 1e-2), (2, 1e-4)])
def test_within_the_contract_of_the_exact_weight(type_name: str, isa: int, passes: int, bound: float) -> None:
    """The exactness contract of the block kernel (issue #42): two activation passes within 1e-4 of the largest output
    of the exact weight's product (float64), at 1, 3, 8 and 64 rows; no gain error (the fitted gain ``g`` of the
    output against the exact one: ``|g - 1|`` far below the bound). One pass: llama.cpp's int8 activations, 1e-2."""
    rows, cols = 93, 2048
    raw, w = _blocks(type_name, rows, cols, seed=11)
    dot = norm = worst = 0.0
    for m in (1, 3, 8, 64):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        got = kernels.gemv(x, raw, type_name, rows, cols, isa, passes)
        assert isinstance(got, torch.Tensor)
        want = x.double() @ w.double().T
        err = _relative(got, want)
        worst = max(worst, err)
        assert bound / 1000 < err < bound, (m, err)  # the activations really are quantized (a float path: ~1e-7)
        dot, norm = dot + float((got.double() * want).sum()), norm + float((want * want).sum())
    print(f"{type_name} {kernels.ISA_NAMES[isa]} passes={passes}: max err {worst:.3g}, |g-1| {abs(dot / norm - 1):.3g}")
    # over every output (one x's rounding moves all of a row's outputs alike through Q4_K's offsets: a few 1e-6 of
    # either sign at one row); a wrong scale, min or sign would be a gain error of 1e-2 or more
    assert abs(dot / norm - 1) < bound / 20, dot / norm


@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("type_name", K_TYPES + I_TYPES)
@pytest.mark.parametrize("rows", [8, 45])  # whole groups of 8; and 5 of them with 5 rows left as they are
@pytest.mark.parametrize("cols", [256, 2304])  # one column tile of the form (8 super-blocks) or within one; two
def test_interleaved_form_gives_bitwise_the_same(isa: int, type_name: str, rows: int, cols: int) -> None:
    """The interleaved form gives the (super-)blocks back exactly and the same output bit for bit, at every M (the
    8-row path's 1 to 4 rows at a time) and activation passes, rows wider than one of its column tiles included."""
    raw = _blocks(type_name, rows, cols, seed=rows)[0]
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


@pytest.mark.parametrize("type_name", K_TYPES + I_TYPES)
def test_interleave_reads_permuted_q_k_rows(type_name: str) -> None:
    """``qk_heads`` on (super-)blocks: the interleaved form of llama.cpp's permuted Q/K rows is bitwise that of the
    rows un-permuted first (the scalar copy, and the vector one where the host has it, alike)."""
    heads, head_rows, cols = 4, 32, 512
    rows = heads * head_rows
    raw = _blocks(type_name, rows, cols, seed=heads)[0]
    unpermuted = raw.reshape(heads, head_rows // 2, 2, -1).transpose(1, 2).reshape(-1).contiguous()
    want = kernels.interleave(unpermuted, type_name, rows, cols)
    assert torch.equal(kernels.interleave(raw, type_name, rows, cols, True, heads), want)  # type: ignore[arg-type]


@pytest.mark.parametrize("type_name", K_TYPES + I_TYPES)
@pytest.mark.parametrize("interleave", [False, True], ids=["stored", "interleaved"])
@pytest.mark.parametrize("cols", [256, 2304])
def test_dequantize_is_the_formats_own_bit_for_bit(type_name: str, interleave: bool, cols: int) -> None:
    """``ggml_dequantize`` (the prompt path's weight): the gguf package's dequantization (the K-quants) or the GGUF
    plugin's (:data:`I_TYPES`: bitwise in float32, signed zeros and subnormals alike) bit for bit, from either form
    (91 rows: a last group of 3 past the interleaved ones), then rounded to bfloat16 / float16 as torch rounds; MXFP4
    over every E8M0 exponent, the subnormal scales of e = 0, 1 and 2^127 of e = 255 included."""
    rows = 91
    raw, want = _blocks(type_name, rows, cols, seed=4, exponents=(0, 255))
    if type_name == "MXFP4":
        assert set(raw.reshape(-1, 17)[:, 0].tolist()) >= {0, 1, 2, 254, 255}
    code = kernels.GGML_TYPES[type_name][0]
    if interleave:
        raw = kernels.interleave(raw, type_name, rows, cols)  # type: ignore[assignment]
        code += kernels.INTERLEAVED
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = torch.ops.anyquant.ggml_dequantize(raw, code, rows, cols, dtype)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype)), dtype
        if dtype == torch.float32 and type_name in I_TYPES:
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _q8_0(rows: int, cols: int, seed: int) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))).reshape(-1)


#: ggml_gemv_cat's weights: (type, rows, interleaved)
CAT_SPECS = {
    "kquants": [("Q4_K", 40, False), ("Q8_0", 13, False), ("Q6_K", 29, True), ("Q4_K", 16, True), ("Q5_K", 5, False)],
    "i-types": [
        ("IQ4_XS", 40, False),
        ("Q8_0", 13, False),
        ("IQ4_NL", 29, True),
        ("MXFP4", 16, True),
        ("Q6_K", 8, True),
        ("MXFP4", 5, False),
        ("IQ4_XS", 21, True),
        ("IQ4_NL", 3, False),
        ("Q5_0", 11, True),
        ("Q5_1", 24, False),
        ("Q5_0", 7, False),
        ("Q5_1", 9, True),
    ],
}


@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("spec", list(CAT_SPECS.values()), ids=list(CAT_SPECS))
def test_cat_beside_other_types(isa: int, m: int, passes: int, spec: list[tuple[str, int, bool]]) -> None:
    """ggml_gemv_cat (the decode step's q/k/v and gate/up of a Q4_K_M file: Q4_K beside Q6_K, or Q8_0) gives bitwise
    each weight's ggml_gemv, for K-quants, the :data:`I_TYPES` and 32-weight blocks, stored and interleaved, partial
    groups of 8 included."""
    cols = 512
    parts: list[tuple[torch.Tensor, int, int]] = []
    for i, (type_name, rows, il) in enumerate(spec):
        raw = _q8_0(rows, cols, i) if type_name == "Q8_0" else _blocks(type_name, rows, cols, seed=i)[0]
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


#: ggml_experts' experts (gate / up type, down type, interleaved) and each row's chosen experts: a repeated expert;
#: one past the experts (skipped)
EXPERTS_CASES = {
    "kquants": (
        [("Q4_K", "Q6_K", True), ("Q4_K", "Q4_K", False), ("Q5_K", "Q6_K", True)],
        [[2, 0], [1, 1], [0, 3]],
    ),
    "i-types": (
        [
            ("MXFP4", "MXFP4", True),
            ("IQ4_XS", "IQ4_NL", False),
            ("IQ4_NL", "IQ4_XS", True),
            ("Q5_0", "Q5_1", True),
            ("Q5_1", "Q5_0", False),
        ],
        [[2, 0], [1, 1], [0, 7], [4, 3]],
    ),
}


@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize(("forms", "index"), list(EXPERTS_CASES.values()), ids=list(EXPERTS_CASES))
def test_experts_is_each_chosen_expert_in_order(
    isa: int, passes: int, forms: list[tuple[str, str, bool]], index: list[list[int]]
) -> None:
    """ggml_experts with K-quant experts (a Q4_K_M MoE file: gate / up Q4_K, down Q4_K or Q6_K) or table-type ones
    (gpt-oss's MXFP4 experts; IQ4_XS / IQ4_NL files' MoE layers) gives bit for bit the module path's ggml_gemv calls:
    per row its experts in ascending order, ``0 + w * down(silu(gate x) * up x)``."""
    check_experts(_blocks, forms, 512, 256, torch.tensor(index), isa, passes)


def test_k_refusals() -> None:
    """A K-quant's rows are whole super-blocks of 256 columns, its blocks their exact size."""
    from anyquant_cpu.kernels.linear import BlockLinear

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


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", *I_TYPES])
def test_block_linear_paths(type_name: str) -> None:
    """BlockLinear on super-blocks and the table types: few rows on the kernel (within the contract), many rows the
    exact weight's GEMM; interleaved at load gives the same outputs and the blocks back."""
    from anyquant_cpu.kernels.linear import BlockLinear

    n, k = 40, 512
    raw, w = _blocks(type_name, n, k, seed=5)
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
