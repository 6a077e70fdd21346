"""Write the gpt-oss MXFP4 fixture (``fixtures/gptoss_mxfp4/`` + ``fixtures/gptoss_mxfp4.json``).

Not run by the tests (they only read what this wrote). transformers quantizes to MXFP4 only through a Hub
kernel package (``kernels-community/gpt-oss-triton-kernels``), so this script writes the packed expert
tensors itself, in the layout of the gpt-oss-20b/120b repos, which is what transformers' dequantizer
(``integrations/mxfp4.py: _convert_moe_packed_tensors``) reads:

* ``model.layers.N.mlp.experts.gate_up_proj_blocks`` U8 [E, 2I, H/32, 16], ``..._scales`` U8 [E, 2I, H/32]
* ``model.layers.N.mlp.experts.down_proj_blocks``    U8 [E, H, I/32, 16],  ``..._scales`` U8 [E, H, I/32]
* ``gate_up_proj_bias`` bf16 [E, 2I], ``down_proj_bias`` bf16 [E, H]

i.e. [out, in] orientation, each row cut into 32-element blocks along `in`; byte j of a block holds
element 2j in its low nibble and element 2j+1 in its high nibble (E2M1 codes, FP4_VALUES table); the
scale byte e gives 2**(e - 127). Rows of gate_up alternate gate, up, gate, up, ... (row 2k = gate unit k,
row 2k+1 = up unit k), and so do the entries of ``gate_up_proj_bias``.

Steps: build a tiny ``GptOssForCausalLM`` (2 layers: sliding then full attention, sliding window 8,
4 experts, 2 per token, yarn RoPE as gpt-oss, attention sinks), draw the expert weights directly as
random FP4 codes + E8M0 exponents (so the intended dequantized values are exact), write
``config.json`` as gpt-oss-20b's (legacy ``rope_scaling`` + ``rope_theta`` keys, quantization_config
pasted from the 20b repo) and the tokenizer, then load with ``Mxfp4Config(dequantize=True)`` on CPU,
check that transformers' dequantized expert tensors equal the intended values bit for bit, and record
hashes, float32 logits and greedy tokens into the json.

Run with a venv holding torch 2.13.0 + transformers 5.24.0 (outside the repo)::

    TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1 PYTHONPATH=core/src \\
        /root/peers/tf/bin/python plugins/mxfp4/tests/make_mxfp4_fixtures.py
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Mxfp4Config

from anyquant.testing.tiny import make_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAME = "gptoss_mxfp4"
PROMPT = "The quick brown fox jumps over the lazy dog"
NEW_TOKENS = 8
SEED = 7

FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

E, H, I, L = 4, 128, 128, 2  # noqa: E741 - experts, hidden, expert intermediate, layers

# As gpt-oss-20b/config.json, scaled down (same keys, incl. the legacy rope_scaling / rope_theta and the
# original-format extras "experts_per_token" / "initial_context_length").
CONFIG: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "bos_token_id": 256,
    "eos_token_id": 258,
    "experts_per_token": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": H,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": I,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": L,
    "num_key_value_heads": 2,
    "num_local_experts": E,
    "output_router_logits": False,
    "pad_token_id": 256,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 8,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 259,
}


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def raw_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def random_mxfp4(gen: torch.Generator, rows: int, cols: int, exp_lo: int, exp_hi: int):
    """Random codes/exponents for E experts of [rows, cols]: (blocks U8 [E,rows,cols/32,16], scales U8 [E,rows,cols/32],
    intended float32 [E, rows, cols] computed independently of transformers)."""
    codes = torch.randint(0, 16, (E, rows, cols), generator=gen, dtype=torch.uint8)
    scales = torch.randint(exp_lo, exp_hi + 1, (E, rows, cols // 32), generator=gen, dtype=torch.uint8)
    lo, hi = codes[..., 0::2], codes[..., 1::2]  # element 2j -> low nibble, 2j+1 -> high nibble
    blocks = (lo | (hi << 4)).reshape(E, rows, cols // 32, 16).contiguous()
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    vals = table[codes.long()]
    factor = torch.pow(2.0, scales.float() - 127.0).repeat_interleave(32, dim=-1)
    return blocks, scales.contiguous(), vals * factor


def main() -> None:
    torch.set_num_threads(2)
    out = FIXTURES / NAME
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)

    cfg_kwargs = {k: v for k, v in CONFIG.items() if k not in ("quantization_config", "architectures")}
    config = GptOssConfig(**cfg_kwargs)
    model = GptOssForCausalLM(config)
    sd: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if ".mlp.experts." in name:
                continue
            if "norm" in name:
                t = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif "sinks" in name:
                t = torch.randn(p.shape, generator=gen)  # sink logits ~ N(0, 1): they matter
            elif "router" in name:
                t = 0.3 * torch.randn(p.shape, generator=gen)  # decisive routing
            elif name.endswith("bias"):
                t = 0.05 * torch.randn(p.shape, generator=gen)
            else:
                t = 0.08 * torch.randn(p.shape, generator=gen)
            sd[name] = t.to(torch.bfloat16).contiguous()

    intended: dict[str, torch.Tensor] = {}  # in transformers' module layout, bf16
    for layer in range(L):
        pre = f"model.layers.{layer}.mlp.experts."
        # gate_up: [E, 2I, H] out x in; rows 2k = gate_k, 2k+1 = up_k
        b, s, w = random_mxfp4(gen, 2 * I, H, 119, 124)
        sd[pre + "gate_up_proj_blocks"], sd[pre + "gate_up_proj_scales"] = b, s
        intended[pre + "gate_up_proj"] = w.transpose(1, 2).to(torch.bfloat16)  # module holds [E, H, 2I]
        sd[pre + "gate_up_proj_bias"] = (0.05 * torch.randn(E, 2 * I, generator=gen)).to(torch.bfloat16)
        # down: [E, H, I] out x in
        b, s, w = random_mxfp4(gen, H, I, 119, 124)
        sd[pre + "down_proj_blocks"], sd[pre + "down_proj_scales"] = b, s
        intended[pre + "down_proj"] = w.transpose(1, 2).to(torch.bfloat16)  # module holds [E, I, H]
        sd[pre + "down_proj_bias"] = (0.05 * torch.randn(E, H, generator=gen)).to(torch.bfloat16)

    sd = dict(sorted(sd.items()))
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 256, "do_sample": False}, indent=2) + "\n"
    )
    tok = make_tokenizer()
    tok.save_pretrained(out)

    record: dict[str, Any] = {
        "name": NAME,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "config": CONFIG,
        "quantization_config": CONFIG["quantization_config"],
        "tensors": {
            k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape), "sha256_raw": raw_sha(v)}
            for k, v in sd.items()
        },
        "prompt": PROMPT,
    }
    ids = tok(PROMPT, return_tensors="pt").input_ids
    record["prompt_ids"] = ids[0].tolist()

    loaded = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=Mxfp4Config(dequantize=True), device_map="cpu"
    )
    loaded.eval()
    record["loaded_experts_class"] = type(loaded.model.layers[0].mlp.experts).__name__
    record["attn_implementation"] = loaded.config._attn_implementation
    record["experts_implementation"] = loaded.config._experts_implementation
    record["loaded_rope_parameters"] = loaded.config.rope_parameters
    record["loaded_layer_types"] = loaded.config.layer_types
    params = dict(loaded.named_parameters())
    experts: dict[str, Any] = {}
    mismatch = []
    for key, want in intended.items():
        got = params[key].detach()
        experts[key] = {
            "dtype": str(got.dtype).removeprefix("torch."),
            "shape": list(got.shape),
            "layout": "[E, H, 2I] (x @ W; last dim interleaved gate,up)" if "gate_up" in key else "[E, I, H] (x @ W)",
            "sha256": sha(got),
            "first4": got.reshape(-1)[:4].float().tolist(),
        }
        if got.shape != want.shape or not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            mismatch.append(key)
    record["dequantized_experts"] = experts
    record["dequant_equals_intended"] = not mismatch
    record["dequant_mismatch"] = mismatch
    record["other_params"] = {
        k: {"dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape), "sha256": sha(p)}
        for k, p in params.items()
        if k not in intended
    }

    with torch.no_grad():
        bf_logits = loaded(ids).logits[0]
        bf_gen = loaded.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1] :]
        f32 = loaded.float()
        logits = f32(ids).logits[0]
        res = f32.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        gen = res.sequences[0, ids.shape[1] :]
        margins = []
        for sc in res.scores:
            top = sc[0].float().topk(2).values
            margins.append(float(top[0] - top[1]))
        f32.set_experts_implementation("eager")
        logits_eager = f32(ids).logits[0]
    record["logits_float32"] = logits.tolist()
    record["logits_float32_sha256"] = sha(logits)
    record["greedy_float32"] = gen.tolist()
    record["greedy_float32_top2_margins"] = margins
    record["logits_float32_eager_experts_max_abs_diff"] = float((logits_eager - logits).abs().max())
    record["logits_bf16_model"] = bf_logits.float().tolist()
    record["logits_bf16_model_sha256"] = sha(bf_logits)
    record["greedy_bf16_model"] = bf_gen.tolist()
    (FIXTURES / f"{NAME}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{NAME}: dequant==intended: {not mismatch} {mismatch}; greedy f32 {gen.tolist()} bf16 {bf_gen.tolist()}")
    print("margins", margins, "eager diff", record["logits_float32_eager_experts_max_abs_diff"])


if __name__ == "__main__":
    main()
