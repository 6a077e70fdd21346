"""anyquant_gguf.reader: config, names, tensors and tokenizer vs transformers."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from anyquant_gguf.qlinear import dequantize_blocks_torch
from anyquant_gguf.reader import (
    UnsupportedGGUFArchitecture,
    UnsupportedGGUFType,
    hf_config_from_gguf,
    hf_tensor_names,
    load_raw,
    load_tensor,
    open_gguf,
    tensor_type_name,
    tokenizer_from_gguf,
    unpermute_qk_rows,
)

CONFIG_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "head_dim",
    "attention_bias",
)


def _shares_mmap(tensor: torch.Tensor, reader: Any) -> bool:
    start = reader.data.ctypes.data
    return start <= tensor.data_ptr() < start + reader.data.nbytes


# --------------------------------------------------------------------------- real model


@pytest.mark.model
def test_config_matches_transformers(reader: Any, hf_gguf_model: Any) -> None:
    ours = hf_config_from_gguf(reader)
    theirs = hf_gguf_model.config
    for field in CONFIG_FIELDS:
        assert ours[field] == getattr(theirs, field), field
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"] == 100000.0
    assert ours["rope_parameters"] == dict(theirs.rope_parameters)


@pytest.mark.model
def test_config_builds_equal_llama_config(reader: Any, hf_gguf_model: Any) -> None:
    from transformers import AutoConfig

    cfg = hf_config_from_gguf(reader)
    built = AutoConfig.for_model(**cfg)
    for field in CONFIG_FIELDS:
        assert getattr(built, field) == getattr(hf_gguf_model.config, field), field
    assert built.rope_parameters == hf_gguf_model.config.rope_parameters


@pytest.mark.model
def test_tensor_types_of_real_file(reader: Any) -> None:
    counts = collections.Counter(tensor_type_name(reader, t.name) for t in reader.tensors)
    assert counts == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert tensor_type_name(reader, "token_embd.weight") == "Q8_0"
    assert tensor_type_name(reader, "blk.0.ffn_down.weight") == "Q4_1"


@pytest.mark.model
def test_names_cover_transformers_state_dict(reader: Any, hf_gguf_model: Any) -> None:
    names = hf_tensor_names(reader)
    assert names["token_embd.weight"] == "model.embed_tokens.weight"
    assert names["blk.7.attn_q.weight"] == "model.layers.7.self_attn.q_proj.weight"
    assert names["blk.29.ffn_norm.weight"] == "model.layers.29.post_attention_layernorm.weight"
    assert names["output_norm.weight"] == "model.norm.weight"
    assert len(names) == len(reader.tensors) == 272
    # the real file ties the LM head: no output.weight, lm_head comes from the embedding
    assert set(hf_gguf_model.state_dict()) - set(names.values()) == {"lm_head.weight"}


@pytest.mark.model
def test_every_tensor_equals_transformers(reader: Any, hf_gguf_model: Any) -> None:
    state = hf_gguf_model.state_dict()
    names = hf_tensor_names(reader)
    for gguf_name, hf_name in names.items():
        ours = load_tensor(reader, gguf_name, dtype=torch.float32)
        assert ours.dtype == torch.float32
        assert torch.equal(ours, state[hf_name]), gguf_name
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


@pytest.mark.model
def test_load_tensor_dtype(reader: Any) -> None:
    fp32 = load_tensor(reader, "blk.0.attn_v.weight")
    half = load_tensor(reader, "blk.0.attn_v.weight", dtype=torch.float16)
    assert half.dtype == torch.float16 and half.shape == fp32.shape == (192, 576)
    assert torch.equal(half, fp32.to(torch.float16))


@pytest.mark.model
def test_load_raw_is_zero_copy_and_permuted(reader: Any) -> None:
    up = load_raw(reader, "blk.3.ffn_up.weight")
    assert up.qtype == Q.Q4_1 and up.shape == (1536, 576)
    assert up.data.dtype == torch.uint8 and tuple(up.data.shape) == (1536, 576 // 32 * 20)
    assert _shares_mmap(up.data, reader)
    for name in ("blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.3.ffn_up.weight"):
        raw = load_raw(reader, name)
        assert torch.equal(dequantize_blocks_torch(raw.data, raw.qtype, raw.shape), load_tensor(reader, name))
    assert not _shares_mmap(load_raw(reader, "blk.3.attn_q.weight").data, reader)


@pytest.mark.model
def test_tokenizer_from_gguf(gguf_path: Path, reader: Any) -> None:
    tok = tokenizer_from_gguf(gguf_path)
    cfg = hf_config_from_gguf(reader)
    assert tok.bos_token_id == cfg["bos_token_id"] and tok.eos_token_id == cfg["eos_token_id"]
    assert len(tok) == cfg["vocab_size"]
    text = "Hello, GGUF world!"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- permutation


@pytest.mark.parametrize(("n_head", "n_kv"), [(4, 4), (4, 2), (9, 3)])
def test_unpermute_inverts_llama_cpp(n_head: int, n_kv: int, llama_cpp_permute: Callable[..., np.ndarray]) -> None:
    head_dim = 8
    for heads, kv in ((n_head, None), (n_head, n_kv)):
        rows = (kv or heads) * head_dim
        weight = np.random.default_rng(0).standard_normal((rows, 5)).astype(np.float32)
        permuted = torch.from_numpy(llama_cpp_permute(weight, heads, kv))
        assert torch.equal(unpermute_qk_rows(permuted, kv or heads), torch.from_numpy(weight))
        bias = torch.from_numpy(llama_cpp_permute(weight[:, 0].copy(), heads, kv))
        assert torch.equal(unpermute_qk_rows(bias, kv or heads), torch.from_numpy(weight[:, 0]))


def test_unpermute_row_rule() -> None:
    """GGUF row 2*i + p of a head holds HF row p*head_dim/2 + i."""
    gguf_rows = torch.arange(16)  # 2 heads of 8
    hf = unpermute_qk_rows(gguf_rows, 2)
    assert hf.tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    with pytest.raises(ValueError, match="heads"):
        unpermute_qk_rows(torch.arange(10), 2)


# --------------------------------------------------------------------------- synthetic files


def test_tiny_llama_roundtrip(tiny_llama: tuple[Path, torch.nn.Module]) -> None:
    from gguf.quants import dequantize, quantize
    from transformers import LlamaConfig, LlamaForCausalLM

    path, original = tiny_llama
    reader = open_gguf(path)
    cfg = hf_config_from_gguf(reader)
    assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is False
    names = hf_tensor_names(reader)
    assert names["output.weight"] == "lm_head.weight"
    state = {names[n]: load_tensor(reader, n) for n in names}
    for hf_name, value in original.state_dict().items():
        qtype = getattr(Q, tensor_type_name(reader, next(g for g, h in names.items() if h == hf_name)))
        expected = value.float()
        if qtype == Q.F16:
            expected = expected.half().float()
        elif qtype != Q.F32:  # quantized: unpermuted layers only, so HF orientation == GGUF
            expected = torch.from_numpy(dequantize(quantize(expected.numpy(), qtype), qtype))
        assert torch.equal(state[hf_name], expected), hf_name  # Q/K are F32: exact un-permutation
    ours = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    ours.load_state_dict(state, strict=True)
    reference = LlamaForCausalLM(original.config).eval()
    reference.load_state_dict(state, strict=True)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 11]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-6)


def test_tiny_llama_matches_transformers_loader(tiny_llama: tuple[Path, torch.nn.Module]) -> None:
    from transformers import AutoModelForCausalLM

    path, _ = tiny_llama
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    reader = open_gguf(path)
    state = theirs.state_dict()
    for gguf_name, hf_name in hf_tensor_names(reader).items():
        assert torch.equal(load_tensor(reader, gguf_name), state[hf_name]), gguf_name
    cfg = hf_config_from_gguf(reader)
    for field in CONFIG_FIELDS:
        assert cfg.get(field) == getattr(theirs.config, field), field


def test_tiny_qwen2(tiny_qwen2: tuple[Path, torch.nn.Module]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    path, original = tiny_qwen2
    reader = open_gguf(path)
    cfg = hf_config_from_gguf(reader)
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["attention_bias"] is True and cfg["tie_word_embeddings"] is True
    assert "head_dim" not in cfg and cfg["rope_theta"] == 1000000.0
    names = hf_tensor_names(reader)
    assert names["blk.1.attn_q.bias"] == "model.layers.1.self_attn.q_proj.bias"
    state = {names[n]: load_tensor(reader, n) for n in names}
    expected = original.state_dict()
    for hf_name, value in state.items():
        assert torch.equal(value, expected[hf_name]), hf_name  # no Q/K permutation for qwen2
    ours = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-6)
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    for hf_name, value in state.items():
        assert torch.equal(value, theirs.state_dict()[hf_name]), hf_name


def _base_metadata() -> dict[str, Any]:
    return {
        "{arch}.block_count": 1,
        "{arch}.context_length": 64,
        "{arch}.embedding_length": 32,
        "{arch}.feed_forward_length": 64,
        "{arch}.attention.head_count": 2,
        "{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "{arch}.rope.freq_base": 500000.0,
    }


def _embedding() -> dict[str, tuple[np.ndarray, Q]]:
    return {"token_embd.weight": (np.ones((16, 32), np.float32), Q.F32)}


def test_unsupported_architecture(make_gguf: Callable[..., Path]) -> None:
    path = make_gguf("gpt2.gguf", "gpt2", _base_metadata(), _embedding())
    reader = open_gguf(path)
    with pytest.raises(UnsupportedGGUFArchitecture, match=r"'gpt2'.*llama, qwen2"):
        hf_config_from_gguf(reader)
    with pytest.raises(UnsupportedGGUFArchitecture, match="gpt2"):
        hf_tensor_names(reader)
    assert issubclass(UnsupportedGGUFArchitecture, ValueError)


def test_unknown_tensor_name(make_gguf: Callable[..., Path]) -> None:
    tensors = {**_embedding(), "blk.0.ffn_gate_exps.weight": (np.ones((4, 32), np.float32), Q.F32)}
    reader = open_gguf(make_gguf("moe.gguf", "llama", _base_metadata(), tensors))
    with pytest.raises(UnsupportedGGUFArchitecture, match="ffn_gate_exps"):
        hf_tensor_names(reader)


def test_unsupported_tensor_type(make_gguf: Callable[..., Path]) -> None:
    from gguf import GGUFWriter

    path = make_gguf("q1.gguf", "llama", _base_metadata(), _embedding())
    raw = np.random.default_rng(0).integers(0, 255, (4, 18), dtype=np.uint8)  # 4 x 128 Q1_0 (no dequantizer yet)
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=Q.Q1_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = open_gguf(path)
    assert tensor_type_name(reader, "blk.0.ffn_up.weight") == "Q1_0"
    with pytest.raises(UnsupportedGGUFType, match="Q1_0"):
        load_tensor(reader, "blk.0.ffn_up.weight")
    with pytest.raises(UnsupportedGGUFType, match="Q1_0"):
        load_raw(reader, "blk.0.ffn_up.weight")
    with pytest.raises(KeyError, match="nope"):
        load_tensor(reader, "nope.weight")


def test_ggml_tables_are_ggufs() -> None:
    """The plugin's own type tables (the ``gguf`` package is not imported to load a file) equal gguf's: every
    storage and value type by name and id, and every block size but Q8_1's (gguf says 40 bytes where ggml's
    ``block_q8_1`` is 36; no file stores Q8_1)."""
    import gguf

    from anyquant_gguf import ggml

    assert [(t.name, t.value) for t in ggml.GGMLQuantizationType] == [(t.name, t.value) for t in Q]
    assert [(t.name, t.value) for t in ggml.GGUFValueType] == [(t.name, t.value) for t in gguf.GGUFValueType]
    theirs = {t.name: size for t, size in gguf.GGML_QUANT_SIZES.items()}
    ours = {t.name: size for t, size in ggml.GGML_QUANT_SIZES.items()}
    assert ours.pop("Q8_1") == (32, 36) and theirs.pop("Q8_1") == (32, 40)
    assert ours == theirs
    assert ggml.GGMLQuantizationType.Q4_0 == Q.Q4_0 and {Q.Q4_0: 1}[ggml.GGMLQuantizationType.Q4_0] == 1


def test_open_gguf_bad_files_raise_typed_errors(make_gguf: Callable[..., Path], tmp_path: Path) -> None:
    """A truncated header and a tensor of a type id anyquant does not know: typed errors naming the problem,
    not numpy's or struct's."""
    from anyquant.errors import HeaderError

    path = make_gguf("ok.gguf", "llama", _base_metadata(), {**_embedding(), **_q4_0_up()})
    blob = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(blob[:200])
    with pytest.raises(HeaderError, match="past the end"):
        open_gguf(cut)
    name = b"blk.0.ffn_up.weight"
    at = blob.index(name) + len(name) + 4 + 2 * 8  # name, n_dims, two dims: the type id
    assert int.from_bytes(blob[at : at + 4], "little") == Q.Q4_0
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(blob[:at] + (42).to_bytes(4, "little") + blob[at + 4 :])
    with pytest.raises(UnsupportedGGUFType, match=r"'blk\.0\.ffn_up\.weight' has GGML type id 42"):
        open_gguf(odd)


@pytest.mark.parametrize(
    "strings",
    [
        [f"tok{i}" for i in range(100)],
        ["", "Ġthe", "é", "日本", "", "a b", *map(str, range(95))],  # empty and multi-byte strings
        ["a\0b", *map(str, range(99)), "\0"],  # NULs inside strings: decoded one at a time
    ],
    ids=["ascii", "utf8", "nul"],
)
def test_long_string_arrays_decode_as_written(tmp_path: Path, strings: list[str]) -> None:
    """A long string array (a vocabulary: walked by the header parser, decoded on request in one piece) gives
    back what was written, as gguf's reader does."""
    from gguf import GGUFReader, GGUFWriter

    path = tmp_path / "s.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", strings)
    writer.add_array("test.ints", list(range(300)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fields = open_gguf(path).fields
    assert fields["test.strings"].contents() == strings == GGUFReader(str(path)).fields["test.strings"].contents()
    assert fields["test.strings"].count == len(strings)
    assert fields["test.ints"].contents() == list(range(300))


def test_bad_utf8_in_a_long_string_array(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "s.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", [f"t{i:03d}" for i in range(100)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    blob = path.read_bytes()
    path.write_bytes(blob.replace(b"t050", b"t\xff50"))
    with pytest.raises(UnicodeDecodeError):
        open_gguf(path).fields["test.strings"].contents()


def _q4_0_up() -> dict[str, tuple[np.ndarray, Any]]:
    return {"blk.0.ffn_up.weight": (np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32), Q.Q4_0)}


def _llama3_factors(head_dim: int, theta: float, factor: float) -> np.ndarray:
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs(make_gguf: Callable[..., Path]) -> None:
    meta = {**_base_metadata(), "{arch}.context_length": 131072, "{arch}.rope.dimension_count": 16}
    factors = _llama3_factors(16, 500000.0, 8.0)
    tensors = {**_embedding(), "rope_freqs.weight": (factors, Q.F32)}
    reader = open_gguf(make_gguf("l3.gguf", "llama", meta, tensors))
    rope = hf_config_from_gguf(reader)["rope_parameters"]
    assert rope == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    assert "rope_freqs.weight" not in hf_tensor_names(reader)
    bad = {**_embedding(), "rope_freqs.weight": (factors[::-1].copy(), Q.F32)}
    with pytest.raises(UnsupportedGGUFArchitecture, match="rope_freqs"):
        hf_config_from_gguf(open_gguf(make_gguf("bad.gguf", "llama", meta, bad)))


def test_linear_rope_scaling_and_vocab_fallback(make_gguf: Callable[..., Path]) -> None:
    meta = {**_base_metadata(), "{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 4.0}
    cfg = hf_config_from_gguf(open_gguf(make_gguf("lin.gguf", "llama", meta, _embedding())))
    assert cfg["rope_parameters"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}
    assert cfg["vocab_size"] == 16  # no vocab_size key, no tokens: from token_embd
    assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is True
    from transformers import LlamaConfig

    assert LlamaConfig(**cfg).rope_parameters["factor"] == 4.0
