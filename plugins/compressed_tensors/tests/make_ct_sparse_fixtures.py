"""Generate tiny, real sparse compressed-tensors checkpoints (``sparse-24-bitmask``, ``sparse-bitmask``) with
llm-compressor, plus recorded outputs.

Not run by the test suite. compressed-tensors dropped its sparse compressors after 0.14 (0.19's ModelCompressor
writes ``"sparsity_config": {}``, and llm-compressor >= 0.11 only warns "Sparse compression is no longer supported"),
so this needs an older peer than ``make_ct_fixtures.py``'s: llm-compressor 0.10.0.4, the last release that writes
sparse checkpoints, with its compressed-tensors 0.14.0.1 and transformers 4.57.6. Torch and the rest came from the
``/root/peers/ct`` venv through a ``.pth`` line (llm-compressor 0.10 pins torch<=2.10; 2.13 ran it)::

    python3.11 -m venv /tmp/lc010
    /tmp/lc010/bin/pip install --no-deps llmcompressor==0.10.0.4 compressed-tensors==0.14.0.1 \\
        transformers==4.57.6 huggingface-hub==0.36.0 tokenizers==0.22.1 datasets==4.4.1
    echo /root/peers/ct/lib/python3.11/site-packages > /tmp/lc010/lib/python3.11/site-packages/zz_peer.pth

Run from the repo root (CPU, under a minute)::

    PYTHONPATH=core/src /tmp/lc010/bin/python plugins/compressed_tensors/tests/make_ct_sparse_fixtures.py [NAME ...]

Each fixture is ``oneshot(model, recipe=[SparseGPTModifier(...), (QuantizationModifier(...))])`` on a 1-layer random
Llama, then ``model.save_pretrained(dir, save_compressed=True[, sparsity_config=...])`` as llm-compressor writes it.
``fixtures/NAME.json`` records, as ``make_ct_fixtures.py`` does, the peer's decompressed weights and float32 forward:
the folder loaded back with ``AutoModelForCausalLM.from_pretrained(dir, quantization_config=
CompressedTensorsConfig(run_compressed=False))`` (transformers' ``ModelCompressor.decompress_model``: the sparsity
compressor first, then the quantization compressor), cross-checked bit for bit against a model-free decompression of
the raw tensors (``BaseCompressor.load_from_registry(sparsity format).decompress_weight`` then, for a quantized
module, the quantization compressor's ``decompress_weight``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_ct_fixtures as base  # noqa: E402  (sets the environment, puts core/src on the path)

from anyquant.testing.tiny import make_tokenizer, tiny_llama_config  # noqa: E402

FIXTURES = base.FIXTURES


def base_model(seed: int = 0, **overrides: Any) -> Any:
    """A 1-layer random Llama in bfloat16 (``make_ct_fixtures.base_model``'s init), through disk."""
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_llama_config(num_hidden_layers=1, **overrides)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.08)
    folder = Path(tempfile.mkdtemp(prefix="ct_sparse_base_"))
    model.to(torch.bfloat16).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def sparsegpt(mask_structure: str) -> Any:
    from llmcompressor.modifiers.pruning import SparseGPTModifier

    return SparseGPTModifier(sparsity=0.5, mask_structure=mask_structure, targets=["Linear"], ignore=["lm_head"])


def fp8(scheme: str) -> Any:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(scheme=scheme, targets=["Linear"], ignore=["lm_head"])


def bitmask_config() -> Any:
    """llm-compressor writes 2:4 or dense on its own; the general bitmask is its user-given ``sparsity_config``."""
    from compressed_tensors.config import BitmaskConfig

    return BitmaskConfig(targets=["Linear"], ignore=["lm_head"], sparsity_structure="unstructured")


NARROW = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}

# name -> (base model overrides, recipe, save_pretrained kwargs)
SPECS: dict[str, tuple[dict[str, Any], Callable[[], list[Any]], Callable[[], dict[str, Any]]]] = {
    "llama_sparse24": ({}, lambda: [sparsegpt("2:4")], dict),
    "llama_sparse24_fp8": ({}, lambda: [sparsegpt("2:4"), fp8("FP8_DYNAMIC")], dict),
    "llama_sparse_bitmask": (NARROW, lambda: [sparsegpt("0:0")], lambda: {"sparsity_config": bitmask_config()}),
}


def peer_model(folder: Path, sparse_format: str) -> Any:
    """compressed-tensors' decompressed model. transformers 4.57 cannot load a ``sparse-bitmask`` folder (its
    quantizer compresses the meta-device skeleton first, which ``BitmaskCompressor`` cannot), so that one is
    decompressed from disk by ``ModelCompressor.decompress(folder, model)`` into the config's dense model."""
    import torch
    from compressed_tensors import ModelCompressor
    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig

    if sparse_format != "sparse-bitmask":
        return AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=CompressedTensorsConfig(run_compressed=False), dtype="auto"
        ).eval()  # "auto": transformers 5's default (4.57's quantizer would pick float16)
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ModelCompressor.from_pretrained(str(folder)).decompress(str(folder), model)
    return model


def record(name: str, folder: Path, tok: Any, meta: dict[str, Any]) -> dict[str, Any]:
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.config import SparsityCompressionConfig
    from safetensors.torch import load_file

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    model = peer_model(folder, qc["sparsity_config"]["format"])
    raw: dict[str, Any] = {}
    for f in folder.glob("*.safetensors"):
        raw.update(load_file(str(f)))
    sparse_cfg = SparsityCompressionConfig.model_validate(qc["sparsity_config"])
    sparsity = BaseCompressor.load_from_registry(sparse_cfg.format, config=sparse_cfg)
    params = sparsity.compression_param_names
    weights: dict[str, Any] = {}
    for mname, mod in model.named_modules():
        prefix = mname + "."
        local = {k[len(prefix) :]: v for k, v in raw.items() if k.startswith(prefix) and "." not in k[len(prefix) :]}
        if "bitmask" not in local:
            continue
        w = mod.weight.data
        dense = sparsity.decompress_weight({p: local[p] for p in params})
        scheme = getattr(mod, "quantization_scheme", None)
        fmt = None
        if scheme is not None and scheme.weights is not None:
            fmt = str(getattr(scheme.format, "value", scheme.format) or qc.get("format"))
            quant = BaseCompressor.load_from_registry(fmt)
            data = {"weight": dense, **{k: v for k, v in local.items() if k.startswith("weight_")}}
            dense = quant.decompress_weight(data, scheme.weights).to(w.dtype)
        weights[mname] = {
            "dtype": str(w.dtype).replace("torch.", ""),
            "shape": list(w.shape),
            "sha256_f32": base._sha(w),
            "first4": [float(v) for v in w.float().flatten()[:4]],
            "format": fmt,
            "sparsity_format": sparse_cfg.format,
            "zeros": int((w == 0).sum()),
            "model_free_equal": bool(dense.dtype == w.dtype and torch.equal(dense, w)),
        }
    ids = tok(base.PROMPT, add_special_tokens=False)["input_ids"]
    model = torch.nn.Module.float(model)  # transformers 4.57 refuses .float() on a quantized model
    x = torch.tensor([ids])
    has_act = any(
        getattr(getattr(m, "quantization_scheme", None), "input_activations", None) is not None for m in model.modules()
    )
    out: dict[str, Any] = {
        "name": name,
        **meta,
        "format": qc.get("format") or sparse_cfg.format,
        "sparsity_format": sparse_cfg.format,
        "group_formats": {g: v.get("format") for g, v in (qc.get("config_groups") or {}).items()},
        "versions": base._versions(),
        "prompt": base.PROMPT,
        "prompt_ids": ids,
        "decompressed_with": "AutoModelForCausalLM.from_pretrained(dir, quantization_config="
        "CompressedTensorsConfig(run_compressed=False)) (ModelCompressor.decompress_model: sparsity, then "
        "quantization); cross-checked against BaseCompressor.load_from_registry(sparsity format).decompress_weight "
        "then the quantization compressor's decompress_weight on the raw tensors",
        "weights": weights,
    }
    with torch.no_grad():
        base._set_quant_enabled(model, False)
        out["logits_dequantized"] = base._logits(model(x).logits[0])
        out["greedy_dequantized"] = base._greedy(model, ids)
        if has_act:
            # compressed-tensors 0.14 leaves decompress_model's modules FROZEN, so its forward would fake-quantize
            # the decompressed weights a second time (0.19 marks them DECOMPRESSED and does not): the weights'
            # arguments are taken off the schemes, and the forward quantizes the input activations alone
            for m in model.modules():
                if getattr(m, "quantization_scheme", None) is not None:
                    m.quantization_scheme.weights = None
            base._set_quant_enabled(model, True)
            out["logits_quant_forward"] = base._logits(model(x).logits[0])
            out["greedy_quant_forward"] = base._greedy(model, ids)
            out["logits_quant_forward_note"] = (
                "float32 model, quantization_enabled=True, the schemes' weights arguments removed: compressed-tensors' "
                "quantized_forward fake-quantizes the input activations; the weights are the exact decompressed values"
            )
    out["tensors"] = base._tensor_table(folder)
    return out


def make(name: str) -> dict[str, Any]:
    import torch
    from llmcompressor import oneshot

    overrides, recipe_fn, save_fn = SPECS[name]
    tok = make_tokenizer()
    model = base_model(**overrides)
    recipe = recipe_fn()
    torch.manual_seed(1234)
    t0 = time.perf_counter()
    model = oneshot(
        model=model,
        recipe=recipe,
        tokenizer=tok,
        dataset=base.calib_dataset(tok),
        num_calibration_samples=len(base.CALIB_TEXTS),
        max_seq_length=128,
        shuffle_calibration_samples=False,
        pipeline="sequential",  # the data-free pipeline of llm-compressor 0.10 dispatches to a GPU only
    )
    dt = time.perf_counter() - t0
    folder = FIXTURES / name
    if folder.exists():
        shutil.rmtree(folder)
    save_kw = save_fn()
    model.save_pretrained(folder, save_compressed=True, **save_kw)
    tok.save_pretrained(folder)
    meta = {
        "base": {"num_hidden_layers": 1, **overrides},
        "recipe": [str(r) for r in recipe],
        "save_kwargs": {k: repr(v) for k, v in save_kw.items()},
        "calibration_samples": len(base.CALIB_TEXTS),
        "oneshot_seconds": round(dt, 2),
    }
    rec = record(name, folder, tok, meta)
    (FIXTURES / f"{name}.json").write_text(base.dump_json(rec))
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=list(SPECS))
    for name in ap.parse_args().names:
        rec = make(name)
        eq = all(w["model_free_equal"] for w in rec["weights"].values())
        print(f"OK {name}: format={rec['format']} sparsity={rec['sparsity_format']} model_free_equal={eq}", flush=True)


if __name__ == "__main__":
    main()
