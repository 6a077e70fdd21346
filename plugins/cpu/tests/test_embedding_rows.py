"""A packed token embedding that offers its table's layout (GGUF's ``GGUFEmbedding``) decodes its looked-up rows with
the compiled kernel's ``ggml_dequantize`` on ``cpu-fast`` (``FastCPUPlan.install_embedding_rows``): bit for bit the
format's own torch decoding, every type the kernel reads, Gemma's scale and a 16-bit compute dtype included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from anyquant_cpu import kernels
from anyquant_cpu.engine import FastCPUPlan

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the compiled block kernel is not built")

#: where each type's float16 scales sit in its block (random bytes elsewhere are valid codes and int8 scales)
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,)}


class _Model(nn.Module):
    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb

    def get_input_embeddings(self) -> nn.Module:
        return self.emb


def _table(type_name: str, rows: int, dim: int, seed: int) -> torch.Tensor:
    _, size, weights = kernels.GGML_TYPES[type_name]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, dim // weights, size), generator=g, dtype=torch.uint8)
    for at in HALVES[type_name]:
        half = (torch.rand(rows, dim // weights, generator=g) * 0.015 + 0.001).to(torch.float16)
        blocks[..., at : at + 2] = half.view(torch.uint8).reshape(rows, dim // weights, 2)
    return blocks.reshape(-1)


@pytest.mark.parametrize("type_name", list(HALVES))
@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, None), (torch.bfloat16, 24.0)], ids=["f32", "bf16-gemma"])
def test_kernel_rows_are_the_formats_rows(type_name: str, dtype: torch.dtype, scale: float | None) -> None:
    from gguf import GGMLQuantizationType

    from anyquant_gguf.qlinear import GGUFEmbedding

    rows, dim = 300, 512
    emb = GGUFEmbedding(
        _table(type_name, rows, dim, 3), GGMLQuantizationType[type_name], (rows, dim), dtype=dtype, scale=scale
    )
    ids = torch.tensor([[0, 7, 299, 7], [150, 1, 2, 3]])
    want = emb(ids)  # the format's torch decoding
    assert FastCPUPlan().install_embedding_rows(_Model(emb)) == type_name
    assert emb.decode_rows is not None
    got = emb(ids)
    assert got.dtype == dtype and torch.equal(got, want)


def test_left_alone_where_it_offers_nothing() -> None:
    assert FastCPUPlan().install_embedding_rows(_Model(nn.Embedding(4, 8))) is None
