"""anyquant's native Llama-family decoder against transformers' classes: same logits, same greedy tokens, same
batches with padding, the same KV-cache steps; which configs it takes; and that loading with it imports no
transformers model code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import anyquant
from anyquant.errors import CheckpointError
from anyquant.testing.tiny import make_tiny_dense, tiny_llama_config
from anyquant_runtime.build import choose_runtime
from anyquant_runtime.native import NativeConfig, native_runtime_reason, rope_inv_freq, yarn_rope
from tests.decoding import logits_after_prompt, random_int4_linears

pytestmark = pytest.mark.slow

VARIANTS = {
    "llama-gqa-tied": {"num_hidden_layers": 2, "tie_word_embeddings": True},
    "llama-untied-bias": {"num_hidden_layers": 2, "tie_word_embeddings": False, "attention_bias": True},
    "qwen2": {"model_type": "qwen2", "num_hidden_layers": 2, "tie_word_embeddings": False},
    # Qwen3: RMSNorm of each query and key head (head_dim not hidden / heads)
    "qwen3": {"model_type": "qwen3", "num_hidden_layers": 2, "tie_word_embeddings": False, "head_dim": 32},
    # Qwen3-MoE: top-2 of 4 experts, renormalised; layer 0 dense (mlp_only_layers)
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 2,
        "head_dim": 32,
        "moe_intermediate_size": 48,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [0],
    },
    # every second layer sparse, the top-3 weights not renormalised
    "qwen3_moe-step2": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 2,
        "moe_intermediate_size": 48,
        "num_experts": 5,
        "num_experts_per_tok": 3,
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,
    },
    # Mixtral: every layer sparse, top-2 of 4 experts always renormalised (kept in float32); stored as
    # block_sparse_moe.experts.N.w1/w2/w3 (transformers' renaming run backwards)
    "mixtral": {
        "model_type": "mixtral",
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
    # Qwen2-MoE: q/k/v biases, a sigmoid-gated shared expert, top-2 of 4 not renormalised; layer 1 dense
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "num_hidden_layers": 2,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "mlp_only_layers": [1],
    },
    # every second layer sparse, renormalised top-3 of 5
    "qwen2_moe-step2": {
        "model_type": "qwen2_moe",
        "num_hidden_layers": 2,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 64,
        "num_experts": 5,
        "num_experts_per_tok": 3,
        "norm_topk_prob": True,
        "decoder_sparse_step": 2,
    },
    # Phi-3: fused qkv_proj and gate_up_proj; rotary on 24 of each head's 32 features
    "phi3-partial-rotary": {
        "model_type": "phi3",
        "num_hidden_layers": 2,
        "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
    },
    "phi3": {"model_type": "phi3", "num_hidden_layers": 2, "sliding_window": None, "tie_word_embeddings": True},
    # Gemma: (1 + weight) RMSNorm, embeddings scaled by sqrt(hidden), GELU (tanh) MLP, head_dim from the config
    "gemma": {"model_type": "gemma", "num_hidden_layers": 2, "head_dim": 48, "tie_word_embeddings": True},
    # sliding windows of a few positions (the tests' prompts and cached steps run past them): Mistral's on every
    # layer; Qwen2's from max_window_layers on; Qwen3's by layer_types; Phi-3's with its fused projections
    "mistral-window": {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 5},
    "qwen2-window": {
        "model_type": "qwen2",
        "num_hidden_layers": 2,
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 1,
    },
    "qwen3-window": {
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "head_dim": 32,
        "use_sliding_window": True,
        "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "phi3-window": {"model_type": "phi3", "num_hidden_layers": 2, "sliding_window": 7},
    # Qwen2-MoE's own rule: the even layers below max_window_layers slide
    "qwen2_moe-window": {
        "model_type": "qwen2_moe",
        "num_hidden_layers": 2,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 2,
    },
    # Gemma 2: four norms a layer, query_pre_attn_scalar, soft-capped scores (eager attention) and logits,
    # sliding and full layers alternating
    "gemma2": {
        "model_type": "gemma2",
        "num_hidden_layers": 2,
        "head_dim": 48,
        "sliding_window": 6,
        "query_pre_attn_scalar": 40,
        "tie_word_embeddings": True,
    },
    # Gemma 3 (text): q/k norms, the sliding layers' own rotary base, linear rotary scaling on the full layers
    "gemma3_text": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "head_dim": 32,
        "sliding_window": 5,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 3.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_theta": 500000.0,
        "rope_local_base_freq": 100.0,
        "tie_word_embeddings": True,
    },
    # DeepSeek-V3: latent attention (queries through a low-rank q_a/q_b pair, interleaved rotary pairs), layer 0
    # dense, layer 1 top-2 of 8 experts from 1 of 2 groups chosen by the biased sigmoid scores, a shared expert
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 48,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 24,
        "v_head_dim": 20,
        "routed_scaling_factor": 2.5,
    },
    # no q_lora_rank (one q_proj), rotary halves (rope_interleave false), YaRN with DeepSeek's mscale_all_dim (the
    # attention's scale too), top-3 of 8 from 2 of 4 groups not renormalised, two shared experts, every layer sparse
    "deepseek_v3-yarn": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 0,
        "norm_topk_prob": False,
        "q_lora_rank": None,
        "kv_lora_rank": 40,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "rope_interleave": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
    # group_limited_greedy (2 of 4 groups by their best expert), no q_lora_rank, YaRN with DeepSeek-V2-Lite's mscales
    "deepseek_v2-grouped-yarn": {
        "model_type": "deepseek_v2",
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 3,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "q_lora_rank": None,
        "kv_lora_rank": 40,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
    "llama3-rope": {
        "num_hidden_layers": 1,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}


# DeepSeek-V2: V3's sizes, the latent attention's pairs turned as complex numbers (left interleaved), softmax routing:
# the top-2 of 8 (greedy: no groups), not renormalised, scaled; two shared experts; layer 0 dense
VARIANTS["deepseek_v2"] = {
    **{k: v for k, v in VARIANTS["deepseek_v3"].items() if k not in ("n_group", "topk_group")},
    "model_type": "deepseek_v2",
    "n_shared_experts": 2,
    "routed_scaling_factor": 1.5,
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    path = make_tiny_dense(tmp_path_factory.mktemp(request.param) / "m", **VARIANTS[request.param])
    ref = anyquant.load(path, runtime="transformers")
    nat = anyquant.load(path, runtime="native")
    assert type(nat.module).__name__ == "NativeCausalLM" and type(ref.module).__name__ != "NativeCausalLM"
    assert (nat.info["runtime"], ref.info["runtime"]) == ("native", "transformers")
    return ref, nat


def test_logits_equal_transformers(pair: tuple) -> None:
    ref, nat = pair
    ids = torch.randint(0, 200, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref.module(ids).logits, nat.module(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_greedy_tokens_and_padded_batches_equal_transformers(pair: tuple) -> None:
    ref, nat = pair
    prompts = ["Hi", "Hello there, how are you today?", "x"]
    assert nat.generate(prompts[1], max_new_tokens=16) == ref.generate(prompts[1], max_new_tokens=16)
    assert nat.generate_batch(prompts, max_new_tokens=10) == ref.generate_batch(prompts, max_new_tokens=10)
    assert nat.generate("Hello", max_new_tokens=8, temperature=0.8, seed=3) == ref.generate(
        "Hello", max_new_tokens=8, temperature=0.8, seed=3
    )


def test_cache_steps_equal_the_full_forward(pair: tuple) -> None:
    _, nat = pair
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = nat.module(ids).logits
        out = nat.module(ids[:, :7], use_cache=True)
        steps = [out.logits]
        for i in range(7, 12):
            out = nat.module(ids[:, i : i + 1], use_cache=True, cache=out.cache)
            steps.append(out.logits)
        chunk = nat.module(ids[:, :5], use_cache=True)
        rest = nat.module(ids[:, 5:], use_cache=True, cache=chunk.cache)  # several new tokens on a cache
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([chunk.logits, rest.logits], dim=1), full, rtol=1e-5, atol=1e-5)


def test_sliding_windows_matter(pair: tuple) -> None:
    """The windowed variants' windows are shorter than the tests' prompts: the same weights attending every
    position give other logits (the comparisons with transformers above do test the windows)."""
    _, nat = pair
    layers = nat.module.model.layers
    windows = [layer.self_attn.window for layer in layers]
    if all(w is None for w in windows):
        pytest.skip("no sliding layer")
    ids = torch.randint(0, 200, (1, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        windowed = nat.module(ids).logits
        try:
            for layer in layers:
                layer.self_attn.window = None
            full = nat.module(ids).logits
        finally:
            for layer, window in zip(layers, windows, strict=True):
                layer.self_attn.window = window
    assert not torch.allclose(windowed, full, rtol=1e-3, atol=1e-3)


def test_llama3_inv_freq_equals_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny_llama_config(**VARIANTS["llama3-rope"])
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    torch.testing.assert_close(rope_inv_freq(NativeConfig(cfg)), want, rtol=0, atol=0)


def test_yarn_rope_and_deepseeks_scale_equal_transformers() -> None:
    """DeepSeek-V3's YaRN: the inverse frequencies and cos/sin factor bit for bit transformers' (also with
    ``attention_factor`` given, and with ``truncate`` off), and the attention's scale its ``yarn_apply_mscale``."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    base = tiny_llama_config(**VARIANTS["deepseek_v3-yarn"])
    for extra in ({}, {"attention_factor": 1.3}, {"truncate": False, "mscale": None}):
        cfg = {**base, "rope_parameters": {**base["rope_parameters"], **extra}}
        ref = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
        want, factor = ROPE_INIT_FUNCTIONS["yarn"](ref)
        ours = NativeConfig(cfg)
        inv, scale = yarn_rope(ours)
        torch.testing.assert_close(inv, want, rtol=0, atol=0)
        assert scale == factor != 1.0, extra
        assert ours.scaling == yarn_apply_mscale(ref.rope_parameters, ref.qk_head_dim**-0.5) != ref.qk_head_dim**-0.5


def test_which_configs_run_natively() -> None:
    base = tiny_llama_config()
    assert native_runtime_reason(base) is None
    assert native_runtime_reason({**base, "model_type": "qwen2", "sliding_window": 4096}) is None  # not in use
    assert native_runtime_reason({**base, "model_type": "mistral", "sliding_window": 4096}) is None
    assert native_runtime_reason({**base, "model_type": "mistral", "sliding_window": None}) is None
    assert "sliding_window 0" in str(native_runtime_reason({**base, "model_type": "mistral", "sliding_window": 0}))
    assert "gelu" in str(native_runtime_reason({**base, "hidden_act": "gelu"}))
    assert "yarn" in str(native_runtime_reason({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    assert "gpt2" in str(native_runtime_reason({**base, "model_type": "gpt2"}))
    assert choose_runtime({**base, "model_type": "gpt2"}, "auto") == "transformers"
    assert choose_runtime(base, "auto") == "native"
    with pytest.raises(CheckpointError, match="runtime='native' cannot build"):
        choose_runtime({**base, "model_type": "gpt2"}, "native")
    with pytest.raises(anyquant.ParameterError, match="is not one of"):  # an argument, not the checkpoint
        choose_runtime(base, "vllm")


def test_native_load_imports_no_transformers_model_code(tmp_path: Path) -> None:
    path = make_tiny_dense(tmp_path / "m", num_hidden_layers=1)
    code = (
        "import sys, anyquant\n"
        f"m = anyquant.load({str(path)!r}, runtime='native')\n"
        "m.generate('Hi', max_new_tokens=2)\n"
        "bad = sorted(k for k in sys.modules if k.startswith(('transformers.models.', 'torch._dynamo')))\n"
        "print(type(m.module).__name__, bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "NativeCausalLM []"


def _int4_model(
    path: Path, *, bias: bool, dense_down: tuple[int, ...] = (), kind: str = "int4", **overrides: object
) -> anyquant.LoadedModel:
    """A tiny native model whose q/k/v/o and MLP linears are cpu-fast int4 with random codes (the
    ``down_proj`` of the layers ``dense_down`` stays a float32 ``nn.Linear``); ``kind="bf16"``: each of them
    then wrapped as the bfloat16 prepacked linear EXL3's and EXL2's cpu-fast build; ``kind="mixed"``: int4,
    bfloat16 prepacked and GGUF Q8_0 blocks (:class:`_Q8Blocks`) per linear as :data:`MIXED` lays them out;
    ``kind="gq4"``: int4, then repacked for the compiled block kernel as GPTQ's and AWQ's cpu-fast build does
    with ``cpu_fast_kernel="gq4"`` (the MoE layers' experts too), the hidden-state norms on the kernel's
    ``rms_norm`` and the decode steps' attention on its ``decode_attention`` as its cpu-fast build sets them
    (:func:`~anyquant_cpu.engine.kernel_norms`, :func:`~anyquant_cpu.engine.kernel_attention`)."""
    from anyquant_cpu import kernels
    from anyquant_cpu.engine import FastInt4Linear, PrepackedBf16Linear, bf16_head_status, int4pack_status

    status = int4pack_status()
    if not status.available:
        pytest.skip(f"no int4 CPU kernel here: {status.reason}")
    if kind in ("bf16", "mixed") and not bf16_head_status()[0]:
        pytest.skip(f"no bfloat16 prepacked linear here: {bf16_head_status()[1]}")
    if kind == "mixed" and not kernels.available():
        pytest.skip("anyquant kernels not built")
    tiny = make_tiny_dense(path, **{"num_hidden_layers": 2, "attention_bias": bias, **overrides})
    model = anyquant.load(tiny, runtime="native")
    gen = torch.Generator().manual_seed(5)
    for index, layer in enumerate(model.module.model.layers):
        mlp_names = ("gate_proj", "up_proj") if index in dense_down else ("gate_proj", "up_proj", "down_proj")
        mlps = list(layer.mlp.experts) if hasattr(layer.mlp, "experts") else [layer.mlp]  # Qwen3-MoE: each expert
        parents = [(layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")), *((m, mlp_names) for m in mlps)]
        for parent, names in parents:
            for name in names:
                lin = getattr(parent, name)
                k, n = lin.in_features, lin.out_features
                codes = torch.randint(0, 16, (k, n), generator=gen)
                zeros = torch.randint(0, 16, (k // 32, n), generator=gen)
                scales = (torch.rand(k // 32, n, generator=gen) * 0.02).half()
                b = None if lin.bias is None else lin.bias.detach().clone()
                linear = FastInt4Linear(codes, zeros, scales, bias=b)
                chosen = MIXED[index % len(MIXED)][name] if kind == "mixed" else kind
                if chosen == "bf16":
                    setattr(parent, name, PrepackedBf16Linear(linear))
                elif chosen == "q8_0":
                    setattr(parent, name, _Q8Blocks.of(linear.dequantize().float()))
                else:
                    setattr(parent, name, linear)
    if kind == "gq4":
        from anyquant_cpu.engine import kernel_attention, kernel_norms, to_block_kernel

        if not kernels.available():
            pytest.skip("anyquant kernels not built")
        assert to_block_kernel(model.module)["gq4_layers"] > 0
        # and the norms on the kernel up to 64 tokens, as FastCPUPlan.finish sets them (q/k norms: 64 x their heads)
        layers = model.module.model.layers
        qk = sum(layer.self_attn.q_norm is not None for layer in layers)
        assert kernel_norms(model.module, 64) == 2 * len(layers) + 1 + 2 * qk
        for layer in layers if qk else ():
            attn = layer.self_attn
            assert (attn.q_norm.kernel_rows, attn.k_norm.kernel_rows) == (64 * attn.heads, 64 * attn.kv_heads)
        # and the decode steps' attention on the kernel's decode_attention, as FastCPUPlan.finish sets it
        assert kernel_attention(model.module) == len(layers)
        assert all(layer.self_attn.decode_kernel for layer in layers)
    return model


#: the kind of each linear of ``_int4_model(kind="mixed")``, by layer: layer 0's q/k run as two int4 calls (v is
#: not int4: no fused q/k/v) and its gate/up as one; layer 1's q/k/v as one, its gate/up each its own kind
MIXED = [
    {"q_proj": "int4", "k_proj": "int4", "v_proj": "bf16", "o_proj": "q8_0"}
    | {"gate_proj": "int4", "up_proj": "int4", "down_proj": "bf16"},
    {"q_proj": "int4", "k_proj": "int4", "v_proj": "int4", "o_proj": "bf16"}
    | {"gate_proj": "q8_0", "up_proj": "bf16", "down_proj": "int4"},
]


class _Q8Blocks:
    """A cpu-fast GGUF-block linear (:class:`~anyquant_cpu.kernels.linear.BlockLinear`) over a weight quantized
    to Q8_0 by the gguf package (a peer), dequantized by it for prompts."""

    @staticmethod
    def of(weight: torch.Tensor) -> torch.nn.Module:
        from gguf import GGMLQuantizationType, quants

        from anyquant_cpu.kernels.linear import BlockLinear

        raw = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
        out_features, in_features = weight.shape

        class Q8(BlockLinear):
            def dequantize(self) -> torch.Tensor:
                return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0))

        blocks = torch.from_numpy(raw.copy()).reshape(-1)
        return Q8(blocks, "Q8_0", out_features, in_features, small_rows=64)


def test_fused_int4_decode_is_bitwise_the_separate_kernels(tmp_path: Path) -> None:
    model = _int4_model(tmp_path / "m", bias=True)
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(5))
    fused = logits_after_prompt(model, ids, 5)
    assert model.module.__dict__["_step"] is None  # biases: the layers are not the decode step's shape
    fusions = [m.__dict__.get("_fusion") for m in model.module.modules() if "_fusion" in m.__dict__]
    assert len(fusions) == 4 and all(f is not None for f in fusions)  # q/k/v and gate/up of 2 layers
    q = model.module.model.layers[0].self_attn.q_proj
    assert q.packed.untyped_storage().data_ptr() == fusions[0].packed.untyped_storage().data_ptr()  # shared
    for m in model.module.modules():
        if "_fusion" in m.__dict__:
            m.__dict__["_fusion"] = None  # each linear on its own again
    assert torch.equal(logits_after_prompt(model, ids, 5), fused)


class _LayerCalls:
    """Counts ``DecoderLayer.forward`` calls: the module path runs them, the compiled decode step does not."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from anyquant_runtime import native

        self.count, forward = 0, native.DecoderLayer.forward

        def counted(layer: torch.nn.Module, *args: object) -> torch.Tensor:
            self.count += 1
            return forward(layer, *args)

        monkeypatch.setattr(native.DecoderLayer, "forward", counted)

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


@pytest.mark.parametrize("kind", ["int4", "bf16", "mixed", "gq4"])
def test_compiled_decode_step_is_bitwise_the_module_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    import os

    from anyquant_cpu import step as step_mod
    from anyquant_cpu.step import DecodeStep

    model = _int4_model(tmp_path / "m", bias=False, kind=kind)
    ids = torch.randint(0, 200, (2, 75), generator=torch.Generator().manual_seed(7))
    calls = _LayerCalls(monkeypatch)
    fast = logits_after_prompt(model, ids, 50)  # 25 steps: the KV buffers grow past their first 64 positions on the way
    step = model.module.__dict__["_step"]
    assert isinstance(step, DecodeStep)
    assert calls.take() == 2  # the prompt's two layers; no decode step went through the modules
    if os.environ.get("PYTORCH_JIT", "1") != "0":
        assert all(isinstance(function, torch.jit.ScriptFunction) for function, _ in step.layers)
        assert isinstance(step.stack, torch.jit.ScriptModule)  # every layer planned: the steps ran as one call
    assert all(function is step_mod.compiled_layer({"gq4": "ggml"}.get(kind, kind)) for function, _ in step.layers)
    model.module.__dict__["_step"] = None  # the module path
    slow = logits_after_prompt(model, ids, 50)
    assert calls.take() == 2 * 26
    assert torch.equal(fast, slow)
    prompts = ["Hi", "Hello there, how are you today?", "x"]  # a padded batch: the mask goes with each step
    slow_batch = model.generate_batch(prompts, max_new_tokens=8)
    assert calls.take() == 2 * (1 + 7)  # the prompt, then 7 decode steps (the 8th token is not fed back)
    del model.module.__dict__["_step"]  # rebuilt on the next decode step
    assert model.generate_batch(prompts, max_new_tokens=8) == slow_batch
    assert calls.take() == 2 and isinstance(model.module.__dict__["_step"], DecodeStep)  # only the prompt's


def test_float16_cache_on_a_tiny_cpu_fast_model(tmp_path: Path) -> None:
    """A tiny Llama with cpu-fast int4 linears (test_native_runtime's): the compiled decode step with a float16
    cache is bitwise its module path, and within 1e-2 of the largest logit of the float32 cache (test_kv_cache.py's tolerance)."""
    model = _int4_model(tmp_path / "m", bias=False)
    ids = torch.randint(0, 200, (2, 60), generator=torch.Generator().manual_seed(3))
    full = logits_after_prompt(model, ids, 20)
    model.module.kv_cache_dtype = torch.float16
    del model.module.__dict__["_step"]
    half = logits_after_prompt(model, ids, 20)
    assert model.module.__dict__["_step"] is not None
    model.module.__dict__["_step"] = None  # the module path
    assert torch.equal(logits_after_prompt(model, ids, 20), half)
    err = float((half - full).abs().max() / full.abs().max())
    assert 0 < err <= 1e-2


MOE = {
    "model_type": "qwen3_moe",
    "head_dim": 32,
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_only_layers": [0],
}


@pytest.mark.parametrize("kind", ["int4", "mixed", "gq4"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_compiled_decode_step_qwen3_is_bitwise_the_module_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, kind: str
) -> None:
    """Qwen3's per-head q/k norms and Qwen3-MoE's routed experts (one row: its experts in order; a batch: each
    expert on the rows that chose it) in the compiled step, the same logits as the modules; each expert's
    gate/up one int4 call on both paths (``mixed``: the experts' linears of three kinds, :data:`MIXED`; ``gq4``: every
    layer on the block kernel, the MoE one's experts too, by ``mixed_moe``, a token's experts one kernel call)."""
    import os

    from anyquant_cpu.step import DecodeStep, compiled_layer
    from anyquant_runtime.experts import Experts

    overrides = MOE if family == "qwen3_moe" else {"model_type": "qwen3", "head_dim": 32}
    model = _int4_model(tmp_path / "m", bias=False, kind=kind, **overrides)
    if kind == "gq4":
        kinds = ["ggml", "mixed_moe"] if family == "qwen3_moe" else ["ggml", "ggml"]
    else:
        kinds = [kind, f"{kind}_moe"] if family == "qwen3_moe" else [kind, kind]
    calls = _LayerCalls(monkeypatch)
    for ids in (
        torch.randint(0, 200, (1, 30), generator=torch.Generator().manual_seed(12)),
        torch.randint(0, 200, (3, 16), generator=torch.Generator().manual_seed(13)),
    ):
        fast = logits_after_prompt(model, ids, 8)
        step = model.module.__dict__["_step"]
        assert isinstance(step, DecodeStep) and calls.take() == 2
        assert [function for function, _ in step.layers] == [compiled_layer(k) for k in kinds]
        if os.environ.get("PYTORCH_JIT", "1") != "0":
            assert all(isinstance(function, torch.jit.ScriptFunction) for function, _ in step.layers)
        if family == "qwen3_moe" and kind != "int4":  # a token's experts in one ggml_experts call where all are blocks
            assert (step.layers[1][1][-1] > 0) == (kind == "gq4")  # type: ignore[index]
        model.module.__dict__["_step"] = None  # the module path
        assert torch.equal(logits_after_prompt(model, ids, 8), fast)
        assert calls.take() == 2 * (ids.shape[1] - 8 + 1)
        del model.module.__dict__["_step"]
    if family == "qwen3_moe":
        experts = model.module.model.layers[1].mlp.experts
        assert isinstance(experts, Experts)
        # gate/up fused on the module path too where both are int4
        assert all((e.__dict__.get("_fusion") is not None) == (kind == "int4") for e in experts)
        assert model.module.model.layers[0].mlp.__class__.__name__ == "MLP"  # mlp_only_layers


@pytest.mark.parametrize("kind", ["int4", "bf16"])
@pytest.mark.parametrize(
    "heads",
    [{"num_key_value_heads": 4}, {"num_attention_heads": 2, "num_key_value_heads": 1}],
    ids=["mha", "mqa-head64"],
)
def test_compiled_decode_step_head_layouts(tmp_path: Path, kind: str, heads: dict[str, int]) -> None:
    model = _int4_model(tmp_path / "m", bias=False, kind=kind, **heads)
    ids = torch.randint(0, 200, (3, 12), generator=torch.Generator().manual_seed(10))
    fast = logits_after_prompt(model, ids, 6)
    assert all(planned is not None for planned in model.module.__dict__["_step"].layers)
    model.module.__dict__["_step"] = None
    assert torch.equal(logits_after_prompt(model, ids, 6), fast)


def test_hooks_and_replaced_modules_take_the_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from anyquant_runtime.native import RMSNorm

    model = _int4_model(tmp_path / "m", bias=False)
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(8))
    want = logits_after_prompt(model, ids, 8)
    calls = _LayerCalls(monkeypatch)
    seen: list[tuple[int, ...]] = []
    down = model.module.model.layers[1].mlp.down_proj
    handle = down.register_forward_hook(lambda mod, args, out: seen.append(tuple(out.shape)))
    assert torch.equal(logits_after_prompt(model, ids, 8), want)
    assert len(seen) == 5 and calls.take() == 2 * 5  # the hook saw the prompt and each of the 4 steps
    handle.remove()
    glob = torch.nn.modules.module.register_module_forward_pre_hook(lambda mod, args: None)
    assert torch.equal(logits_after_prompt(model, ids, 8), want) and calls.take() == 2 * 5
    glob.remove()
    assert torch.equal(logits_after_prompt(model, ids, 8), want) and calls.take() == 2  # fast again
    top = model.module.register_forward_hook(lambda mod, args, out: seen.append(tuple(out.logits.shape)))
    assert (
        torch.equal(logits_after_prompt(model, ids, 8), want) and calls.take() == 2
    )  # the model's own hook: still fast
    assert len(seen) == 10  # and it fired for the prompt and each step
    top.remove()
    mlp = model.module.model.layers[1].mlp
    wrapped = mlp.forward
    mlp.forward = lambda h: seen.append(("wrapper",)) or wrapped(h)  # an instance-level wrapper (accelerate's way)
    assert torch.equal(logits_after_prompt(model, ids, 8), want) and calls.take() == 2 * 5 and seen[-1] == ("wrapper",)
    del mlp.forward
    layer = model.module.model.layers[0]
    norm = RMSNorm(layer.post_attention_layernorm.weight.shape[0], layer.post_attention_layernorm.variance_epsilon)
    with torch.no_grad():
        norm.weight.copy_(layer.post_attention_layernorm.weight * 2)
    layer.post_attention_layernorm = norm  # a module the step was not built from: it must not be skipped
    changed = logits_after_prompt(model, ids, 8)
    assert calls.take() == 2 * 5 and not torch.equal(changed, want)


def test_a_layer_left_dense_runs_through_its_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _int4_model(tmp_path / "m", bias=False, dense_down=(0,))
    ids = torch.randint(0, 200, (1, 14), generator=torch.Generator().manual_seed(9))
    calls = _LayerCalls(monkeypatch)
    fast = logits_after_prompt(model, ids, 8)
    step = model.module.__dict__["_step"]
    assert step.layers[0] is None and step.layers[1] is not None
    assert calls.take() == 2 + 6  # the prompt's two layers, then layer 0 alone in each of the 6 steps
    model.module.__dict__["_step"] = None
    assert torch.equal(logits_after_prompt(model, ids, 8), fast)


def test_compiling_the_step_warns_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from anyquant_cpu import step

    monkeypatch.setattr(step, "_compiled", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        functions = [step.compiled_layer(kind) for kind in step.LAYER_FUNCTIONS]
    assert not [str(w.message) for w in caught]  # torch.jit.script's deprecation notice stays inside
    assert all(callable(f) for f in functions)


def test_mixed_step_compiles_without_the_block_kernel() -> None:
    """Without the GGUF-block op (not built, or ``ANYQUANT_KERNELS=0``) TorchScript cannot resolve it: the mixed
    functions still compile (a Q4_K_M file's int4 and bfloat16 linears need no op of ours), their block branch a call
    back into Python."""
    code = (
        "import torch\n"
        "from anyquant_cpu import kernels, step\n"
        "assert not kernels.available() and not hasattr(torch.ops.anyquant, 'ggml_gemv')\n"
        "print(all(isinstance(step.compiled_layer(k), torch.jit.ScriptFunction) for k in ('mixed', 'mixed_moe')))\n"
    )
    env = {**os.environ, "ANYQUANT_KERNELS": "0", "PYTORCH_JIT": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "True"


def test_without_torchscript_the_step_runs_as_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.jit.script needs the sources (a frozen app may ship only bytecode) and may go away: the step then
    runs the same functions as Python, with the same logits."""
    from anyquant_cpu import step

    model = _int4_model(tmp_path / "m", bias=False)
    ids = torch.randint(0, 200, (1, 10), generator=torch.Generator().manual_seed(11))
    compiled = logits_after_prompt(model, ids, 6)

    def refuse(*_: object, **__: object) -> None:
        raise OSError("could not get source code")

    monkeypatch.setattr(step, "_compiled", {})
    monkeypatch.setattr(torch.jit, "script", refuse)
    del model.module.__dict__["_step"]
    python = logits_after_prompt(model, ids, 6)
    assert all(function is step.int4_layer for function, _ in model.module.__dict__["_step"].layers)
    assert torch.equal(python, compiled)


def test_fused_experts_compute_what_the_per_expert_linears_compute(tmp_path: Path) -> None:
    """A dense checkpoint in transformers' fused form (3-D ``gate_up_proj``/``down_proj``) fills the native
    decoder's FusedExperts: the same outputs as the per-expert linears it holds, on rows routed to every expert."""
    from anyquant_runtime.layers import FusedExperts
    from anyquant_runtime.native import NativeConfig

    path = make_tiny_dense(tmp_path / "m", **{k: v for k, v in MOE.items() if k != "mlp_only_layers"})
    model = anyquant.load(path, runtime="native")
    experts = model.module.model.layers[0].mlp.experts
    c = NativeConfig(model.module.config.to_dict())
    fused = FusedExperts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
    held = experts.fused()
    fused.gate_up_proj, fused.down_proj = held.gate_up_proj, held.down_proj
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(6, experts[0].gate_proj.in_features, generator=gen)
    index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=gen)
    with torch.no_grad():
        want = experts(x, index, weights)
        torch.testing.assert_close(fused(x, index, weights), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused(x[:1], index[:1], weights[:1]), want[:1], rtol=1e-5, atol=1e-6)


def test_hooks_on_an_experts_linears_fire_on_the_fused_path(tmp_path: Path) -> None:
    """An expert's gate/up run as one int4 call, except when one of them has a hook: then each runs, and its hook
    fires (a decode step runs top_k experts: top_k calls)."""
    model = _int4_model(tmp_path / "m", bias=False, **MOE)
    experts = model.module.model.layers[1].mlp.experts
    calls: list[int] = []
    for e, expert in enumerate(experts):
        expert.gate_proj.register_forward_pre_hook(lambda m, i, e=e: calls.append(e))
    ids = torch.randint(0, 200, (1, 6), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        out = model.module(ids[:, :5], use_cache=True)
        calls.clear()
        model.module(ids[:, 5:], use_cache=True, cache=out.cache)  # one decode step: top_k = 2 experts
    assert len(calls) == 2 and len(set(calls)) == 2
    assert all(e.__dict__.get("_fusion") is not None for e in experts)


#: the newer native families on cpu-fast int4 linears, and how the compiled decode step runs each layer: Mixtral's
#: sparse blocks by ``int4_moe``; Qwen2-MoE's sparse block (its shared expert) and Phi-3's fused projections and
#: partial rotary through their modules, its dense layer compiled; Gemma's norms and GELU all through the modules (Gemma
#: 2's and 3's four norms, soft-capping and two rotary tables too); sliding windows compiled (Mistral's every layer);
#: DeepSeek-V2's and -V3's latent attention through their modules
FAMILY_STEPS = {
    "mistral-window": ({**VARIANTS["mistral-window"]}, ["int4", "int4"]),
    "deepseek_v3": (
        {**VARIANTS["deepseek_v3"], "q_lora_rank": 64, "moe_intermediate_size": 64, "v_head_dim": 32},
        [None, None],
    ),
    "deepseek_v2": (
        {**VARIANTS["deepseek_v2"], "q_lora_rank": 64, "moe_intermediate_size": 64, "v_head_dim": 32},
        [None, None],
    ),
    "gemma2": ({**VARIANTS["gemma2"]}, [None, None]),
    "gemma3_text": ({**VARIANTS["gemma3_text"], "num_hidden_layers": 2}, [None, None]),
    "mixtral": ({**VARIANTS["mixtral"]}, ["int4_moe", "int4_moe"]),
    "qwen2_moe": ({**VARIANTS["qwen2_moe"], "qkv_bias": False, "moe_intermediate_size": 64}, [None, "int4"]),
    "phi3": ({**VARIANTS["phi3-partial-rotary"]}, [None, None]),
    "gemma": ({**VARIANTS["gemma"]}, [None, None]),
}


@pytest.mark.parametrize("family", sorted(FAMILY_STEPS))
def test_compiled_decode_step_of_the_newer_families(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """Every linear of a layer with 32 or more outputs made cpu-fast int4 (the experts' and Phi-3's fused ones too):
    a layer the step's functions do not compute runs through its module, and the decode steps' logits are bitwise
    the module path's."""
    from anyquant_cpu.step import DecodeStep, compiled_layer

    overrides, kinds = FAMILY_STEPS[family]
    model = anyquant.load(make_tiny_dense(tmp_path / "m", **overrides), runtime="native")
    random_int4_linears(model.module.model.layers)
    calls = _LayerCalls(monkeypatch)
    ids = torch.randint(0, 200, (2, 20), generator=torch.Generator().manual_seed(12))
    fast = logits_after_prompt(model, ids, 8)
    step = model.module.__dict__["_step"]
    compiled = [k for k in kinds if k is not None]
    if compiled:
        assert isinstance(step, DecodeStep)
        assert [None if p is None else p[0] for p in step.layers] == [k and compiled_layer(k) for k in kinds]
    else:
        assert step is None  # no layer the step computes: it is never built again
    assert calls.take() == 2 + kinds.count(None) * (ids.shape[1] - 8)  # the prompt's, then the modules' layers
    model.module.__dict__["_step"] = None  # the module path
    assert torch.equal(logits_after_prompt(model, ids, 8), fast)
    from anyquant_cpu import kernels
    from anyquant_cpu.engine import kernel_attention

    if kernels.attention_available():
        # the decode steps' attention on the kernel (cpu-fast's; Gemma 2's soft-capped keeps torch's): torch's
        # numbers to float rounding, which the int4 kernel's bfloat16 activations turn into up to ~2.5e-5 of the
        # largest logit (DeepSeek-V2, Phi-3), with no bias (the fitted gain within 1e-5 of 1): DeepSeek's wider keys
        # than values, Phi-3's partial rotary, windows, experts; and the module path bitwise the compiled one
        assert kernel_attention(model.module) == 2
        model.module.__dict__.pop("_step", None)
        kernel = logits_after_prompt(model, ids, 8)
        torch.testing.assert_close(kernel, fast, rtol=0, atol=1e-4 * float(fast.abs().max()))
        gain = float((kernel.double() * fast.double()).sum() / (fast.double() ** 2).sum())
        assert abs(gain - 1) < 1e-5, gain
        model.module.__dict__["_step"] = None
        assert torch.equal(logits_after_prompt(model, ids, 8), kernel)


@pytest.mark.parametrize("kind", ["int4", "bf16", "gq4"])
@pytest.mark.parametrize(
    "window",
    [
        {"model_type": "mistral", "sliding_window": 5},
        {
            "model_type": "qwen3",
            "head_dim": 32,
            "use_sliding_window": True,
            "sliding_window": 7,
            "layer_types": ["full_attention", "sliding_attention"],
        },
    ],
    ids=["mistral", "qwen3-mixed-layers"],
)
def test_compiled_decode_step_with_sliding_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, window: dict[str, object]
) -> None:
    """Sliding layers in the compiled step: each given the cache from its window's first position (the one scripted
    call for every layer without a padding mask; a layer at a time, each its mask's columns, with one), bitwise the
    module path, in single prompts and padded batches that run past the window; a float16 cache too."""
    from anyquant_cpu.step import DecodeStep

    model = _int4_model(tmp_path / "m", bias=False, kind=kind, **window)
    assert any(layer.self_attn.window for layer in model.module.model.layers)
    calls = _LayerCalls(monkeypatch)
    ids = torch.randint(0, 200, (2, 30), generator=torch.Generator().manual_seed(16))
    prompts = ["Hi", "Hello there, how are you today?", "x"]
    for dtype in (None, torch.float16):
        model.module.kv_cache_dtype = dtype
        model.module.__dict__.pop("_step", None)
        fast = logits_after_prompt(model, ids, 8)
        step = model.module.__dict__["_step"]
        assert isinstance(step, DecodeStep) and None not in step.layers and step.windowed
        assert calls.take() == 2  # the prompt's layers only
        fast_batch = model.generate_batch(prompts, max_new_tokens=12)
        assert calls.take() == 2
        model.module.__dict__["_step"] = None  # the module path
        assert torch.equal(logits_after_prompt(model, ids, 8), fast)
        assert model.generate_batch(prompts, max_new_tokens=12) == fast_batch
        assert calls.take() == 2 * (1 + 22) + 2 * (1 + 11)


@pytest.mark.parametrize(
    "window", [{}, {"model_type": "mistral", "sliding_window": 5}], ids=["llama", "mistral-window"]
)
def test_decode_rows_compiled_is_bitwise_each_request_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: dict[str, object]
) -> None:
    """A server's shared step (:meth:`NativeCausalLM.decode_rows`) on cpu-fast layers with the kernel's attention: the
    whole step one compiled call (no layer through its module), each row's logits bitwise those of its request
    decoded alone (the compiled step's one-row call) and of the module path's rows, past the window and past the
    caches' first 64 positions; a float16 cache too."""
    from anyquant_cpu.step import DecodeStep

    model = _int4_model(tmp_path / "m", bias=False, kind="gq4", **window)
    module = model.module
    # the final norm's rows as the "logits": this tiny model's float32 head is a matmul whose kernel changes with
    # the rows (cpu-fast's heads compute each row alone: the bundled model's test in anyquant-gguf)
    module.lm_head = torch.nn.Identity()
    calls = _LayerCalls(monkeypatch)
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 200, (1, n), generator=gen) for n in (3, 40, 61)]
    for dtype in (None, torch.float16):
        module.kv_cache_dtype = dtype
        module.__dict__.pop("_step", None)
        runs: dict[str, list[torch.Tensor]] = {}
        for how in ("rows", "alone", "module rows"):
            if how == "module rows":
                module.__dict__["_step"] = None
            with torch.inference_mode():
                caches, tokens, got = [], [], []
                for ids in prompts:
                    out = module(ids, use_cache=True)
                    caches.append(out.cache)
                    tokens.append(int(out.logits[0, -1].argmax()))
                positions = [ids.shape[1] for ids in prompts]
                calls.take()
                for _ in range(12):
                    ids_t = torch.tensor([[t] for t in tokens])
                    pos_t = torch.tensor([[p] for p in positions])
                    if how == "alone":
                        logits = torch.cat(
                            [
                                module(ids_t[i : i + 1], position_ids=pos_t[i : i + 1], cache=c, use_cache=True).logits[
                                    :, -1
                                ]
                                for i, c in enumerate(caches)
                            ]
                        )
                    else:
                        logits = module.decode_rows(ids_t, pos_t, caches)
                    got.append(logits)
                    tokens = [int(t) for t in logits.argmax(-1)]
                    positions = [p + 1 for p in positions]
                if how == "rows":
                    assert isinstance(module.__dict__["_step"], DecodeStep) and module.__dict__["_step"].rows_ready
                    assert calls.take() == 0  # every step one compiled call
                runs[how] = got
        assert all(torch.equal(a, b) for a, b in zip(runs["rows"], runs["alone"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(runs["rows"], runs["module rows"], strict=True))
