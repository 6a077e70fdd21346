"""The GGUF types beyond Q4_0..Q6_K: MXFP4 (gpt-oss), NVFP4, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 and the lattice types
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.

The judge is llama.cpp's reference dequantization as the ``gguf`` package's numpy dequantizers
(``gguf.quants.dequantize``) reproduce it: the torch dequantizer must equal them bit for bit (float32) on realistic
blocks and on edge blocks (zero, subnormal, largest, infinite and NaN scales, every exponent byte, every code)
(arbitrary bytes: ``test_gguf_qlinear.py::test_bit_exact_arbitrary_bytes``, over every packed type); and a tiny Llama written with ``gguf.GGUFWriter`` whose weights are in these types must load on
every backend with the logits of a float32 model built from gguf's dequantized weights. No llama.cpp-made file of
these types is among the fixtures yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import anyquant
from anyquant_gguf import dequant
from anyquant_gguf.qlinear import PACKED_TYPES, GGUFEmbedding, GGUFLinear, GGUFTiedHead, dequantize_blocks_torch
from anyquant_gguf.reader import DEQUANTIZABLE_TYPES, UnsupportedGGUFType, load_tensor, open_gguf

LATTICE = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M)
NEW_TYPES = (Q.MXFP4, Q.NVFP4, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0, *LATTICE)
#: types gguf's numpy quantizer writes (realistic blocks); the others get random codes under chosen scales
_QUANTIZABLE = (Q.MXFP4, Q.TQ1_0, Q.TQ2_0)
#: float16 edge scales: +-0, smallest subnormal, largest subnormal, smallest normal, 1, largest, +-inf, NaN
_F16_EDGES = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00], "<u2")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _f16_offsets(qtype: Q) -> tuple[int, ...]:
    """Byte offsets of a block's float16 scales (none for MXFP4/NVFP4; IQ1_M's is spread over nibbles)."""
    return {Q.TQ1_0: (52,), Q.TQ2_0: (64,), Q.MXFP4: (), Q.NVFP4: (), Q.IQ1_M: (), Q.Q5_K: (0, 2)}.get(qtype, (0,))


def _set_d(blocks: np.ndarray, qtype: Q, d: np.ndarray) -> None:
    """Write float16 scales ``d`` (one per block) into ``blocks`` (``[n, type_size]`` uint8), in place."""
    bits = np.asarray(d, dtype=np.float16).view("<u2").reshape(-1)
    if qtype == Q.IQ1_M:  # the top nibbles of the four uint16 scale words: d's bits 0-3, 4-7, 8-11, 12-15
        for k in range(4):
            byte = blocks[:, 49 + 2 * k]
            blocks[:, 49 + 2 * k] = (byte & 0x0F) | (((bits >> (4 * k)) & 0xF) << 4).astype(np.uint8)
        return
    for offset in _f16_offsets(qtype):
        blocks[:, offset : offset + 2] = bits.view(np.uint8).reshape(-1, 2)


def _reference(data: np.ndarray, qtype: Q) -> torch.Tensor:
    with np.errstate(all="ignore"):
        return torch.from_numpy(np.ascontiguousarray(dequantize(data, qtype)))


def _blocks(qtype: Q, rows: int, cols: int, seed: int, std: float = 0.05) -> np.ndarray:
    """``[rows, bytes_per_row]`` blocks of weights of about ``std``: gguf's quantizer where it has one, else random
    codes under one scale per tensor chosen for that size (NVFP4: every scale byte 0x08, 2^-7)."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in _QUANTIZABLE:
        values = rng.standard_normal((rows, cols)).astype(np.float32) * std
        values[0, :block] = 0.0  # an all-zero block
        return quantize(values, qtype)
    data = rng.integers(0, 256, (rows * cols // block, type_size), dtype=np.uint8)
    if qtype == Q.NVFP4:
        data[:, :4] = 0x08
    else:
        _set_d(data, qtype, np.ones(len(data)))
        rms = float(np.sqrt(np.mean(_reference(data, qtype).numpy() ** 2)))
        _set_d(data, qtype, np.full(len(data), std / rms))
    return data.reshape(rows, -1)


def _edge_blocks(qtype: Q) -> np.ndarray:
    """256 blocks in which every byte position holds every value (so every code, every exponent and scale byte),
    their float16 scales cycling through the edge values, plus an all-zero and an all-0xFF block."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    i, j = np.arange(256)[:, None], np.arange(type_size)[None, :]
    data = ((i + 37 * j) % 256).astype(np.uint8)
    _set_d(data, qtype, _F16_EDGES[np.arange(256) % len(_F16_EDGES)].view(np.float16))
    return np.concatenate([data, np.zeros((1, type_size), np.uint8), np.full((1, type_size), 255, np.uint8)])


def _assert_same(data: np.ndarray, qtype: Q, *, finite: bool = False) -> None:
    """Ours equals gguf's bit for bit; NaN where gguf's is NaN (the payload may differ: operands are ordered
    differently)."""
    reference = _reference(data, qtype)
    ours = dequantize_blocks_torch(torch.from_numpy(data), qtype, tuple(reference.shape))
    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    nan = torch.isnan(reference)
    if finite:
        assert torch.isfinite(reference).all()
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(_bits(ours[~nan]), _bits(reference[~nan]))


def test_new_types_are_supported() -> None:
    assert set(NEW_TYPES) <= PACKED_TYPES and set(NEW_TYPES) <= DEQUANTIZABLE_TYPES
    assert PACKED_TYPES == DEQUANTIZABLE_TYPES - {Q.F32, Q.F16, Q.BF16}
    for qtype in NEW_TYPES:
        dequant.check_supported(qtype)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
def test_bit_exact_realistic_blocks(qtype: Q) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    _assert_same(_blocks(qtype, rows=12, cols=3 * max(block, 64), seed=int(qtype)), qtype, finite=True)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
def test_bit_exact_edge_blocks(qtype: Q) -> None:
    data = _edge_blocks(qtype)
    _assert_same(data, qtype)
    reference = _reference(data, qtype)
    assert torch.isinf(reference).any() or qtype in (Q.NVFP4, Q.TQ1_0, Q.TQ2_0)  # largest scales overflow
    if _f16_offsets(qtype) or qtype == Q.IQ1_M:
        assert torch.isnan(reference).any() and (_bits(reference) == 0).any()


def test_every_mxfp4_exponent_and_code() -> None:
    """MXFP4's scale byte is an e8m0 exponent (``2^(e-127)``, ggml's halved for its doubled e2m1 values): all 256,
    each with all 16 codes; 0 and 1 give subnormal scales, 255 overflows the largest codes to infinity."""
    e = np.arange(256, dtype=np.uint8)[:, None]
    codes = np.tile(np.array([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2, np.uint8), (256, 1))
    data = np.concatenate([e, codes], axis=1)
    _assert_same(data, Q.MXFP4)
    values = dequantize_blocks_torch(torch.from_numpy(data), Q.MXFP4, (256, 32))
    # weight 16 holds code 1 (e2m1 0.5, doubled 1), weight 3 code 6 (e2m1 4, doubled 8)
    assert float(values[128, 16]) == 1.0 and float(values[127, 3]) == 4.0 and float(values[0, 16]) == 2.0**-128
    assert float(values[255, 16]) == 2.0**127 and int(torch.isinf(values[255]).sum()) == 24  # all but 0, +-0.5


def test_tq1_0_every_byte() -> None:
    """TQ1_0 packs five ternary digits a byte as a fraction of 243 (uint8 products wrap): every byte value in
    every position, including the 13 values over 242 a quantizer never writes."""
    data = np.zeros((256, 54), np.uint8)
    data[:, :52] = np.arange(256, dtype=np.uint8)[:, None]
    data[:, 52:54] = np.array([0x3C00], "<u2").view(np.uint8)  # d = 1
    _assert_same(data, Q.TQ1_0)
    values = dequantize_blocks_torch(torch.from_numpy(data), Q.TQ1_0, (256, 256))
    assert set(values.unique().tolist()) == {-1.0, 0.0, 1.0}


def test_ksigns_and_grids_are_ggufs() -> None:
    """The sign table is computed here (7 bits and their parity), the lattice grids are gguf's own."""
    from gguf import quants

    assert bytes(dequant._KSIGNS.tolist()) == quants.IQ2_XXS.ksigns
    for qtype in LATTICE:
        grid = dequant._grid(qtype)
        cls = getattr(quants, qtype.name)
        assert grid.shape == cls.grid_shape and grid.dtype == torch.float32
        assert set(grid.unique().tolist()) <= {float(v) for v in cls.grid_map}
        assert torch.equal(grid, torch.from_numpy(np.ascontiguousarray(cls.grid.reshape(cls.grid_shape))))


def test_missing_grid_is_an_unsupported_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a ``gguf`` that has the grid tables a lattice type is refused when its module is made (not at its
    first forward); the other new types need nothing from gguf."""

    def no_gguf(name: str) -> Any:
        raise ModuleNotFoundError(f"No module named {name!r}")

    dequant._grid.cache_clear()
    monkeypatch.setattr(dequant.importlib, "import_module", no_gguf)
    try:
        with pytest.raises(UnsupportedGGUFType, match=r"IQ2_XS .*grid.*gguf"):
            dequant.check_supported(Q.IQ2_XS)
        with pytest.raises(UnsupportedGGUFType, match="IQ3_S"):
            GGUFLinear.from_raw(torch.zeros(110, dtype=torch.uint8), Q.IQ3_S, (1, 256))
        with pytest.raises(UnsupportedGGUFType, match="IQ1_M"):
            dequantize_blocks_torch(torch.zeros(56, dtype=torch.uint8), Q.IQ1_M, (256,))
        for qtype in (Q.MXFP4, Q.NVFP4, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0):
            dequant.check_supported(qtype)
            block, type_size = GGML_QUANT_SIZES[qtype]
            dequantize_blocks_torch(torch.zeros(type_size, dtype=torch.uint8), qtype, (block,))
    finally:
        monkeypatch.undo()
        dequant._grid.cache_clear()
    dequant.check_supported(Q.IQ2_XS)


def test_still_unsupported_types() -> None:
    for qtype, nbytes, block in ((Q.Q1_0, 18, 128), (Q.Q8_K, 292, 256), (Q.Q8_1, 36, 32)):
        with pytest.raises(UnsupportedGGUFType, match=qtype.name):
            dequantize_blocks_torch(torch.zeros(nbytes, dtype=torch.uint8), qtype, (block,))
        with pytest.raises(UnsupportedGGUFType, match=qtype.name):
            GGUFLinear.from_raw(torch.zeros(nbytes, dtype=torch.uint8), qtype, (1, block))


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
def test_modules_over_the_new_types(qtype: Q) -> None:
    """GGUFLinear (both modes), GGUFEmbedding and GGUFTiedHead read the new types' blocks as the dequantizer does."""
    shape = (24, 512)
    raw = torch.from_numpy(_blocks(qtype, *shape, seed=7))
    weight = _reference(raw.numpy(), qtype)
    x = torch.randn(2, 3, 512)
    modes: tuple[Literal["on-the-fly", "dequant-at-load"], ...] = ("on-the-fly", "dequant-at-load")
    for mode in modes:
        lin = GGUFLinear.from_raw(raw, qtype, shape, torch.randn(24), mode=mode)
        assert torch.equal(lin.dequantize(), weight) and qtype.name in repr(lin)
        assert torch.equal(lin(x), F.linear(x, weight, lin.bias))
    ids = torch.tensor([[0, 5, 23, 5]])
    assert torch.equal(GGUFEmbedding(raw, qtype, shape)(ids), weight[ids])
    torch.testing.assert_close(GGUFTiedHead(raw, qtype, shape)(x), F.linear(x, weight), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- a tiny Llama of the new types

_HIDDEN, _FFN, _VOCAB, _HEADS, _KV = 256, 256, 96, 4, 2
#: (layer, HF linear) -> type: the thirteen new types, and a Q5_K to compare cpu-fast's handling with
_TYPES = {
    (0, "self_attn.q_proj"): Q.IQ2_XXS,
    (0, "self_attn.k_proj"): Q.IQ2_XS,
    (0, "self_attn.v_proj"): Q.IQ2_S,
    (0, "self_attn.o_proj"): Q.IQ3_XXS,
    (0, "mlp.gate_proj"): Q.IQ3_S,
    (0, "mlp.up_proj"): Q.IQ1_S,
    (0, "mlp.down_proj"): Q.IQ1_M,
    (1, "self_attn.q_proj"): Q.MXFP4,
    (1, "self_attn.k_proj"): Q.NVFP4,
    (1, "self_attn.v_proj"): Q.TQ1_0,
    (1, "self_attn.o_proj"): Q.TQ2_0,
    (1, "mlp.gate_proj"): Q.IQ4_XS,
    (1, "mlp.up_proj"): Q.IQ4_NL,
    (1, "mlp.down_proj"): Q.Q5_K,
}
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_EMBED_TYPE, _HEAD_TYPE = Q.IQ4_NL, Q.MXFP4


def _permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (rows of any kind: here whole rows of blocks)."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(rows.shape)


def _llama_writer(path: Path, ffn: int = _FFN) -> GGUFWriter:
    """A writer of a 2-layer "llama" GGUF file of the tiny model's shape (``ffn``: its feed-forward width), its
    metadata added; shared with ``test_gguf_iquant_kernel.py``."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(_HIDDEN)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_KV)
    writer.add_rope_dimension_count(_HIDDEN // _HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(_VOCAB)
    return writer


@pytest.fixture(scope="module")
def tiny_new_types(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """The GGUF file and the float32 reference: a LlamaForCausalLM holding gguf's dequantization of its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=_HIDDEN,
        intermediate_size=_FFN,
        num_hidden_layers=2,
        num_attention_heads=_HEADS,
        num_key_value_heads=_KV,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("new-types") / "tiny-new-types.gguf"
    writer = _llama_writer(path)
    rng = np.random.default_rng(0)
    state: dict[str, torch.Tensor] = {}

    def packed(gguf_name: str, hf_name: str, qtype: Q, shape: tuple[int, int], heads: int | None = None) -> None:
        raw = _blocks(qtype, *shape, seed=len(state), std=0.5 if "embd" in gguf_name else 0.06)
        state[hf_name] = _reference(raw, qtype)
        writer.add_tensor(gguf_name, raw if heads is None else _permute(raw, heads), raw_dtype=qtype)

    def norm(gguf_name: str, hf_name: str) -> None:
        value = (1.0 + 0.1 * rng.standard_normal(_HIDDEN)).astype(np.float32)
        state[hf_name] = torch.from_numpy(value)
        writer.add_tensor(gguf_name, value)

    packed("token_embd.weight", "model.embed_tokens.weight", _EMBED_TYPE, (_VOCAB, _HIDDEN))
    head_dim = _HIDDEN // _HEADS
    for (layer, linear), qtype in _TYPES.items():
        out_features = {"k_proj": _KV * head_dim, "v_proj": _KV * head_dim}.get(linear.split(".")[1], _HIDDEN)
        heads = {"q_proj": _HEADS, "k_proj": _KV}.get(linear.split(".")[1])
        name = f"blk.{layer}.{_GGUF_NAMES[linear]}.weight"
        packed(name, f"model.layers.{layer}.{linear}.weight", qtype, (out_features, _HIDDEN), heads)
    for layer in range(2):
        norm(f"blk.{layer}.attn_norm.weight", f"model.layers.{layer}.input_layernorm.weight")
        norm(f"blk.{layer}.ffn_norm.weight", f"model.layers.{layer}.post_attention_layernorm.weight")
    norm("output_norm.weight", "model.norm.weight")
    packed("output.weight", "lm_head.weight", _HEAD_TYPE, (_VOCAB, _HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict(state, strict=True)
    return path, reference


def _load(path: Path, backend: str, **extra: Any) -> Any:
    from anyquant_gguf.loader import GGUFLoader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GGUFLoader, "tokenizer", lambda self, probe, options: None)  # no vocabulary in the file
        return anyquant.load(path, backend=backend, device="cpu", **extra)


_IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 11, 95]])


def _logits(model: Any, ids: torch.Tensor = _IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_tiny_model_tensors_equal_ggufs(tiny_new_types: tuple[Path, torch.nn.Module]) -> None:
    """load_tensor of every weight (Q/K un-permuted from the stored rows) equals gguf's dequantization."""
    from anyquant_gguf.reader import hf_tensor_names

    path, reference = tiny_new_types
    reader = open_gguf(path)
    want = reference.state_dict()
    for gguf_name, hf_name in hf_tensor_names(reader).items():
        assert torch.equal(_bits(load_tensor(reader, gguf_name)), _bits(want[hf_name])), gguf_name


def test_detect_and_inspect_name_the_types(tiny_new_types: tuple[Path, torch.nn.Module]) -> None:
    path, _ = tiny_new_types
    names = {q.name for q in (*_TYPES.values(), _EMBED_TYPE, _HEAD_TYPE)}
    detection = anyquant.detect(path)
    assert detection.format == "gguf" and names <= set(detection.details["tensor_types"])
    rows = {m.name: m for m in anyquant.inspect(path).modules}
    for (layer, linear), qtype in _TYPES.items():
        row = rows[f"blk.{layer}.{_GGUF_NAMES[linear]}.weight"]
        block, type_size = GGML_QUANT_SIZES[qtype]
        assert (row.format, row.extra["type"], row.group_size) == ("gguf", qtype.name, block)
        assert row.bits == pytest.approx(8 * type_size / block)
    assert rows["token_embd.weight"].extra["type"] == "IQ4_NL" and rows["output.weight"].extra["type"] == "MXFP4"


def test_file_types_are_llama_cpps() -> None:
    """``general.file_type`` names (the detection's variant) for every llama.cpp file type gguf knows, TQ1_0,
    TQ2_0 and gpt-oss's MXFP4_MOE among them."""
    from gguf import LlamaFileType

    from anyquant_gguf.plugin import FILE_TYPES

    want = {t.value: t.name.removeprefix("MOSTLY_").removeprefix("ALL_") for t in LlamaFileType if t.value < 1024}
    assert FILE_TYPES == want


@pytest.mark.parametrize("backend", ["dequantized", "packed"])
def test_tiny_model_exact_backends(tiny_new_types: tuple[Path, torch.nn.Module], backend: str) -> None:
    """Both exact backends: the logits of the float32 model built from gguf's dequantized weights."""
    path, reference = tiny_new_types
    model = _load(path, backend)
    linears = {n: m for n, m in model.module.named_modules() if isinstance(m, GGUFLinear)}
    assert {n: m.qtype for n, m in linears.items()} == {
        **{f"model.layers.{layer}.{linear}": q for (layer, linear), q in _TYPES.items()},
        "lm_head": _HEAD_TYPE,
    }
    assert all(m.mode == ("on-the-fly" if backend == "packed" else "dequant-at-load") for m in linears.values())
    if backend == "packed":
        embedding = model.module.get_input_embeddings()
        assert isinstance(embedding, GGUFEmbedding) and embedding.qtype == _EMBED_TYPE
    torch.testing.assert_close(_logits(model.module), _logits(reference), rtol=1e-5, atol=1e-5)


#: the types of the tiny model that the compiled GGUF-block kernel runs (where it is built)
_ON_BLOCK_KERNEL = (Q.Q5_K, Q.MXFP4, Q.IQ4_XS, Q.IQ4_NL)


def test_tiny_model_cpu_fast(tiny_new_types: tuple[Path, torch.nn.Module]) -> None:
    """cpu-fast runs the new types without an int4 or GGUF-block kernel (NVFP4, TQ1_0, TQ2_0, the lattice types) as
    bfloat16 prepacked for decode where oneDNN runs it, else dequantized at load; MXFP4, IQ4_XS and IQ4_NL (and the
    MXFP4 head) with the Q5_K beside them on the block kernel where it is built (else as the others); prompts over
    ``small_rows`` exact."""
    fastcpu = pytest.importorskip("anyquant_cpu.engine")
    ok, reason = fastcpu.fast_cpu_capable()
    if not ok:
        pytest.skip(reason)
    path, reference = tiny_new_types
    fast = _load(path, "cpu-fast", cpu_fast_small_rows=4, cpu_fast_prefill="float32")
    info = fast.info["cpu_fast"]
    from anyquant_cpu import kernels

    on_kernel = {f"model.layers.{layer}.{linear}" for (layer, linear), q in _TYPES.items() if q in _ON_BLOCK_KERNEL}
    expected = {f"model.layers.{layer}.{linear}": q.name for (layer, linear), q in _TYPES.items()}
    if kernels.available():
        expected = {n: q for n, q in expected.items() if n not in on_kernel}
        counts: dict[str, int] = {}
        for q in [q for q in _TYPES.values() if q in _ON_BLOCK_KERNEL] + [_HEAD_TYPE]:  # the MXFP4 head too
            counts[q.name] = counts.get(q.name, 0) + 1
        assert info.get("block_kernel") == counts, info
        assert "lm_head" not in info and "lm_head" not in {*info["bf16"], *info["dequantized"]}, info
        head_module = fast.module.get_output_embeddings()
        assert type(head_module).__name__ == "GGUFBlockHead"
        top = torch.tensor(
            [0, head_module.out_features - 1, 3]
        )  # the exact rows, by the kernel: the format's, bit for bit
        table = head_module.table
        assert table.decode_rows is not None
        want = dequantize_blocks_torch(table.qweight[top], table.qtype, (3, head_module.in_features))
        assert torch.equal(table.rows(top), want)
    # where the kernel is not built, the MXFP4 head: a FastHead over the file's table where a decode form runs here,
    # else as the linears
    head = info.pop("lm_head", None)
    bf16, dequantized = dict(info["bf16"]), dict(info["dequantized"])
    if not kernels.available():
        assert head == {"table": "MXFP4", "decode": head["decode"]} if head else "lm_head" in {*bf16, *dequantized}
    bf16.pop("lm_head", None)
    dequantized.pop("lm_head", None)
    if fastcpu.bf16_head_status()[0]:
        assert bf16 == expected and not dequantized
    else:
        assert set(dequantized) == set(expected)
        assert all(dequantized[n].startswith(f"{q} has no int4 kernel") for n, q in expected.items())
    # on the GGUF-block kernel, where it is built: those types' linears and the head
    assert info.get("interleaved", 0) + info.get("in_place", 0) == (len(on_kernel) + 1 if kernels.available() else 0)
    want = _logits(reference)
    torch.testing.assert_close(_logits(fast.module), want, rtol=1e-5, atol=1e-5)  # 8 rows > small_rows: exact
    few = _logits(fast.module, _IDS[:, :2])  # decode rows: bfloat16 where prepacked
    assert float((few - want[:, :2]).abs().max()) < 5e-2 * float(want.abs().max())
