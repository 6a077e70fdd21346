"""Issue #44 item 6: non-finite weights that loaded. A NaN or inf float16 scale in one block of a Q4_0 (Q8_0,
Q4_1, K-quant, ...) tensor loaded on every backend and gave finite, wrong logits (cpu-fast) or NaN ones at generate;
an F32 linear with 13 non-finite values loaded and failed only on a long prompt. Each is now a
:class:`~anyquant.errors.NumericalError` at ``anyquant.load`` naming the tensor, on every backend (SECURITY.md,
"Non-finite weights are refused at load")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

import anyquant
from anyquant.errors import NumericalError

BACKENDS = ("dequantized", "packed", "cpu-fast")
_HIDDEN, _FFN, _HEADS, _KV, _VOCAB = 256, 256, 4, 2, 96
#: float16 bit patterns
_NAN, _INF, _NEG_INF, _SCALE = 0x7E00, 0x7C00, 0xFC00, 0x2000  # 0x2000: 2^-7, a plausible scale
#: GGUF name -> HF name of the tensors a case corrupts
_HF = {
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
}


def _blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, bytes_per_row]`` uint8: gguf's quantizer where it has one, else random codes under finite scales."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        return quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * cols // block, type_size), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[qtype]:
        data[:, offset : offset + 2] = np.array([_SCALE], "<u2").view(np.uint8)
    return data.reshape(rows, -1)


#: byte offsets of each type's float16 scales (d, then m/dmin)
_SCALE_OFFSETS = {
    Q.Q4_0: (0,),
    Q.Q8_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_1: (0, 2),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q6_K: (208,),
    Q.IQ4_XS: (0,),
}


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    """A one-layer Llama; ``tensors`` (GGUF name -> (array, type)) replace the default ones (Q8_0 linears, F32
    norms, a Q8_0 embedding and head). Arrays of a quantized type are its raw blocks; F32 ones are values."""
    rng = np.random.default_rng(0)
    head_dim = _HIDDEN // _HEADS
    shapes = {
        "attn_q": (_HIDDEN, _HIDDEN),
        "attn_k": (_KV * head_dim, _HIDDEN),
        "attn_v": (_KV * head_dim, _HIDDEN),
        "attn_output": (_HIDDEN, _HIDDEN),
        "ffn_gate": (_FFN, _HIDDEN),
        "ffn_up": (_FFN, _HIDDEN),
        "ffn_down": (_HIDDEN, _FFN),
    }
    plan: dict[str, tuple[np.ndarray, Q]] = {"token_embd.weight": (_blocks(Q.Q8_0, _VOCAB, _HIDDEN, rng), Q.Q8_0)}
    for short, (rows, cols) in shapes.items():
        plan[f"blk.0.{short}.weight"] = (_blocks(Q.Q8_0, rows, cols, rng), Q.Q8_0)
    for norm in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        plan[norm] = (np.ones(_HIDDEN, np.float32), Q.F32)
    plan["output.weight"] = (_blocks(Q.Q8_0, _VOCAB, _HIDDEN, rng), Q.Q8_0)
    plan.update(tensors)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(_HIDDEN)
    writer.add_feed_forward_length(_FFN)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_KV)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(_VOCAB)
    for name, (array, qtype) in plan.items():
        if qtype == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, np.float32))
        else:
            writer.add_tensor(name, np.ascontiguousarray(array), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load(path: Path, backend: str) -> Any:
    from anyquant_gguf.loader import GGUFLoader

    if backend == "cpu-fast":
        from anyquant_cpu.engine import fast_cpu_capable

        ok, reason = fast_cpu_capable()
        if not ok:
            pytest.skip(reason)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GGUFLoader, "tokenizer", lambda self, probe, options: None)  # no vocabulary in the file
        return anyquant.load(path, backend=backend, device="cpu")


def _corrupt(blocks: np.ndarray, qtype: Q, block: int, offset: int, bits: int) -> np.ndarray:
    """``blocks`` with the float16 at byte ``offset`` of block ``block`` set to ``bits``."""
    out = blocks.copy()
    flat = out.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    flat[block, offset : offset + 2] = np.array([bits], "<u2").view(np.uint8)
    return out


_SCALE_CASES = [
    # (GGUF tensor, type, which scale's offset, bit pattern)
    ("blk.0.ffn_gate.weight", Q.Q4_0, 0, _NAN),
    ("blk.0.ffn_gate.weight", Q.Q4_0, 0, _INF),
    ("blk.0.ffn_gate.weight", Q.Q8_0, 0, _NAN),
    ("blk.0.ffn_gate.weight", Q.Q8_0, 0, _NEG_INF),
    ("blk.0.ffn_gate.weight", Q.Q4_1, 0, _INF),  # d
    ("blk.0.ffn_gate.weight", Q.Q4_1, 2, _NAN),  # m
    ("blk.0.ffn_gate.weight", Q.Q4_K, 0, _NAN),  # d
    ("blk.0.ffn_gate.weight", Q.Q4_K, 2, _INF),  # dmin
    ("blk.0.ffn_gate.weight", Q.Q6_K, 208, _NAN),
    ("blk.0.ffn_gate.weight", Q.Q2_K, 82, _INF),  # dmin, at the end of the block
    ("blk.0.attn_q.weight", Q.Q4_0, 0, _NAN),  # permuted Q rows (cpu-fast reads them as stored)
    ("token_embd.weight", Q.Q8_0, 0, _NAN),  # kept packed by packed and cpu-fast
    ("output.weight", Q.Q8_0, 0, _INF),  # cpu-fast's head on the block kernel
]


@pytest.fixture(scope="module")
def scale_files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, Q, int, int], Path]:
    root = tmp_path_factory.mktemp("non-finite")
    rng = np.random.default_rng(1)
    files = {}
    for i, (name, qtype, offset, bits) in enumerate(_SCALE_CASES):
        rows = _VOCAB if name in ("token_embd.weight", "output.weight") else _FFN if "ffn" in name else _HIDDEN
        blocks = _blocks(qtype, rows, _HIDDEN, rng)
        bad = _corrupt(blocks, qtype, 5, offset, bits)  # one block, past the first row's (row 0 has 8 Q4_0 blocks)
        files[name, qtype, offset, bits] = _write(root / f"case{i}.gguf", {name: (bad, qtype)})
    return files


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case", _SCALE_CASES, ids=[f"{n.split('.')[-2]}-{q.name}-at{o}-{b:04x}" for n, q, o, b in _SCALE_CASES]
)
def test_a_non_finite_block_scale_is_refused_at_load(
    scale_files: dict[tuple[str, Q, int, int], Path], case: tuple[str, Q, int, int], backend: str
) -> None:
    name = case[0]
    hf = _HF[name].replace(".", r"\.")
    with pytest.raises(NumericalError, match=rf"'{hf}'.*(NaN|inf)"):
        _load(scale_files[case], backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_f32_linear_with_13_non_finite_values_is_refused_at_load(tmp_path: Path, backend: str) -> None:
    rng = np.random.default_rng(2)
    weight = (rng.standard_normal((_FFN, _HIDDEN)) * 0.05).astype(np.float32)
    spots = rng.choice(weight.size, 13, replace=False)
    weight.reshape(-1)[spots[:7]] = np.nan
    weight.reshape(-1)[spots[7:]] = np.inf
    path = _write(tmp_path / "f32.gguf", {"blk.0.ffn_gate.weight": (weight, Q.F32)})
    with pytest.raises(NumericalError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' holds 7 NaN, 6 inf"):
        _load(path, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_extreme_scales_still_load(tmp_path: Path, backend: str) -> None:
    """The largest finite float16 scale (65504) and subnormal ones are not refused: only NaN and +-inf are."""
    rng = np.random.default_rng(3)
    blocks = _corrupt(_blocks(Q.Q4_0, _FFN, _HIDDEN, rng), Q.Q4_0, 5, 0, 0x7BFF)
    blocks = _corrupt(blocks, Q.Q4_0, 6, 0, 0x0001)
    path = _write(tmp_path / "edge.gguf", {"blk.0.ffn_gate.weight": (blocks, Q.Q4_0)})
    model = _load(path, backend)
    with torch.no_grad():
        logits = model.module(torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, _VOCAB)


def test_check_finite_blocks_covers_every_scaled_type() -> None:
    """Every block type with a float16 (or E8M0) scale: a NaN or inf one in any block is found, named, counted."""
    from anyquant_gguf.dequant import _F16_SCALE_HIGH_BYTES, check_finite_blocks

    rng = np.random.default_rng(4)
    for qtype, scales in _F16_SCALE_HIGH_BYTES.items():
        type_size = GGML_QUANT_SIZES[qtype][1]
        blocks = rng.integers(0, 256, (40, type_size), dtype=np.uint8)
        for _, high in scales:
            blocks[:, high] &= 0x83  # every exponent cleared of its top bits: finite
        check_finite_blocks("w", torch.from_numpy(blocks.reshape(-1)), qtype)
        for _, high in scales:
            bad = blocks.copy()
            bad[[3, 17], high] |= 0x7C
            with pytest.raises(NumericalError, match=rf"'w' \({qtype.name}\) holds 2 block\(s\) of its 40.*block 3"):
                check_finite_blocks("w", torch.from_numpy(bad.reshape(-1)), qtype)
    iq1m = np.zeros((4, GGML_QUANT_SIZES[Q.IQ1_M][1]), np.uint8)
    check_finite_blocks("w", torch.from_numpy(iq1m.reshape(-1)), Q.IQ1_M)
    iq1m[2, 53], iq1m[2, 55] = 0xC0, 0x70  # d's high byte 0x7C: inf
    with pytest.raises(NumericalError, match=r"IQ1_M\) holds 1 block"):
        check_finite_blocks("w", torch.from_numpy(iq1m.reshape(-1)), Q.IQ1_M)
    mxfp4 = np.full((3, 17), 0x7F, np.uint8)
    check_finite_blocks("w", torch.from_numpy(mxfp4.reshape(-1)), Q.MXFP4)
    mxfp4[1, 0] = 0xFF
    with pytest.raises(NumericalError, match="e8m0 scale"):
        check_finite_blocks("w", torch.from_numpy(mxfp4.reshape(-1)), Q.MXFP4)
