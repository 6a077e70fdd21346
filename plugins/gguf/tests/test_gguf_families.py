"""GGUF files of the qwen3, gemma2, gemma3, phi3, qwen3moe, qwen2moe and Mixtral (llama) architectures, judged by llama.cpp.

``fixtures/<family>.Q4_K_M.gguf`` are tiny random models (hidden 256, 2-6 layers; the MoE ones 4 experts,
2 per token, which core's ``Experts`` runs one GGUF linear per expert) that llama.cpp's
own ``convert_hf_to_gguf.py`` converted and ``llama_model_quantize`` quantized to Q4_K_M (Q4_K, Q6_K
and F32 tensors); ``fixtures/<family>.json`` holds what llama.cpp (llama-cpp-python, version and
commit inside) computed from them: the logits of every prompt position, the greedy continuation
and the tokenization of a few strings. ``make_gguf_fixtures.py`` wrote both; nothing here runs
llama.cpp.

llama.cpp multiplies K-quant weights with 8-bit (Q8_K) activations and keeps the KV cache in
float16, anyquant's exact backends in float32: the logits agree within 2e-2 of the largest
|logit| (measured per family in ``MEASURED``), the greedy tokens exactly. Deliberate mistakes move them
far more: no -1 on Gemma's norms 2.06, no sliding window 0.19-0.24, Gemma 3's global RoPE on its sliding
layers 0.12, Gemma 2 without soft-capping 0.56, Phi-3's long instead of short factors 0.07.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

import anyquant
from anyquant_gguf.qlinear import GGUFEmbedding, GGUFLinear
from anyquant_gguf.reader import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedGGUFArchitecture,
    get_tensor,
    hf_config_from_gguf,
    hf_expert_names,
    hf_tensor_names,
    load_tensor,
    norm_offset,
    open_gguf,
)
from anyquant_runtime.tokenizer import LazyTokenizer, encode_text
from tests.decoding import logits_after_prompt

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "qwen3moe", "mixtral", "qwen2moe")
MOE = ("qwen3moe", "mixtral", "qwen2moe")
#: anyquant's exact backends vs llama.cpp: max |logit difference| / max |llama.cpp logit| must stay under this
LOGIT_TOL = 2e-2
#: max |logit difference| / max |llama.cpp logit| of the dequantized backend (packed: the same; cpu-fast within
#: 4e-4 of it) measured when the fixtures were written, for the record. The same size as what simulating
#: llama.cpp's Q8_K activations in torch moves the exact logits by: its rounding, not a different model.
MEASURED: dict[str, float] = {
    "qwen3": 1.03e-2,
    "gemma2": 1.31e-2,
    "gemma3": 0.97e-2,
    "phi3": 1.10e-2,
    "qwen3moe": 1.03e-2,
    "mixtral": 0.75e-2,
    "qwen2moe": 0.89e-2,
}
CLASSES = {
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),  # a "llama" GGUF with experts
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
}
#: tokenization cases (by index in the record) where anyquant's tokenizer is known to differ from llama.cpp's:
#: Mixtral's SentencePiece vocabulary goes to transformers' converter (``Metaspace``, ``prepend_scheme="first"``),
#: which adds no "▁" to a text that starts with a space, nor to the text after a special token; llama.cpp adds one
#: to every text fragment (as sentencepiece's ``add_dummy_prefix`` and Mistral's own tokenizer.json do). This is
#: the existing path of every SentencePiece "llama" file, kept as it is; the test fails once it changes.
KNOWN_TOKENIZER_DIFFERENCES: dict[str, frozenset[int]] = {"mixtral": frozenset({1, 2})}
#: the id of the lone "▁" token, the only one the known differences are about
_SPACE: dict[str, int] = {"mixtral": 423}


def _path(family: str) -> Path:
    return FIXTURES / f"{family}.Q4_K_M.gguf"


@cache
def _record(family: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{family}.json").read_text(encoding="utf-8"))
    return data


@cache
def _model(family: str, backend: str | None) -> Any:
    if backend is None:
        return anyquant.load(_path(family))
    return anyquant.load(_path(family), backend=backend)


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model.module(torch.tensor([ids])).logits[0].float()
    return out


def _greedy(model: Any, ids: list[int], n: int) -> list[int]:
    tokens: list[int] = model.generator.generate_ids(ids, model.params(max_new_tokens=n))
    return tokens


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max()) / float(ref.abs().max())


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module", autouse=True)
def _drop_models() -> Any:
    yield
    _model.cache_clear()  # the loaded models are shared by this module's tests only


def test_architectures_listed_alike() -> None:
    from anyquant_gguf.loader import SUPPORTED_ARCHITECTURES as LOADER_ARCHITECTURES

    assert LOADER_ARCHITECTURES == SUPPORTED_ARCHITECTURES
    assert {"qwen3", "gemma2", "gemma3", "phi3", "qwen3moe"} <= set(SUPPORTED_ARCHITECTURES)


def test_fixture_record(family: str) -> None:
    """The fixture is what the tests assume: llama.cpp's Q4_K_M of the family, a few hundred KB."""
    rec = _record(family)
    reader = open_gguf(_path(family))
    assert _path(family).stat().st_size < 2_000_000
    types = {t.tensor_type.name for t in reader.tensors}
    assert {"Q4_K", "Q6_K", "F32"} <= types <= {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "F32"}
    assert rec["ftype"] == "Q4_K_M" and rec["llama_cpp_python"]
    n_vocab = hf_config_from_gguf(reader)["vocab_size"]
    assert len(rec["logits"]) == len(rec["prompt_ids"]) and all(len(row) == n_vocab for row in rec["logits"])


def test_config_and_names(family: str) -> None:
    """The config builds the family's transformers class, and the GGUF tensors fill it exactly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    reader = open_gguf(_path(family))
    cfg = hf_config_from_gguf(reader)
    assert (cfg["model_type"], cfg["architectures"]) == (CLASSES[family][0], [CLASSES[family][1]])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    assert type(model).__name__ == CLASSES[family][1]
    names = hf_tensor_names(reader)
    state = model.state_dict()
    expected = {k for k in state if ".mlp.experts." not in k}  # the fused 3-D experts: one linear each below
    if cfg["tie_word_embeddings"]:
        expected.discard("lm_head.weight")
    assert set(names.values()) == expected
    for gguf_name, hf_name in names.items():  # (Qwen2-MoE's shared-expert gate: a GGUF vector, a one-row matrix in HF)
        assert tuple(load_tensor(reader, gguf_name).shape) == tuple(state[hf_name].shape), gguf_name
    experts = hf_expert_names(reader)
    if family not in MOE:
        assert not experts
        return
    n, layers = int(cfg.get("num_experts") or cfg["num_local_experts"]), cfg["num_hidden_layers"]
    assert len(experts) == 3 * n * layers
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, down = state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"]
        for e in range(n):
            for leaf, want in (("gate_proj", gate_up[e].chunk(2)[0]), ("up_proj", gate_up[e].chunk(2)[1])):
                gguf_name, index = experts[f"{prefix}.{e}.{leaf}.weight"]
                assert index == e and load_tensor(reader, gguf_name, expert=e).shape == want.shape
            assert load_tensor(reader, experts[f"{prefix}.{e}.down_proj.weight"][0], expert=e).shape == down[e].shape


def test_family_specifics(family: str) -> None:
    reader = open_gguf(_path(family))
    cfg = hf_config_from_gguf(reader)
    names = hf_tensor_names(reader)
    if family == "qwen3":
        assert names["blk.1.attn_q_norm.weight"] == "model.layers.1.self_attn.q_norm.weight"
        assert cfg["head_dim"] == 64 and cfg["attention_bias"] is False and cfg["tie_word_embeddings"] is True
    if family.startswith("gemma"):
        assert cfg["hidden_activation"] == "gelu_pytorch_tanh" and cfg["query_pre_attn_scalar"] == 64
        assert cfg["sliding_window"] == 8 and cfg["tie_word_embeddings"] is True
        assert names["blk.0.post_attention_norm.weight"] == "model.layers.0.post_attention_layernorm.weight"
        assert names["blk.0.ffn_norm.weight"] == "model.layers.0.pre_feedforward_layernorm.weight"
        assert names["blk.0.post_ffw_norm.weight"] == "model.layers.0.post_feedforward_layernorm.weight"
        # the converter stored w + 1 (HF's x * (1 + w)): loaded minus 1, every norm
        stored = torch.from_numpy(get_tensor(reader, "output_norm.weight").data.copy())
        assert norm_offset(reader, "output_norm.weight") == 1.0
        assert torch.equal(load_tensor(reader, "output_norm.weight"), stored - 1)
        assert norm_offset(reader, "blk.0.attn_q.weight") == 0.0
    if family == "gemma2":
        assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
        assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (5.0, 8.0)
    if family == "gemma3":
        assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
        assert names["blk.2.attn_k_norm.weight"] == "model.layers.2.self_attn.k_norm.weight"
        rope = cfg["rope_parameters"]
        assert rope["full_attention"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}
        assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
        assert cfg["final_logit_softcapping"] is None and cfg["attn_logit_softcapping"] is None
    if family == "phi3":
        assert names["blk.0.attn_qkv.weight"] == "model.layers.0.self_attn.qkv_proj.weight"
        assert names["blk.1.ffn_up.weight"] == "model.layers.1.mlp.gate_up_proj.weight"
        assert "rope_factors_long.weight" not in names and cfg["sliding_window"] is None
        rope = cfg["rope_parameters"]
        assert rope["rope_type"] == "longrope" and len(rope["short_factor"]) == len(rope["long_factor"]) == 32
        assert rope["original_max_position_embeddings"] == 256 and rope["attention_factor"] > 1.0
        assert cfg["tie_word_embeddings"] is False
    if family in MOE:
        assert names["blk.1.ffn_gate_inp.weight"] == "model.layers.1.mlp.gate.weight"
        assert not any("_exps" in n for n in names)
        experts = hf_expert_names(reader)
        gguf_name, e = experts["model.layers.1.mlp.experts.3.down_proj.weight"]
        assert (gguf_name, e) == ("blk.1.ffn_down_exps.weight", 3)
        whole = load_tensor(reader, gguf_name)  # [experts, out, in]
        assert torch.equal(load_tensor(reader, gguf_name, expert=3), whole[3])
    if family == "qwen3moe":
        assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (4, 2, 256)
        assert cfg["norm_topk_prob"] is True and cfg["mlp_only_layers"] == [] and cfg["decoder_sparse_step"] == 1
    if family == "qwen2moe":  # the shared expert and its one-row sigmoid gate; top-k weights not renormalized
        assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (4, 2, 256)
        assert cfg["norm_topk_prob"] is False and cfg["shared_expert_intermediate_size"] == 512
        assert cfg["qkv_bias"] is True and "attention_bias" not in cfg
        assert names["blk.0.ffn_gate_inp_shexp.weight"] == "model.layers.0.mlp.shared_expert_gate.weight"
        assert names["blk.1.ffn_down_shexp.weight"] == "model.layers.1.mlp.shared_expert.down_proj.weight"
        assert load_tensor(reader, "blk.0.ffn_gate_inp_shexp.weight").shape == (1, 256)
    if family == "mixtral":
        assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]) == (4, 2, 256)
        assert names["blk.0.attn_q.weight"] == "model.layers.0.self_attn.q_proj.weight"  # un-permuted: llama


def test_dequantized_matches_llama_cpp(family: str) -> None:
    """float32 dequantized weights: logits within 2e-2 of llama.cpp's largest, greedy tokens identical."""
    rec = _record(family)
    model = _model(family, "dequantized")
    assert (model.format, model.backend, model.detection.variant) == ("gguf", "dequantized", "Q4_K_M")
    ref = torch.tensor(rec["logits"])
    rel = _relative(_logits(model, rec["prompt_ids"]), ref)
    assert rel < LOGIT_TOL, rel
    assert _greedy(model, rec["prompt_ids"], len(rec["greedy"])) == rec["greedy"]


def test_packed_equals_dequantized(family: str) -> None:
    """The packed backend (K-quant linears dequantized per forward, packed embedding/tied head) gives the
    dequantized backend's logits within 1e-5, and llama.cpp's greedy tokens."""
    rec = _record(family)
    packed, exact = _model(family, "packed"), _model(family, "dequantized")
    assert packed.backend == "packed"
    linears = [m for m in packed.module.modules() if isinstance(m, GGUFLinear)]
    assert linears and all(m.mode == "on-the-fly" for m in linears)
    assert {m.qtype.name for m in linears} >= {"Q4_K", "Q6_K"}
    assert isinstance(packed.module.get_input_embeddings(), GGUFEmbedding)
    if family in MOE:  # transformers' fused experts replaced by one packed linear per expert (core's Experts)
        from anyquant_runtime.experts import Experts

        moe = [m for m in packed.module.modules() if isinstance(m, Experts)]
        assert len(moe) == 2 and all(isinstance(x.gate_proj, GGUFLinear) for m in moe for x in m)
    ours, want = _logits(packed, rec["prompt_ids"]), _logits(exact, rec["prompt_ids"])
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
    assert _greedy(packed, rec["prompt_ids"], len(rec["greedy"])) == rec["greedy"]


def test_default_backend(family: str) -> None:
    """The default load (cpu-fast where torch's int4 kernel runs: Q4_K linears in bfloat16 for short prompts,
    Q6_K ones bfloat16 prepacked where AMX/AVX512-BF16 runs it, else dequantized) stays within 5e-2 of llama.cpp's logits (measured: 1.1-1.3e-2, 2-3e-3 from the exact
    backend) and generates llama.cpp's greedy tokens up to the first near-tie: a step whose recorded top-2 margin is
    under 0.5% of the largest logit (gemma2's sixth, 0.24%), where bfloat16 rounding on another CPU may pick the
    other token (all 8 agree on the host that recorded them)."""
    from anyquant_cpu.engine import fast_cpu_capable

    rec = _record(family)
    model = _model(family, None)
    assert model.backend == ("cpu-fast" if fast_cpu_capable()[0] else "dequantized")
    ref = torch.tensor(rec["logits"])
    ours = _logits(model, rec["prompt_ids"])
    rel = _relative(ours, ref)
    assert rel < (5e-2 if model.backend == "cpu-fast" else LOGIT_TOL), rel
    assert float((ours.argmax(-1) == ref.argmax(-1)).float().mean()) > 0.9
    tokens = _greedy(model, rec["prompt_ids"], len(rec["greedy"]))
    scale = float(ref.abs().max())
    clear = next((i for i, m in enumerate(rec["greedy_margins"]) if m < 5e-3 * scale), len(rec["greedy"]))
    assert clear >= 4 and tokens[:clear] == rec["greedy"][:clear]


def test_tokenizer_matches_llama_cpp(family: str) -> None:
    """anyquant's tokenizer from the GGUF metadata encodes as llama.cpp does; the chat template is the file's."""
    rec = _record(family)
    tok = _model(family, "dequantized").tokenizer
    # Qwen's byte-level BPE is built here, lazily; the SentencePiece vocabularies by transformers' converter
    assert isinstance(tok, LazyTokenizer) == family.startswith("qwen"), type(tok)
    known = KNOWN_TOKENIZER_DIFFERENCES.get(family, frozenset())
    # first as the runtime encodes (a byte-level vocabulary's LazyTokenizer: without transformers' wrapper), then
    # through transformers' tokenizer (which a LazyTokenizer builds for the chat template)
    for encode in (encode_text, lambda t, text, **kw: t(text, **kw)["input_ids"]):
        for index, case in enumerate(rec["tokenize"]):
            # special: llama.cpp parses special tokens and adds no BOS (the template writes its own); otherwise
            # it adds BOS as the file says
            ids = encode(tok, case["text"], add_special_tokens=not case["special"])
            if index in known:
                assert ids != case["ids"] and [t for t in case["ids"] if t != _SPACE[family]] == [
                    t for t in ids if t != _SPACE[family]
                ], case["text"]
                continue
            assert ids == case["ids"], case["text"]
        assert tok.decode(rec["tokenize"][0]["ids"], skip_special_tokens=True).strip() == rec["tokenize"][0]["text"]
        assert tok.chat_template == rec["chat_template"]
        rendered = tok.apply_chat_template(rec["chat_messages"], tokenize=False, add_generation_prompt=True)
        assert rendered == rec["tokenize"][-1]["text"]


# --------------------------------------------------------------------------- metadata edge cases (synthetic files)


def _write(path: Path, arch: str, meta: dict[str, Any], tensors: tuple[str, ...] = ()) -> Any:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    base: dict[str, Any] = {
        "block_count": 6,
        "context_length": 128,
        "embedding_length": 32,
        "feed_forward_length": 64,
        "attention.head_count": 2,
        "attention.layer_norm_rms_epsilon": 1e-6,
    }
    for key, value in {**base, **meta}.items():
        full = f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_array(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, bool):
            writer.add_bool(full, value)
        else:
            writer.add_uint32(full, value)
    writer.add_tensor("token_embd.weight", np.ones((16, 32), np.float32))
    for name in tensors:
        writer.add_tensor(name, np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return open_gguf(path)


def test_gemma3_sliding_window_metadata(tmp_path: Path) -> None:
    """No sliding window: every layer global; a pattern period or per-layer array: as llama.cpp reads them."""
    cfg = hf_config_from_gguf(_write(tmp_path / "a.gguf", "gemma3", {}))
    assert cfg["sliding_window"] is None and cfg["layer_types"] == ["full_attention"] * 6
    assert cfg["head_dim"] == 16 and cfg["query_pre_attn_scalar"] == 16  # hidden / heads, llama.cpp's defaults
    meta: dict[str, Any] = {
        "attention.sliding_window": 512,
        "attention.sliding_window_pattern": 3,
        "rope.freq_base_swa": 5000.0,
    }
    cfg = hf_config_from_gguf(_write(tmp_path / "b.gguf", "gemma3", meta))
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert cfg["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 5000.0}
    pattern = [True, False, True, True, False, False]
    meta = {"attention.sliding_window": 512, "attention.sliding_window_pattern": pattern}
    cfg = hf_config_from_gguf(_write(tmp_path / "c.gguf", "gemma3", meta))
    assert cfg["layer_types"] == ["sliding_attention" if p else "full_attention" for p in pattern]
    with pytest.raises(UnsupportedGGUFArchitecture, match="sliding_window_pattern"):
        hf_config_from_gguf(_write(tmp_path / "d.gguf", "gemma3", {**meta, "attention.sliding_window_pattern": [True]}))


def test_gemma2_defaults_and_refusals(tmp_path: Path) -> None:
    cfg = hf_config_from_gguf(_write(tmp_path / "a.gguf", "gemma2", {"block_count": 46}))
    # llama.cpp's defaults: window 4096, every other layer sliding, soft-caps 50 / 30; the 27B query scale
    assert cfg["sliding_window"] == 4096 and cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (50.0, 30.0)
    assert cfg["query_pre_attn_scalar"] == 16
    with pytest.raises(UnsupportedGGUFArchitecture, match="sliding-window RoPE base"):
        hf_config_from_gguf(_write(tmp_path / "b.gguf", "gemma2", {"rope.freq_base_swa": 5000.0}))


def test_phi3_rope_refusals_and_unknown_tensors(tmp_path: Path) -> None:
    reader = _write(tmp_path / "a.gguf", "phi3", {"rope.dimension_count": 8}, ("rope_factors_long.weight",))
    with pytest.raises(UnsupportedGGUFArchitecture, match="only one of"):
        hf_config_from_gguf(reader)
    cfg = hf_config_from_gguf(_write(tmp_path / "b.gguf", "phi3", {"rope.dimension_count": 8}))
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    reader = _write(tmp_path / "c.gguf", "qwen3", {}, ("blk.0.attn_qkv.weight",))
    with pytest.raises(UnsupportedGGUFArchitecture, match=r"attn_qkv.*'qwen3'"):
        hf_tensor_names(reader)


@pytest.mark.parametrize("name", ["qwen3", "qwen3moe"])
def test_cpu_fast_k_quant_linears_are_bfloat16(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the block kernel does not take K-quants (not built here), a Q4_K_M file's Q6_K linears (``attn_v``, some
    ``ffn_down``; per-expert ones in the MoE file) run on cpu-fast as bfloat16 prepacked for oneDNN: the weight is the
    file's dequantized weight rounded to bfloat16, bit for bit, held at 2 bytes a weight with no float32 copy beside
    it. Host-dependent: AMX / AVX512-BF16 (else float32). (Where it is built they run on it:
    test_gguf_kquant_kernel.py.)"""
    from anyquant_cpu.engine import PrepackedBf16Linear, bf16_head_status
    from anyquant_gguf import qlinear as gguf_qlinear

    ok, reason = bf16_head_status()
    if not ok:
        pytest.skip(f"bfloat16 prepacked linears need AMX or AVX512-BF16: {reason}")
    for qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
        monkeypatch.delitem(gguf_qlinear.BLOCK_KERNEL_TYPES, qtype)
    model = _model(name, "cpu-fast")
    bf16 = model.info["cpu_fast"]["bf16"]
    assert bf16 and set(bf16.values()) == {"Q6_K"} and not model.info["cpu_fast"]["dequantized"]
    assert any(".v_proj" in n for n in bf16) and any(".down_proj" in n for n in bf16)
    if name in MOE:
        assert any(".experts." in n for n in bf16)
    for n in bf16:
        layer = model.module.get_submodule(n)
        assert isinstance(layer, PrepackedBf16Linear) and isinstance(layer.source, GGUFLinear), n
        assert layer.source.weight_cache is None  # no resident float32 copy
        assert layer.packed_bytes() == 2 * layer.in_features * layer.out_features
        # the identity's product holds each weight once (one nonzero term per output): the packed weight, exactly
        eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._linear_pointwise(eye, layer.packed, None, "none", [], "")
        assert torch.equal(packed.T, layer.source.dequantize().to(torch.bfloat16)), n


@pytest.mark.parametrize("name", ["qwen3", "qwen3moe"])
def test_cpu_fast_decode_step_compiles_q4_k_m_layers(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the block kernel does not take K-quants, a Q4_K_M file's layers mix Q4_K (int4) and Q6_K (bfloat16
    prepacked) linears, and its MoE experts mix them too (gate/up int4, down bfloat16): every layer runs in the
    compiled decode step (a layer with a bfloat16 linear by the ``mixed`` / ``mixed_moe`` function), with bitwise the
    module path's logits (the same kernels on the same tensors in the same order), one row and a batch, and
    llama.cpp's greedy tokens (test_default_backend's)."""
    from anyquant_cpu.engine import FastInt4Linear, PrepackedBf16Linear, bf16_head_status
    from anyquant_cpu.step import DecodeStep, compiled_layer
    from anyquant_gguf import qlinear as gguf_qlinear

    ok, reason = bf16_head_status()
    if not ok:
        pytest.skip(f"bfloat16 prepacked linears need AMX or AVX512-BF16: {reason}")
    for qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
        monkeypatch.delitem(gguf_qlinear.BLOCK_KERNEL_TYPES, qtype)
    model = _model(name, "cpu-fast")
    layers = model.module.model.layers
    linears = (FastInt4Linear, PrepackedBf16Linear)
    int4 = [{isinstance(m, FastInt4Linear) for m in layer.modules() if isinstance(m, linears)} for layer in layers]
    mixed = [kinds == {True, False} for kinds in int4]
    assert any(mixed) and not all(mixed), int4  # layers of int4 and bfloat16 linears, and layers of int4 only
    rec = _record(name)
    ids = torch.tensor([rec["prompt_ids"]])
    for batch in (ids, torch.cat([ids, ids.flip(1), ids.roll(3, 1)])):
        prompt = 8
        with torch.no_grad():
            model.module.__dict__.pop("_step", None)
            fast = logits_after_prompt(model, batch, prompt)
            step = model.module.__dict__["_step"]
            assert isinstance(step, DecodeStep) and all(planned is not None for planned in step.layers)
            moe = "_moe" if name in MOE else ""
            for planned, is_mixed in zip(step.layers, mixed, strict=True):
                assert planned[0] is compiled_layer(("mixed" if is_mixed else "int4") + moe)
            model.module.__dict__["_step"] = None  # the module path
            assert torch.equal(logits_after_prompt(model, batch, prompt), fast)
    model.module.__dict__.pop("_step", None)
    want = rec["greedy"]
    assert _greedy(model, rec["prompt_ids"], len(want)) == want
