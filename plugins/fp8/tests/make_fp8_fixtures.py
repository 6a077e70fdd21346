"""Write the FP8 fixtures (``fixtures/<name>/`` + ``fixtures/<name>.json``) with transformers' own FP8 code.

Not run by the tests (they only read what this wrote). For each fixture it

1. builds a small random bf16 model from :func:`anyquant.testing.tiny.tiny_llama_config` (hidden 256, so
   the 128x128 block grid of the linears is 2x2 / 2x3 / 3x2 / 1x2);
2. quantizes every decoder linear (q/k/v/o/gate/up/down) with transformers' ``Fp8Quantize._quantize_one``
   (``integrations/finegrained_fp8.py``): ``weight`` float8_e4m3fn [out, in] + ``weight_scale_inv``
   float32 [ceil(out/128), ceil(in/128)]; embeddings, norms and ``lm_head`` stay bf16;
3. saves ``model.safetensors`` + ``config.json`` (``quantization_config`` as the DeepSeek-V3 / Qwen3-FP8
   repos write it) + the tokenizer;
4. loads it back with ``from_pretrained(dir, quantization_config=FineGrainedFP8Config(dequantize=True),
   device_map="cpu")`` and records, into ``fixtures/<name>.json``: every linear's dequantized weight
   (dtype, shape, sha256 of ``.float().contiguous().numpy().tobytes()``, first 4 values), the float32
   logits of ``model.float()`` for the prompt (every position), 8 greedy tokens of the float32 model and
   of the bf16 model as loaded, and the bf16 model's logits.

Run with a venv holding torch 2.13.0 + transformers 5.24.0 (outside the repo)::

    TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1 PYTHONPATH=core/src \\
        /root/peers/tf/bin/python plugins/fp8/tests/make_fp8_fixtures.py

The output is deterministic for a given torch/transformers.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize

from anyquant.testing.tiny import make_tokenizer, tiny_llama_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPT = "The quick brown fox jumps over the lazy dog"
NEW_TOKENS = 8
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

FIXTURE_SPECS: dict[str, dict[str, Any]] = {
    "llama_fp8_block": {
        "seed": 1,
        "config": {"hidden_size": 256, "intermediate_size": 384},
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    },
    "qwen3_fp8_block": {
        "seed": 2,
        "config": {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 256,
            "intermediate_size": 384,
            "head_dim": 64,
            "rope_theta": 1000000.0,
            "max_window_layers": 2,
            "use_sliding_window": False,
        },
        # Qwen3-*-FP8 / DeepSeek-V3 spell it this way (with "fmt")
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
    },
    # Per-tensor FP8 in the `fp8` method: weight_block_size null and a 0-d float32 `weight_scale_inv`
    # (FP8Linear(block_size=None) registers `weight_scale_inv = tensor(1.0)`).
    "llama_fp8_tensor": {
        "seed": 3,
        "config": {"hidden_size": 256, "intermediate_size": 384},
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None},
    },
    # 320 is not a multiple of 128: DeepSeek's reference pads the last block (scale grid ceil(320/128) = 3).
    # Written with our own DeepSeek-style quantizer (transformers' Fp8Quantize passes such a tensor through
    # unquantized); the json records whether transformers' dequantize accepts it.
    "llama_fp8_block_partial": {
        "seed": 4,
        "config": {"hidden_size": 256, "intermediate_size": 320},
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "partial": True,
    },
}


class _Quantizer:
    """The bit of the HfQuantizer that ``Fp8Quantize`` reads."""

    def __init__(self, block: list[int] | None) -> None:
        self.quantization_config = FineGrainedFP8Config(weight_block_size=block)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def raw_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def quantize_partial(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ``weight_quant`` arithmetic with padded edge blocks (same math as Fp8Quantize otherwise)."""
    fp8 = torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max
    rows, cols = w.shape
    sr, sc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    w32 = w.float()
    q = torch.empty(rows, cols, dtype=fp8)
    inv = torch.empty(sr, sc, dtype=torch.float32)
    for i in range(sr):
        for j in range(sc):
            blk = w32[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            amax = blk.abs().amax()
            scale = fmax / amax if amax > 0 else torch.tensor(1.0)
            inv[i, j] = (1.0 / scale).to(torch.float32)
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (
                (blk * scale).clamp(-fmax, fmax).to(fp8)
            )
    return q, inv


def reference_dequant(q: torch.Tensor, inv: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    """Independent formula: fp32(q) * fp32(scale_inv) expanded per block (edge blocks cut), then bf16."""
    w = q.float()
    if block is None or inv.ndim == 0:
        return (w * inv.float()).to(torch.bfloat16)
    rows, cols = w.shape
    s = inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return (w * s).to(torch.bfloat16)


def build(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    cfg = tiny_llama_config(**spec["config"])
    model_type = cfg.pop("model_type")
    torch.manual_seed(spec["seed"])
    config = AutoConfig.for_model(model_type, **cfg)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # norms not all ones
            else:
                p.normal_(0.0, 0.08)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    make_tokenizer().save_pretrained(out)

    qcfg = spec["quantization_config"]
    block = qcfg["weight_block_size"]
    quantizer = Fp8Quantize(_Quantizer(block))
    sd = load_file(out / "model.safetensors")
    new_sd: dict[str, torch.Tensor] = {}
    on_disk: dict[str, Any] = {}
    intended: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        mod = key.rsplit(".", 2)
        if key.endswith(".weight") and mod[-2] in LINEARS:
            rows, cols = value.shape
            if block is not None and (rows % block[0] or cols % block[1]):
                q, inv = quantize_partial(value, tuple(block))
                via = "make_fp8_fixtures.quantize_partial (DeepSeek weight_quant arithmetic, padded edge blocks)"
            else:
                res = quantizer._quantize_one(key, value)
                q, inv = res[key], res[key.rsplit(".", 1)[0] + ".weight_scale_inv"]
                via = "transformers Fp8Quantize._quantize_one"
                if block is None:
                    inv = inv.reshape(())  # 0-d, as FP8Linear(block_size=None) holds it
            assert q.dtype == torch.float8_e4m3fn, (key, q.dtype)
            sk = key.rsplit(".", 1)[0] + ".weight_scale_inv"
            new_sd[key], new_sd[sk] = q.contiguous(), inv.contiguous()
            intended[key] = reference_dequant(q, inv, block)
            on_disk[key] = {"dtype": "F8_E4M3", "shape": list(q.shape), "sha256_raw": raw_sha(q), "quantized_by": via}
            on_disk[sk] = {
                "dtype": "F32",
                "shape": list(inv.shape),
                "sha256_raw": raw_sha(inv),
                "values": inv.reshape(-1).tolist(),
            }
        else:
            new_sd[key] = value
            on_disk[key] = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
    (out / "model.safetensors").unlink()
    save_file(new_sd, out / "model.safetensors", metadata={"format": "pt"})

    cj = json.loads((out / "config.json").read_text())
    cj["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(cj, indent=2, sort_keys=True) + "\n")

    record: dict[str, Any] = {
        "name": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "config": cj,
        "quantization_config": qcfg,
        "tensors": on_disk,
        "prompt": PROMPT,
    }
    tok = make_tokenizer()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    record["prompt_ids"] = ids[0].tolist()

    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            out, quantization_config=FineGrainedFP8Config(dequantize=True), device_map="cpu"
        )
    except Exception as e:
        record["transformers_load_error"] = f"{type(e).__name__}: {e}"
        print(f"{name}: transformers load failed: {record['transformers_load_error']}", file=sys.stderr)
        return record
    loaded.eval()
    record["loaded_class"] = type(loaded).__name__
    record["loaded_linear_class"] = type(loaded.model.layers[0].self_attn.q_proj).__name__
    record["loaded_param_dtype"] = str(next(loaded.parameters()).dtype)
    weights: dict[str, Any] = {}
    mismatch = []
    params = dict(loaded.named_parameters())
    for key in sorted(intended):
        w = params[key].detach()
        weights[key] = {
            "dtype": str(w.dtype).removeprefix("torch."),
            "shape": list(w.shape),
            "sha256": sha(w),
            "first4": w.reshape(-1)[:4].float().tolist(),
        }
        if not torch.equal(w.view(torch.int16), intended[key].view(torch.int16)):
            mismatch.append(key)
    record["dequantized_weights"] = weights
    record["dequant_equals_reference_formula"] = not mismatch
    record["dequant_mismatch"] = mismatch
    other = {}
    for key, p in params.items():
        if key not in intended:
            other[key] = {"dtype": str(p.dtype).removeprefix("torch."), "sha256": sha(p)}
    record["other_params"] = other

    with torch.no_grad():
        bf_logits = loaded(ids).logits[0]
        bf_gen = loaded.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1] :]
        f32 = loaded.float()
        logits = f32(ids).logits[0]
        res = f32.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        gen = res.sequences[0, ids.shape[1] :]
        margins = [float(sc[0].float().topk(2).values[0] - sc[0].float().topk(2).values[1]) for sc in res.scores]
    record["logits_float32"] = logits.tolist()
    record["logits_float32_sha256"] = sha(logits)
    record["greedy_float32"] = gen.tolist()
    record["greedy_float32_top2_margins"] = margins
    record["logits_bf16_model"] = bf_logits.float().tolist()
    record["logits_bf16_model_sha256"] = sha(bf_logits)
    record["greedy_bf16_model"] = bf_gen.tolist()
    print(f"{name}: ok, dequant==reference: {not mismatch}, greedy {gen.tolist()}")
    return record


def main() -> None:
    torch.set_num_threads(2)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    names = sys.argv[1:] or list(FIXTURE_SPECS)
    for name in names:
        rec = build(name, FIXTURE_SPECS[name])
        (FIXTURES / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
        if "transformers_load_error" in rec:
            print(f"{name}: kept on disk, but transformers cannot read it (see json)")


if __name__ == "__main__":
    main()
