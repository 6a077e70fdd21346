"""Write the bitsandbytes fixtures with transformers + bitsandbytes themselves (CPU backend).

Not run by the tests (they only read what this wrote into ``fixtures/``). For each variant in
:data:`VARIANTS` it

1. builds a tiny random base model with :func:`anyquant.testing.tiny.make_tiny_dense` (Llama:
   hidden 128, intermediate 256, 2 layers, 4 heads, 2 KV heads, vocab 259; or a Qwen3 of the same
   size with tied embeddings) in bfloat16 or float16, with the byte-level tokenizer, then sets its
   norms near 1 and scales its output head by 4 (by 2 for the tied Qwen3; :func:`make_base`) so that the logits are decisive;
2. quantizes it as a user would: ``AutoModelForCausalLM.from_pretrained(base,
   quantization_config=BitsAndBytesConfig(...), device_map="cpu")`` then
   ``save_pretrained(fixtures/<name>)`` (plus the tokenizer files);
3. reloads ``fixtures/<name>`` with ``from_pretrained(dir, device_map="cpu")`` (three fresh
   reloads, since bitsandbytes repacks 4-bit weights on their first CPU forward) and records into
   ``fixtures/<name>.json``:

   * ``tensors``: every safetensors key with its dtype and shape (``quant_state_json``: the decoded
     ``weight.quant_state.bitsandbytes__*`` tensors);
   * ``weights``: for every quantized linear, bitsandbytes' own dequantization (4-bit:
     ``bitsandbytes.functional.dequantize_4bit(weight.data, weight.quant_state)``; 8-bit:
     ``bitsandbytes.functional.int8_vectorwise_dequant(weight.data, SCB)``, which is what
     transformers' ``dequantize_bnb_weight`` calls), taken before any forward: dtype, sha256 of
     ``.float().contiguous().numpy().tobytes()``, first 4 values;
   * ``logits_dequantized`` / ``greedy_dequantized``: float32 logits of every prompt position and
     8 greedy tokens of ``model.dequantize()`` then ``.float()``;
   * ``logits_bnb_forward`` / ``greedy_bnb_forward``: the quantized model's own forward (bitsandbytes'
     CPU matmul on this machine, whose path is in ``bnb_forward_path``), logits in the model's dtype
     (``logits_bnb_forward_dtype``) written as float32; for 4-bit also ``*_bnb_forward_generic``: the
     same with bitsandbytes' AVX512-BF16 repacking turned off (``support_avx512bf16_for_cpu =
     False``), i.e. ``dequantize_4bit`` to the compute dtype then ``torch.nn.functional.linear``;
   * ``decode_ms_per_token``: rough wall time of one cached decode step on this machine.

Logits are written as float32 values (shortest repr that reads back to the same float32) with the
sha256 of their little-endian float32 bytes. Greedy decoding is ``generate(do_sample=False,
max_new_tokens=8)`` with the end-of-sequence stop turned off; ``greedy_*_margins`` are the top-1
minus top-2 logits of each step.

The output is deterministic: a rerun with the same versions writes the same bytes (the timings
aside).

Run (from the repository root) in a virtual environment outside the repository::

    python3 -m venv /root/peers/bnb
    /root/peers/bnb/bin/pip install torch==2.13.0 transformers==5.24.0 bitsandbytes==0.50.2 \\
        accelerate==1.16.0 safetensors tokenizers
    TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1 PYTHONPATH=core/src \\
        /root/peers/bnb/bin/python plugins/bnb/tests/make_bnb_fixtures.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPT = "The quick brown fox jumps over the lazy dog"
NEW_TOKENS = 8
TIMING_TOKENS = 32
HEAD_SCALE = 4.0

#: base name -> make_tiny_dense keyword arguments (``head_scale``: see :func:`make_base`, default HEAD_SCALE)
BASES: dict[str, dict[str, Any]] = {
    "llama_bf16": {"seed": 0, "dtype": "bfloat16"},
    "llama_fp16": {"seed": 0, "dtype": "float16"},
    "qwen3_bf16": {
        "seed": 0,
        "dtype": "bfloat16",
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "head_dim": 32,
        "tie_word_embeddings": True,
        "head_scale": 2.0,  # tied: also scales the input embedding; 4 makes greedy one token repeated
    },
}

#: fixture name -> (base name, BitsAndBytesConfig keyword arguments; dtype names as strings)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_nf4": (
        "llama_bf16",
        dict(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=False,
            bnb_4bit_compute_dtype="bfloat16",
        ),
    ),
    "llama_nf4_dq": (
        "llama_bf16",
        dict(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype="bfloat16",
        ),
    ),
    "llama_fp4": (
        "llama_bf16",
        dict(
            load_in_4bit=True,
            bnb_4bit_quant_type="fp4",
            bnb_4bit_use_double_quant=False,
            bnb_4bit_compute_dtype="bfloat16",
        ),
    ),
    "llama_fp4_dq": (
        "llama_bf16",
        dict(
            load_in_4bit=True,
            bnb_4bit_quant_type="fp4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype="bfloat16",
        ),
    ),
    "llama_nf4_fp16": (
        "llama_fp16",
        dict(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype="float16",
        ),
    ),
    "llama_nf4_storage_bf16": (
        "llama_bf16",
        dict(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype="bfloat16",
            bnb_4bit_quant_storage="bfloat16",
        ),
    ),
    "llama_int8": ("llama_bf16", dict(load_in_8bit=True)),
    "qwen3_nf4": (
        "qwen3_bf16",
        dict(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype="bfloat16",
        ),
    ),
}


def make_base(path: Path, name: str) -> Path:
    """make_tiny_dense, then norms near 1 and a larger output head (x4, x2 for the tied Qwen3), so that logits are decisive.

    ``make_tiny_dense`` draws every parameter from N(0, 0.08), norms included, which leaves the logits
    near-uniform (top-2 margins of ~1e-3, too fragile for a greedy comparison). Deterministic.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from anyquant.testing.tiny import make_tiny_dense

    kw = dict(BASES[name])
    head_scale = kw.pop("head_scale", HEAD_SCALE)
    make_tiny_dense(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, kw["dtype"]), device_map="cpu")
    gen = torch.Generator().manual_seed(1000 + kw["seed"])
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        head = model.get_output_embeddings().weight
        head.mul_(head_scale)
    model.save_pretrained(path)
    return path


def _f32_list(a: Any) -> Any:
    """Nested lists of the shortest decimal strings that read back as the same float32, as floats."""
    import numpy as np

    a = np.asarray(a, dtype=np.float32)
    if a.ndim == 0:
        x = a[()]
        assert np.isfinite(x)
        return float(np.format_float_positional(x, unique=True, trim="-"))
    return [_f32_list(x) for x in a]


def _dumps(rec: dict[str, Any]) -> str:
    """JSON with one top-level key a line, dicts indented, number lists compact (a matrix: a row a line)."""

    def enc(v: Any, ind: str) -> str:
        if isinstance(v, dict):
            if not v:
                return "{}"
            inner = ind + " "
            return (
                "{\n" + ",\n".join(f"{inner}{json.dumps(k)}: {enc(x, inner)}" for k, x in v.items()) + "\n" + ind + "}"
            )
        if isinstance(v, list) and v and all(isinstance(r, list) for r in v):
            inner = ind + " "
            return "[\n" + ",\n".join(inner + json.dumps(r, separators=(",", ":")) for r in v) + "\n" + ind + "]"
        return json.dumps(v, separators=(", ", ": "))

    return enc(rec, "") + "\n"


def _sha(t: Any) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def _bnb_config(kw: dict[str, Any]) -> Any:
    import torch
    from transformers import BitsAndBytesConfig

    kw = {
        k: (getattr(torch, v) if k in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage") else v)
        for k, v in kw.items()
    }
    return BitsAndBytesConfig(**kw)


def _load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu")
    model.eval()
    return model


def _logits(model: Any, ids: list[int]) -> Any:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _greedy(model: Any, ids: list[int], n: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=256,
            output_scores=True,
            return_dict_in_generate=True,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    toks = out.sequences[0, len(ids) :].tolist()
    assert len(toks) == n, toks
    margins = []
    for s in out.scores:
        top = torch.topk(s[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return toks, margins


def _decode_ms(model: Any, ids: list[int]) -> float:
    import torch

    with torch.no_grad():
        model.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=256)
        t0 = time.perf_counter()
        model.generate(
            torch.tensor([ids]),
            max_new_tokens=TIMING_TOKENS + 1,
            min_new_tokens=TIMING_TOKENS + 1,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=256,
        )
        t1 = time.perf_counter()
        model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=256)
        t2 = time.perf_counter()
    return round(((t1 - t0) - (t2 - t1)) / TIMING_TOKENS * 1000.0, 3)


def _record_logits(rec: dict[str, Any], key: str, logits: Any) -> None:
    rec[f"logits_{key}_dtype"] = str(logits.dtype).removeprefix("torch.")
    f = logits.float().contiguous()
    rec[f"logits_{key}_sha256"] = _sha(f)
    rec[f"logits_{key}"] = _f32_list(f.numpy())


def _tensors(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    out: dict[str, Any] = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for k in sorted(f.keys()):
            t = f.get_tensor(k)
            e: dict[str, Any] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            if ".quant_state.bitsandbytes__" in k:
                e["quant_state_json"] = json.loads(bytes(t.numpy().tobytes()).decode("utf-8"))
            out[k] = e
    return out


def make_variant(name: str, bases: dict[str, Path]) -> dict[str, Any]:
    import bitsandbytes as bnb
    import torch
    import transformers
    from bitsandbytes.functional import dequantize_4bit, has_avx512bf16, int8_vectorwise_dequant
    from transformers import AutoModelForCausalLM

    from anyquant.testing.tiny import make_tokenizer

    base_name, qkw = VARIANTS[name]
    base = bases[base_name]
    out_dir = FIXTURES / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=_bnb_config(qkw), device_map="cpu")
    model.save_pretrained(out_dir)
    tok = make_tokenizer()
    tok.save_pretrained(out_dir)
    del model

    ids = tok(PROMPT)["input_ids"]
    rec: dict[str, Any] = {
        "name": name,
        "base": {"name": base_name, **BASES[base_name]},
        "quantization_config_kwargs": qkw,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "bitsandbytes": bnb.__version__,
            "python": platform.python_version(),
        },
        "machine": {
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bnb_has_avx512bf16": bool(has_avx512bf16()),
            "torch_threads": torch.get_num_threads(),
        },
        "config": json.loads((out_dir / "config.json").read_text()),
        "files": sorted(p.name for p in out_dir.iterdir()),
        "tensors": _tensors(out_dir),
        "prompt": PROMPT,
        "prompt_ids": ids,
    }

    # 1. bitsandbytes' own dequantization of each quantized linear, before any forward.
    model = _load(out_dir)
    weights: dict[str, Any] = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            qs = mod.weight.quant_state
            w = dequantize_4bit(mod.weight.data, qs)
            extra = {"quant_state_dtype": str(qs.dtype).removeprefix("torch."), "nested": bool(qs.nested)}
        elif isinstance(mod, bnb.nn.Linear8bitLt):
            scb = mod.weight.SCB if getattr(mod.weight, "SCB", None) is not None else mod.state.SCB
            w = int8_vectorwise_dequant(mod.weight.data, scb)
            extra = {
                "SCB_dtype": str(scb.dtype).removeprefix("torch."),
                "CB_dtype": str(mod.weight.dtype).removeprefix("torch."),
            }
        else:
            continue
        weights[mname] = {
            "dtype": str(w.dtype).removeprefix("torch."),
            "shape": list(w.shape),
            "sha256": _sha(w),
            "first4": _f32_list(w.reshape(-1)[:4].float().numpy()),
            **extra,
        }
    rec["weights"] = weights
    rec["unquantized_linears"] = {
        n: str(m.weight.dtype).removeprefix("torch.") for n, m in model.named_modules() if type(m) is torch.nn.Linear
    }
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    rec["embedding"] = {"class": type(emb).__name__, "dtype": str(emb.weight.dtype).removeprefix("torch.")}
    rec["lm_head"] = {
        "class": type(head).__name__,
        "dtype": str(head.weight.dtype).removeprefix("torch."),
        "tied_to_embedding": head.weight.data_ptr() == emb.weight.data_ptr(),
    }
    rec["model_config_dtype"] = str(model.config.dtype).removeprefix("torch.")

    # 2. model.dequantize() then .float().
    model.dequantize()
    model = model.float()
    rec["dequantized_linear_dtype_before_float"] = None  # filled below from a fresh reload
    _record_logits(rec, "dequantized", _logits(model, ids))
    rec["greedy_dequantized"], rec["greedy_dequantized_margins"] = _greedy(model, ids)
    rec["decode_ms_per_token_dequantized_fp32"] = _decode_ms(model, ids)
    del model
    m2 = _load(out_dir)
    m2.dequantize()
    rec["dequantized_linear_dtype_before_float"] = str(m2.model.layers[0].self_attn.q_proj.weight.dtype).removeprefix(
        "torch."
    )
    del m2

    # 3. the quantized model's own forward (this machine's default bitsandbytes CPU path).
    model = _load(out_dir)
    four_bit = any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    if four_bit:
        rec["bnb_forward_path"] = (
            "avx512bf16 repacked weight (packing_format_for_cpu), bf16 absmax, "
            "bitsandbytes::gemv_4bit cpu kernel (lib.gemv_4bit_inference_cpu_*_bf16) with bf16 activations"
            if has_avx512bf16()
            else "bitsandbytes::gemm_4bit default: dequantize_4bit to compute dtype + F.linear"
        )
    else:
        threshold = model.config.quantization_config.llm_int8_threshold
        mm = "torch._int_mm" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "fp32 matmul fallback"
        rec["bnb_forward_path"] = (
            f"Linear8bitLt: int8_vectorwise_quant of activations (threshold {threshold:.1f} outlier columns in "
            f"activation dtype), bitsandbytes::int8_linear_matmul cpu ({mm}), int8_mm_dequant default"
        )
    _record_logits(rec, "bnb_forward", _logits(model, ids))
    rec["greedy_bnb_forward"], rec["greedy_bnb_forward_margins"] = _greedy(model, ids)
    rec["decode_ms_per_token_bnb_forward"] = _decode_ms(model, ids)
    del model

    # 4. 4-bit: the generic path (no AVX512-BF16 repacking).
    if four_bit:
        model = _load(out_dir)
        for m in model.modules():
            if isinstance(m, bnb.nn.Linear4bit):
                m.support_avx512bf16_for_cpu = False
        rec["bnb_forward_generic_path"] = (
            "bitsandbytes::gemm_4bit default: dequantize_4bit (cpu kernel) to compute dtype + F.linear"
        )
        _record_logits(rec, "bnb_forward_generic", _logits(model, ids))
        rec["greedy_bnb_forward_generic"], rec["greedy_bnb_forward_generic_margins"] = _greedy(model, ids)
        rec["decode_ms_per_token_bnb_forward_generic"] = _decode_ms(model, ids)
        del model

    # reference: the float base model itself, not quantized
    basem = AutoModelForCausalLM.from_pretrained(base, device_map="cpu").float().eval()
    rec["greedy_base_fp32"], _ = _greedy(basem, ids)
    rec["logits_base_fp32_sha256"] = _sha(_logits(basem, ids))
    del basem

    (FIXTURES / f"{name}.json").write_text(_dumps(rec))
    return rec


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    args = ap.parse_args(argv)
    names = args.only or list(VARIANTS)
    torch.set_num_threads(1)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        bases: dict[str, Path] = {}
        for bname in sorted({VARIANTS[n][0] for n in names}):
            bases[bname] = make_base(Path(tmp) / bname, bname)
        failed = {}
        for n in names:
            t0 = time.time()
            try:
                make_variant(n, bases)
                print(f"{n}: ok ({time.time() - t0:.1f}s)", flush=True)
            except Exception as e:  # report and go on with the others
                import traceback

                traceback.print_exc()
                failed[n] = f"{type(e).__name__}: {e}"
                print(f"{n}: FAILED {failed[n]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
