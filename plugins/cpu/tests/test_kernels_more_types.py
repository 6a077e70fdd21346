"""The compiled GGUF-block GEMV on the table types IQ4_NL, IQ4_XS (a super-block of 256) and MXFP4 (4-bit codes indexing
16 int8 values: llama.cpp's kvalues_iq4nl, kvalues_mxfp4) and on Q5_0 / Q5_1 (Q4_0 / Q4_1 with a fifth bit), read as
llama.cpp stores them: what is their own. Against the exact dequantized weight (the GGUF plugin's dequantizer, which
the kernel's ``ggml_dequantize`` equals bit for bit) in float64, on every vector path this host has and the portable
scalar one, in both forms (as stored and interleaved), beside the other block types in one call, and in the MoE op:
``test_kernels_kquants.py``, whose checks run on these types (:data:`I_TYPES`) as on the K-quants.

Random blocks: random bytes (every code, every fifth bit, every IQ4_XS 6-bit scale) with finite float16 d (Q5_1's m
either sign), MXFP4's E8M0 exponents around 2^0 (every exponent 0..255 in the dequantization test). The GGUF-level
test is ``plugins/gguf/tests/test_gguf_iquant_kernel.py``.

Skipped where the kernel is not built (anyquant-cpu installed without it; ``make test`` requires it)."""

from __future__ import annotations

import pytest
import torch

from anyquant_cpu import kernels

dequant = pytest.importorskip("anyquant_gguf.dequant")

from plugins.cpu.tests.test_kernels_kquants import ISA_IDS, ISAS, _codes_reference, _i_blocks  # noqa: E402  (shared)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="anyquant kernels not built")


@pytest.mark.parametrize("isa", ISAS, ids=ISA_IDS)
def test_mxfp4_subnormal_and_large_exponents(isa: int) -> None:
    """MXFP4 blocks whose E8M0 exponent is 0 or 1 (subnormal scales 2^-128, 2^-127) or large: every path gives the codes
    reference's output, each block on its own scale."""
    rows, cols = 19, 512
    raw, _ = _i_blocks("MXFP4", rows, cols, seed=3)
    blocks = raw.reshape(-1, 17)
    blocks[:, 0] = torch.tensor([0, 1, 2, 127, 128, 140], dtype=torch.uint8).repeat(blocks.shape[0] // 6 + 1)[
        : blocks.shape[0]
    ]
    raw = blocks.reshape(-1).contiguous()
    w = dequant.dequantize_blocks_torch(raw, dequant.GGMLQuantizationType.MXFP4, (rows, cols))
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(9))
    for passes in (1, 2):
        got = kernels.gemv(x, raw, "MXFP4", rows, cols, isa, passes)
        want = _codes_reference(x, w, passes)  # per block: float64 sums of its codes times its weights, scaled
        assert torch.allclose(got.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))


def test_i_refusals() -> None:
    """IQ4_XS rows are whole super-blocks of 256 columns; every table type's blocks their exact size."""
    raw, _ = _i_blocks("IQ4_XS", 4, 512, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.anyquant.ggml_gemv(torch.randn(1, 288), raw[: 4 * 136], 23, 4, 288)
    with pytest.raises(RuntimeError, match="blocks hold"):
        kernels.gemv(torch.randn(1, 512), raw[:-1], "IQ4_XS", 4, 512)
    mx, _ = _i_blocks("MXFP4", 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="blocks hold"):
        kernels.gemv(torch.randn(1, 64), mx, "IQ4_NL", 4, 64)  # 17-byte blocks read as 18-byte ones
    q5, _ = _i_blocks("Q5_0", 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="blocks hold"):
        kernels.gemv(torch.randn(1, 64), q5, "Q5_1", 4, 64)  # 22-byte blocks read as 24-byte ones
    assert kernels.block_nbytes("MXFP4", 4, 512) == 4 * 16 * 17
    assert kernels.block_nbytes("IQ4_XS", 4, 512) == 4 * 2 * 136
