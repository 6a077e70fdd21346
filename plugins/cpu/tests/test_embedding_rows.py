"""A packed token embedding that offers its table's layout (GGUF's ``GGUFEmbedding``) decodes its looked-up rows with
the compiled kernel's ``ggml_dequantize`` on ``cpu-fast`` (``FastCPUPlan.install_embedding_rows``): bit for bit the
format's own torch decoding, every type the kernel reads, Gemma's scale and a 16-bit compute dtype included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from anyquant_cpu import kernels
from anyquant_cpu.engine import FastCPUPlan
from tests.decoding import GGML_HALVES, random_ggml_blocks

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the compiled block kernel is not built")


class _Model(nn.Module):
    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb

    def get_input_embeddings(self) -> nn.Module:
        return self.emb


@pytest.mark.parametrize("type_name", list(GGML_HALVES))
@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, None), (torch.bfloat16, 24.0)], ids=["f32", "bf16-gemma"])
def test_kernel_rows_are_the_formats_rows(type_name: str, dtype: torch.dtype, scale: float | None) -> None:
    from gguf import GGMLQuantizationType

    from anyquant_gguf.qlinear import GGUFEmbedding

    rows, dim = 300, 512
    emb = GGUFEmbedding(
        random_ggml_blocks(type_name, rows, dim, 3),
        GGMLQuantizationType[type_name],
        (rows, dim),
        dtype=dtype,
        scale=scale,
    )
    ids = torch.tensor([[0, 7, 299, 7], [150, 1, 2, 3]])
    want = emb(ids)  # the format's torch decoding
    assert FastCPUPlan().install_embedding_rows(_Model(emb)) == type_name
    assert emb.decode_rows is not None
    got = emb(ids)
    assert got.dtype == dtype and torch.equal(got, want)


def test_left_alone_where_it_offers_nothing() -> None:
    assert FastCPUPlan().install_embedding_rows(_Model(nn.Embedding(4, 8))) is None
