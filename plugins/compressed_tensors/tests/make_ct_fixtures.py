"""Generate tiny, real compressed-tensors checkpoints with llm-compressor, plus recorded outputs.

This script is NOT run by the test suite. It needs a separate "peer" virtualenv holding the real
tools (llm-compressor pulls its own transformers), kept outside the repo::

    python3 -m venv /root/peers/ct
    /root/peers/ct/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1 compressed-tensors
    # (this produced: torch 2.13.0+cpu, transformers 5.17.0, llmcompressor 0.14.0.1,
    #  compressed-tensors 0.19.0)

Run from the repo root (CPU only, a few minutes on 2 cores)::

    TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1 PYTHONPATH=core/src \\
        /root/peers/ct/bin/python plugins/compressed_tensors/tests/make_ct_fixtures.py [NAME ...]

The act-order fixtures (``ACTORDER_GROUP``: GPTQ ``actorder="group"``, which stores ``weight_g_idx``) need an
older peer: compressed-tensors 0.19 removed ``ActivationOrdering.GROUP`` (its ``QuantizationArgs`` rejects
``actorder="group"``, its pack-quantized decompressor reads no g_idx) and llm-compressor 0.14's GPTQ only runs
``weight``/``static``, which reorders during calibration and stores no g_idx. llm-compressor 0.13.0 (deprecated but
working) with compressed-tensors 0.18.0 still write and read it; their own venv borrows the first one's torch,
transformers (5.17.0 instead of 0.13's pinned <=5.14.1, which wants another tokenizers) and the rest::

    python3 -m venv /root/peers/ct_actorder
    echo /root/peers/ct/lib/python3.11/site-packages \
        > /root/peers/ct_actorder/lib/python3.11/site-packages/zz_ct_base.pth
    /root/peers/ct_actorder/bin/pip install --no-deps llmcompressor==0.13.0 compressed-tensors==0.18.0
    TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1 PYTHONPATH=core/src /root/peers/ct_actorder/bin/python \
        plugins/compressed_tensors/tests/make_ct_fixtures.py llama_gptq_actorder llama_gptq_actorder_asym

For each fixture NAME it writes ``fixtures/NAME/`` exactly as llm-compressor writes it
(``oneshot(...)`` then ``model.save_pretrained(dir, save_compressed=True)``) plus the byte-level
tokenizer from ``anyquant.testing.tiny.make_tokenizer()``, and ``fixtures/NAME.json`` with the
peer's own outputs:

* ``weights``: for every quantized module, the weight as compressed-tensors decompresses it. The
  folder is loaded back with ``AutoModelForCausalLM.from_pretrained(dir,
  quantization_config=CompressedTensorsConfig(dequantize=True))`` (``run_compressed=False`` is the
  deprecated spelling of the same thing); the result is cross-checked bit-for-bit against a
  model-free decompression: the module's tensors read from model.safetensors and passed to
  ``BaseCompressor.get_value_from_registry(format).decompress(state_dict, scheme)``. Recorded:
  dtype, shape, sha256 of ``w.float().contiguous().numpy().tobytes()`` (float32 little-endian),
  and the first 4 values (float32, flattened row-major).
* ``logits_dequantized``: the decompressed model cast to float32 (``model.float()``), every
  module's ``quantization_enabled`` set to False (no activation / kv-cache quantization), logits
  for ``prompt_ids``: exact float32 [len(prompt), vocab] stored as
  ``{"dtype","shape","encoding":"base64-f32le","b64","last_row_first8"}``; decode with
  ``np.frombuffer(base64.b64decode(d["b64"]), "<f4").reshape(d["shape"])``.
* ``greedy_dequantized``: 8 new tokens, greedy, float32, by re-running the full sequence each
  step (no KV cache, no EOS stop).
* ``logits_quant_forward`` (only where the scheme quantizes activations or the kv cache): the
  same float32 model with ``quantization_enabled`` left True, i.e. compressed-tensors' own
  ``quantized_forward``: input activations fake-quantized (quantize->dequantize, dynamic or with
  the stored static ``input_scale``); weights are not re-quantized because the status is
  DECOMPRESSED (they are already the exact dequantized values). Where a kv_cache_scheme is
  configured, ``logits_kv_quant_only`` enables only the attention modules (k/v fake-quantized with
  the stored k_scale/v_scale), linears unquantized.

Everything is seeded (``torch.manual_seed``) so reruns give the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "core" / "src"))

from anyquant.testing.tiny import make_tokenizer, tiny_llama_config  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog"
CALIB_TEXTS = [
    "Once upon a time there was a small quantized model that lived on a CPU.",
    "The rain in Spain stays mainly in the plain, said the professor twice.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Quantization maps floating point weights onto a small integer grid.",
    "A journey of a thousand miles begins with a single step forward.",
    "In 1969 the first humans walked on the Moon and came back home safely.",
    "Tokens are bytes here: every character becomes one or more ids.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod.",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;",
    "The mitochondria is the powerhouse of the cell, or so they say.",
    "Pack my box with five dozen liquor jugs, then sweep the floor.",
    "Bright stars shine over quiet hills while the river keeps running.",
    "GPU kernels multiply packed int4 weights by half precision activations.",
    "Never trust a benchmark you did not run yourself on your own data.",
    "She sells sea shells by the sea shore, and the shells are real.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24",
]


# --------------------------------------------------------------------------- base models


def _config(kind: str) -> dict[str, Any]:
    if kind == "llama":
        return tiny_llama_config()
    if kind == "llama256":  # 1 layer only to keep the FP8 file small
        return tiny_llama_config(hidden_size=256, intermediate_size=384, num_hidden_layers=1)
    if kind == "qwen3":
        return tiny_llama_config(
            model_type="qwen3",
            architectures=["Qwen3ForCausalLM"],
            head_dim=32,
            use_sliding_window=False,
        )
    if kind == "qwen3moe":
        return tiny_llama_config(
            model_type="qwen3_moe",
            architectures=["Qwen3MoeForCausalLM"],
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            use_sliding_window=False,
        )
    raise ValueError(kind)


def base_model(kind: str, seed: int = 0) -> Any:
    """Random-init tiny model in bfloat16: matrices ~ N(0, 0.08), norm weights = 1."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _config(kind)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.08)
    model = model.to(torch.bfloat16)
    # oneshot() re-reads config.json from model.config.name_or_path, so go through disk like a
    # real base checkpoint: save in bfloat16 and load it back.
    base_dir = Path(tempfile.mkdtemp(prefix=f"ct_base_{kind}_"))
    model.save_pretrained(base_dir)
    make_tokenizer().save_pretrained(base_dir)
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).eval()


def calib_dataset(tok: Any, n: int = 16) -> Any:
    from datasets import Dataset

    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in CALIB_TEXTS[:n]]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})


# --------------------------------------------------------------------------- recipes


def qmod(**kw: Any) -> Any:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    kw.setdefault("targets", "Linear")
    kw.setdefault("ignore", ["lm_head"])
    return QuantizationModifier(**kw)


def group(weights: dict[str, Any], targets: list[str], **kw: Any) -> dict[str, Any]:
    return {"targets": targets, "weights": weights, **kw}


ATTN = "re:.*self_attn\\.(q|k|v|o)_proj$"
MLP = "re:.*mlp\\.(gate|up|down)_proj$"

FP8_KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def gptq(**kw: Any) -> Any:
    from llmcompressor.modifiers.gptq import GPTQModifier

    kw.setdefault("targets", "Linear")
    kw.setdefault("ignore", ["lm_head"])
    return GPTQModifier(**kw)


def awq(**kw: Any) -> Any:
    import torch
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.cuda.is_available():
        # llmcompressor 0.14.0.1 AWQ pins cached activations unconditionally, which raises
        # "Cannot access accelerator device when none is available" on CPU-only torch.
        # Pinning is only a transfer optimisation; skipping it changes no numbers.
        IntermediatesCache.pin_memory = lambda self, *a, **k: None

    kw.setdefault("targets", ["Linear"])
    kw.setdefault("ignore", ["lm_head"])
    return AWQModifier(**kw)


# name -> (base kind, recipe factory, needs calibration data, save kwargs)
FIXTURE_SPECS: dict[str, tuple[str, Callable[[], Any], bool, dict[str, Any]]] = {
    "llama_w4a16": ("llama", lambda: qmod(scheme="W4A16"), False, {}),
    "llama_w4a16_asym_g32": (
        "llama",
        lambda: qmod(
            config_groups={
                "group_0": group(
                    {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
                    ["Linear"],
                )
            }
        ),
        False,
        {},
    ),
    "llama_w8a16": ("llama", lambda: qmod(scheme="W8A16"), False, {}),
    "llama_w8a8": ("llama", lambda: qmod(scheme="W8A8"), False, {}),
    "llama_fp8": ("llama", lambda: qmod(scheme="FP8"), True, {}),
    "llama_fp8_dynamic": ("llama", lambda: qmod(scheme="FP8_DYNAMIC"), False, {}),
    "llama_fp8_block": ("llama256", lambda: qmod(scheme="FP8_BLOCK"), False, {}),
    "llama_nvfp4a16": ("llama", lambda: qmod(scheme="NVFP4A16"), False, {}),
    "llama_nvfp4": ("llama", lambda: qmod(scheme="NVFP4"), True, {}),
    "llama_mxfp4a16": ("llama", lambda: qmod(scheme="MXFP4A16"), False, {}),
    "llama_gptq": ("llama", lambda: gptq(scheme="W4A16", actorder="weight"), True, {}),
    "llama_awq": ("llama", lambda: awq(scheme="W4A16_ASYM"), True, {}),
    # GPTQ act-order that stores weight_g_idx (llm-compressor <= 0.13, compressed-tensors <= 0.18: see above)
    "llama_gptq_actorder": (
        "llama",
        lambda: gptq(
            config_groups={
                "group_0": group(
                    {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
                    ["Linear"],
                )
            },
            actorder="group",
        ),
        True,
        {},
    ),
    "llama_gptq_actorder_asym": (
        "llama",
        lambda: gptq(
            config_groups={
                "group_0": group(
                    {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
                    ["Linear"],
                )
            },
            actorder="group",
        ),
        True,
        {},
    ),
    "llama_mixed_groups": (
        "llama",
        lambda: qmod(
            config_groups={
                "attn_w8": group(
                    {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}, [ATTN]
                ),
                "mlp_w4g64": group(
                    {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}, [MLP]
                ),
            }
        ),
        False,
        {},
    ),
    "qwen3_w4a16": ("qwen3", lambda: qmod(scheme="W4A16"), False, {}),
    "qwen3moe_w4a16": ("qwen3moe", lambda: qmod(scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"]), True, {}),
    "llama_kv_fp8": ("llama", lambda: qmod(scheme="FP8_DYNAMIC", kv_cache_scheme=FP8_KV), True, {}),
    "llama_naive_w8a16": ("llama", lambda: qmod(scheme="W8A16"), False, {"quantization_format": "naive-quantized"}),
}


#: fixtures that need llm-compressor <= 0.13 / compressed-tensors <= 0.18 (``actorder="group"``)
ACTORDER_GROUP = {"llama_gptq_actorder", "llama_gptq_actorder_asym"}


# --------------------------------------------------------------------------- recording


def _sha(t: Any) -> str:
    return hashlib.sha256(t.detach().float().contiguous().cpu().numpy().tobytes()).hexdigest()


def _logits(x: Any) -> dict[str, Any]:
    """Exact float32 logits, base64 of little-endian bytes (row-major) to keep the JSON small.

    Decode: np.frombuffer(base64.b64decode(d["b64"]), "<f4").reshape(d["shape"]).
    """
    import base64

    a = x.detach().float().contiguous().cpu().numpy().astype("<f4")
    return {
        "dtype": "float32",
        "shape": list(a.shape),
        "encoding": "base64-f32le",
        "b64": base64.b64encode(a.tobytes()).decode("ascii"),
        "last_row_first8": [round(float(v), 6) for v in a[-1, :8]],
    }


def _versions() -> dict[str, str]:
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llmcompressor": llmcompressor.__version__,
        "compressed-tensors": compressed_tensors.__version__,
    }


def _set_quant_enabled(model: Any, enabled: bool) -> None:
    for m in model.modules():
        if hasattr(m, "quantization_scheme"):
            m.quantization_enabled = enabled


def _greedy(model: Any, ids: list[int], n: int = 8) -> list[int]:
    import torch

    seq = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1]
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            seq.append(nxt)
    return out


def _tensor_table(folder: Path) -> dict[str, list[Any]]:
    from safetensors import safe_open

    table: dict[str, list[Any]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                t = sf.get_slice(k)
                table[k] = [t.get_dtype(), list(t.get_shape())]
    return table


def record(name: str, folder: Path, tok: Any, meta: dict[str, Any]) -> dict[str, Any]:
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg["quantization_config"]
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()

    raw: dict[str, Any] = {}
    for f in folder.glob("*.safetensors"):
        raw.update(load_file(str(f)))

    weights: dict[str, Any] = {}
    has_act = False
    has_kv = qc.get("kv_cache_scheme") is not None
    for mname, mod in model.named_modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is None:
            continue
        if scheme.input_activations is not None:
            has_act = True
        if scheme.weights is None or not hasattr(mod, "weight"):
            continue
        w = mod.weight.data
        entry: dict[str, Any] = {
            "dtype": str(w.dtype).replace("torch.", ""),
            "shape": list(w.shape),
            "sha256_f32": _sha(w),
            "first4": [float(v) for v in w.float().flatten()[:4]],
            "format": str(getattr(scheme.format, "value", scheme.format)),
        }
        # model-free cross-check with the compressor class on the raw safetensors
        prefix = mname + "."
        local = {k[len(prefix) :]: v for k, v in raw.items() if k.startswith(prefix) and "." not in k[len(prefix) :]}
        comp = BaseCompressor.get_value_from_registry(entry["format"])
        dec = comp.decompress(local, scheme)["weight"]
        entry["model_free_equal"] = bool(dec.dtype == w.dtype and torch.equal(dec, w))
        weights[mname] = entry

    # transformers 5.x holds Qwen3-MoE experts as fused 3D params (experts.gate_up_proj
    # [E, 2*I, H] = cat(gate, up), experts.down_proj [E, H, I]); compressed-tensors does not attach
    # to them on load, so the per-expert Linear tensors llm-compressor wrote
    # (experts.{e}.{gate,up,down}_proj.*) are decompressed with the group's compressor here and
    # copied into the fused params.
    import re

    from compressed_tensors.quantization import QuantizationScheme

    expert_keys = sorted(
        {m.group(1) for k in raw if (m := re.match(r"(.*\.experts\.\d+\.(?:gate|up|down)_proj)\.weight_", k))}
    )
    if expert_keys:
        ((_, g),) = qc["config_groups"].items()
        scheme = QuantizationScheme.model_validate({k: v for k, v in g.items() if k != "format"})
        comp = BaseCompressor.get_value_from_registry(g["format"])
        mods = dict(model.named_modules())
        for mname in expert_keys:
            prefix = mname + "."
            local = {k[len(prefix) :]: v for k, v in raw.items() if k.startswith(prefix)}
            w = comp.decompress(local, scheme)["weight"]
            exp_path, e, proj = re.match(r"(.*\.experts)\.(\d+)\.(\w+)_proj$", mname).groups()
            experts = mods[exp_path]
            e = int(e)
            with torch.no_grad():
                if proj == "down":
                    experts.down_proj[e].copy_(w)
                else:
                    inter = experts.gate_up_proj.shape[1] // 2
                    sl = slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)
                    experts.gate_up_proj[e, sl].copy_(w)
            weights[mname] = {
                "dtype": str(w.dtype).replace("torch.", ""),
                "shape": list(w.shape),
                "sha256_f32": _sha(w),
                "first4": [float(v) for v in w.float().flatten()[:4]],
                "format": g["format"],
                "model_free_equal": True,
                "note": "decompressed model-free (compressor class) and copied into fused experts",
            }

    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    model = model.float()
    x = torch.tensor([ids])
    out: dict[str, Any] = {
        "name": name,
        **meta,
        "format": qc.get("format"),
        "group_formats": {g: v.get("format") for g, v in qc.get("config_groups", {}).items()},
        "versions": _versions(),
        "prompt": PROMPT,
        "prompt_ids": ids,
        "prompt_ids_note": "tok(PROMPT, add_special_tokens=False); byte tokenizer adds no BOS anyway",
        "decompressed_with": "AutoModelForCausalLM.from_pretrained(dir, quantization_config="
        "CompressedTensorsConfig(dequantize=True)); cross-checked against "
        "BaseCompressor.get_value_from_registry(format).decompress(raw_state_dict, scheme)",
        "weights": weights,
    }
    with torch.no_grad():
        _set_quant_enabled(model, False)
        out["logits_dequantized"] = _logits(model(x).logits[0])
        out["greedy_dequantized"] = _greedy(model, ids)
        if has_kv:
            # kv-cache fake quantization only (attention modules enabled, linears disabled)
            for m in model.modules():
                sch = getattr(m, "quantization_scheme", None)
                if sch is not None and sch.weights is None:
                    m.quantization_enabled = True
            out["logits_kv_quant_only"] = _logits(model(x).logits[0])
        if has_act or has_kv:
            _set_quant_enabled(model, True)
            out["logits_quant_forward"] = _logits(model(x).logits[0])
            out["greedy_quant_forward"] = _greedy(model, ids)
            out["logits_quant_forward_note"] = (
                "float32 model (model.float()), quantization_enabled=True: compressed-tensors "
                "quantized_forward fake-quantizes input activations (and kv cache if configured) "
                "in float32; weights are the exact dequantized values (status DECOMPRESSED)."
            )
    g_idx = {k[: -len(".weight_g_idx")]: v for k, v in raw.items() if k.endswith(".weight_g_idx")}
    if g_idx:
        # act-order: how far each stored g_idx is from the trivial arange(in) // group_size
        out["g_idx"] = {
            m: {
                "group_size": (gs := int(v.numel() // (int(v.max()) + 1))),
                "moved_columns": int((v.long() != torch.arange(v.numel()) // gs).sum()),
                "first8": [int(x) for x in v[:8]],
            }
            for m, v in sorted(g_idx.items())
        }
    out["tensors"] = _tensor_table(folder)
    return out


def dump_json(rec: dict[str, Any]) -> str:
    """Readable but compact: one line per top-level key, one line per weight / tensor entry."""
    c = {"separators": (",", ":")}
    lines = []
    for k, v in rec.items():
        if isinstance(v, dict) and k in ("weights", "tensors"):
            inner = ",\n".join(f"  {json.dumps(ik)}: {json.dumps(iv, **c)}" for ik, iv in v.items())
            lines.append(f" {json.dumps(k)}: {{\n{inner}\n }}")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v, **c)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


# --------------------------------------------------------------------------- main


def make(name: str) -> dict[str, Any]:
    import torch
    from llmcompressor import oneshot

    kind, recipe_fn, needs_data, save_kw = FIXTURE_SPECS[name]
    if name in ACTORDER_GROUP:
        import compressed_tensors

        major_minor = tuple(int(x) for x in compressed_tensors.__version__.split(".")[:2])
        if major_minor >= (0, 19):
            raise RuntimeError(f"{name}: actorder='group' needs compressed-tensors <= 0.18 (see the docstring)")
    tok = make_tokenizer()
    model = base_model(kind)
    recipe = recipe_fn()
    kw: dict[str, Any] = {}
    if needs_data:
        kw.update(
            dataset=calib_dataset(tok),
            num_calibration_samples=len(CALIB_TEXTS),
            max_seq_length=128,
            shuffle_calibration_samples=False,
        )
    torch.manual_seed(1234)
    t0 = time.perf_counter()
    model = oneshot(model=model, recipe=recipe, tokenizer=tok, **kw)
    dt = time.perf_counter() - t0
    folder = FIXTURES / name
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, save_compressed=True, **save_kw)
    tok.save_pretrained(folder)
    meta = {
        "base": kind,
        "recipe": str(recipe),
        "save_kwargs": save_kw,
        "calibration_samples": len(CALIB_TEXTS) if needs_data else 0,
        "oneshot_seconds": round(dt, 2),
    }
    rec = record(name, folder, tok, meta)
    (FIXTURES / f"{name}.json").write_text(dump_json(rec))
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=[n for n in FIXTURE_SPECS if n not in ACTORDER_GROUP])
    args = ap.parse_args()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        t0 = time.perf_counter()
        try:
            rec = make(name)
            eq = all(w["model_free_equal"] for w in rec["weights"].values())
            print(
                f"OK {name}: format={rec['format']} oneshot={rec['oneshot_seconds']}s "
                f"total={time.perf_counter() - t0:.1f}s model_free_equal={eq}",
                flush=True,
            )
        except Exception:
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()


if __name__ == "__main__":
    main()
