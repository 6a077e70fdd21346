"""Write the ``fbgemm_fp8`` fixtures (``fixtures/<name>/`` + ``fixtures/<name>.json``) with transformers' own
``FbgemmFp8Config`` quantizer and ``FbgemmFp8Linear``, fbgemm's two CUDA kernels written out below.

Not run by the tests (they only read what this wrote). Who makes what:

- fbgemm's kernels do not run on a CPU: ``fbgemm-gpu-cpu`` (tried: 1.9.0, the newest) ships no
  ``torch.ops.fbgemm.quantize_fp8_per_row`` nor ``f8f8bf16_rowwise`` (no ``experimental/gen_ai``: they are built
  for CUDA/ROCm only), and transformers' ``FbgemmFp8HfQuantizer.validate_environment`` raises without CUDA/XPU.
  So the two ops are supplied here as fbgemm's arithmetic written out from its source
  (``fbgemm_gpu/experimental/gen_ai/src/quantize/quantize.cu``, ``dynamicQuantizeMatrixRowwise`` /
  ``computeFP8QuantizeScaleRowwise``: per row ``s = max(min(max|x|, scale_ub) / 448, 1 / (448 * 512))`` in
  float32, ``q = e4m3_satfinite(x / s)``; and the rowwise GEMM: ``bf16((xq @ wq^T) * w_scale * x_scale)``, float32
  accumulation), and the GPU check is skipped: everything else is transformers 5.24's own code.
- 1. a small random bf16 model (Llama and Qwen3, hidden 64, 2 layers, norms not all ones) is saved dense;
- 2. ``from_pretrained(dense, quantization_config=FbgemmFp8Config(...), device_map="cpu")``: transformers replaces
  the linears (``replace_with_fbgemm_fp8_linear``, ``modules_to_not_convert``) and quantizes each weight with
  ``FbgemmFp8Quantize`` (``quantize_fp8_per_row(weight)``: ``weight`` float8_e4m3fn [out, in], ``weight_scale``
  float32 [out, 1]); ``save_pretrained`` writes the checkpoint (``input_scale_ub`` is a non-persistent buffer:
  not on disk; ``config.json`` holds ``activation_scale_ub`` and ``modules_to_not_convert``) + the tokenizer;
- 3. the checkpoint is read back with ``from_pretrained(out, device_map="cpu")`` (transformers fills every
  ``input_scale_ub`` with ``activation_scale_ub``) and recorded: each quantized linear's dequantized weight
  ``float32(weight) * weight_scale`` (the factor fbgemm's GEMM applies to the accumulator; transformers has no
  dequantize for this method): dtype, shape, sha256, first values; its forward as transformers runs it (bf16, the
  ops as fbgemm computes them: ``logits_bf16``, 8 greedy tokens ``greedy_bf16``); and the same module graph in
  float32 (``model.float()``, the same per-row rule on float32 activations, the GEMM in float32: what an exact
  float32 reader computes): ``logits_float32``, ``greedy_float32`` with its top-2 margins.

Run with a venv holding torch 2.13.0 + transformers 5.24.0 (outside the repo)::

    TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1 PYTHONPATH=core/src \\
        /root/peers/tf/bin/python plugins/fp8/tests/make_fbgemm_fp8_fixtures.py

The output is deterministic for a given torch/transformers.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, FbgemmFp8Config
from transformers.integrations import fbgemm_fp8 as tf_fbgemm
from transformers.quantizers.quantizer_fbgemm_fp8 import FbgemmFp8HfQuantizer

from anyquant.testing.tiny import make_tokenizer, tiny_llama_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPT = "The quick brown fox jumps over the lazy dog"
NEW_TOKENS = 8
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)

FIXTURE_SPECS: dict[str, dict[str, Any]] = {
    # transformers' defaults: activation_scale_ub 1200 (never reached here), modules_to_not_convert null (lm_head)
    "llama_fbgemm_fp8": {
        "seed": 21,
        "config": {"hidden_size": 64, "intermediate_size": 128},
        "fbgemm": {},
    },
    # a small upper bound (rows whose max|x| exceeds it saturate at +-448) and one decoder linear kept dense
    "qwen3_fbgemm_fp8": {
        "seed": 22,
        "config": {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "head_dim": 16,
            "rope_theta": 1000000.0,
            "max_window_layers": 2,
            "use_sliding_window": False,
        },
        "fbgemm": {"activation_scale_ub": 1.0, "modules_to_not_convert": ["lm_head", "model.layers.1.mlp.down_proj"]},
    },
}

#: the forward's precision: "bf16" (the ops as fbgemm has them: bfloat16 inputs only, bfloat16 out) or "float32"
_MODE = {"ops": "bf16"}


def quantize_fp8_per_row(
    x: torch.Tensor,
    bs: torch.Tensor | None = None,
    scale_ub: torch.Tensor | None = None,
    output_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fbgemm's ``quantize_fp8_per_row`` (quantize.cu, ``dynamicQuantizeMatrixRowwise``): per row ``max = max|x|``
    (float32), ``bounded = min(max, *scale_ub)``, ``s = max(bounded / 448, 1 / (448 * 512))``, ``q = (e4m3)(x / s)``
    (``__nv_fp8_e4m3`` converts with ``__NV_SATFINITE``: beyond +-448 saturates), scales ``[rows]`` float32."""
    if _MODE["ops"] == "bf16" and x.dtype != torch.bfloat16:
        raise RuntimeError(f"Invalid datatype. input must be BF16 (got {x.dtype})")  # fbgemm's TORCH_CHECK
    assert bs is None and output_dtype in (None, torch.float8_e4m3fn)
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.to(torch.float32).reshape(()))
    s = torch.clamp(amax / FP8_MAX, min=MIN_SCALE)
    q = torch.clamp(xf / s.unsqueeze(-1), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def f8f8bf16_rowwise(
    xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, use_fast_accum: bool = True
) -> torch.Tensor:
    """fbgemm's rowwise FP8 GEMM: ``out[m, n] = bf16(acc[m, n] * w_scale[n] * x_scale[m])``, ``acc`` the float32
    sum of ``xq[m, k] * wq[n, k]`` (torch's summation order here, not CUTLASS's)."""
    acc = xq.to(torch.float32) @ wq.to(torch.float32).t()
    out = acc * w_scale.to(torch.float32).reshape(1, -1) * x_scale.to(torch.float32).reshape(-1, 1)
    return out.to(torch.bfloat16) if _MODE["ops"] == "bf16" else out


def install_ops() -> None:
    """transformers' fbgemm integration with the two ops above (CPU), its CUDA/XPU check skipped."""
    tf_fbgemm.get_quantize_fp8_per_row = lambda: quantize_fp8_per_row  # type: ignore[attr-defined]
    torch.ops.fbgemm.f8f8bf16_rowwise = f8f8bf16_rowwise  # type: ignore[attr-defined]  # an _OpNamespace attribute
    FbgemmFp8HfQuantizer.validate_environment = lambda self, *a, **k: None  # type: ignore[method-assign]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def raw_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def build(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    cfg = tiny_llama_config(**spec["config"])
    model_type = cfg.pop("model_type")
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    tok = make_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _MODE["ops"] = "bf16"
        qmodel = AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=FbgemmFp8Config(**spec["fbgemm"]), device_map="cpu", dtype=torch.bfloat16
        )
        qmodel.save_pretrained(out)
    tok.save_pretrained(out)
    cj = json.loads((out / "config.json").read_text())
    record: dict[str, Any] = {
        "name": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "made_by": "transformers FbgemmFp8Config quantizer on CPU, fbgemm's ops as written out in "
        "make_fbgemm_fp8_fixtures.py (fbgemm-gpu-cpu has none)",
        "config": cj,
        "quantization_config": cj["quantization_config"],
        "prompt": PROMPT,
    }
    tensors: dict[str, Any] = {}
    with safe_open(out / "model.safetensors", "pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            entry: dict[str, Any] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            if t.dtype == torch.float8_e4m3fn or key.endswith("_scale"):
                entry["sha256_raw"] = raw_sha(t)
            tensors[key] = entry
    record["tensors"] = tensors
    ids = tok(PROMPT, return_tensors="pt").input_ids
    record["prompt_ids"] = ids[0].tolist()

    loaded = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    loaded.eval()
    record["loaded_class"] = type(loaded).__name__
    record["loaded_param_dtype"] = str(loaded.model.embed_tokens.weight.dtype)
    weights: dict[str, Any] = {}
    linear_classes: dict[str, str] = {}
    ubs = set()
    for mname, mod in loaded.named_modules():
        if isinstance(mod, torch.nn.Linear):
            linear_classes[mname] = type(mod).__name__
        if isinstance(mod, tf_fbgemm.FbgemmFp8Linear):
            assert mod.weight.dtype == torch.float8_e4m3fn and mod.weight_scale.shape == (mod.out_features, 1)
            w = mod.weight.detach().to(torch.float32) * mod.weight_scale.detach().to(torch.float32)
            weights[f"{mname}.weight"] = {
                "dtype": "float32",
                "shape": list(w.shape),
                "sha256": sha(w),
                "first4": w.reshape(-1)[:4].tolist(),
                "weight_scale_first4": mod.weight_scale.detach().reshape(-1)[:4].tolist(),
            }
            ubs.add(float(mod.input_scale_ub))
    record["linear_classes"] = linear_classes
    record["dequantized_weights"] = weights
    record["input_scale_ub_as_loaded"] = sorted(ubs)

    with torch.no_grad():
        _MODE["ops"] = "bf16"
        bf = loaded(ids).logits[0]
        res = loaded.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        record["logits_bf16"] = bf.float().tolist()
        record["logits_bf16_sha256"] = sha(bf)
        record["greedy_bf16"] = res.sequences[0, ids.shape[1] :].tolist()
        _MODE["ops"] = "float32"
        f32 = torch.nn.Module.float(loaded)  # transformers refuses .float() on a quantized model: the cast itself
        logits = f32(ids).logits[0]
        res = f32.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        margins = [float(sc[0].topk(2).values[0] - sc[0].topk(2).values[1]) for sc in res.scores]
        _MODE["ops"] = "bf16"
    record["logits_float32"] = logits.tolist()
    record["logits_float32_sha256"] = sha(logits)
    record["greedy_float32"] = res.sequences[0, ids.shape[1] :].tolist()
    record["greedy_float32_top2_margins"] = margins
    print(f"{name}: {len(weights)} FbgemmFp8Linear, greedy f32 {record['greedy_float32']} bf16 {record['greedy_bf16']}")
    return record


def main() -> None:
    torch.set_num_threads(2)
    install_ops()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[1:] or list(FIXTURE_SPECS):
        rec = build(name, FIXTURE_SPECS[name])
        (FIXTURES / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
