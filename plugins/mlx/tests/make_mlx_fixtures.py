"""Write the MLX fixtures of the mlx plugin's tests with mlx-lm's own ``convert``.

Not run by the tests (they only read what this wrote into ``fixtures/``). For each fixture it

1. builds a small random transformers model with :mod:`anyquant.testing.tiny` (bfloat16, the byte
   tokenizer, vocab 259, RMSNorm weights reset to 1 + N(0, 0.1) so that the logits are decisive;
   MLX groups run along the *last* axis, the hidden size 128, so the
   embedding and the head quantize whatever the vocabulary size): ``llama`` (untied head),
   ``llama_tied``, ``qwen3`` (head_dim 32) and ``qwen3moe`` (4 experts, 2 per token,
   moe_intermediate_size 128; ``num_experts`` and ``rope_theta`` are added to its config.json,
   which transformers 5 writes as ``num_local_experts`` / ``rope_parameters`` only and mlx-lm's
   qwen3_moe requires);
2. converts it with ``mlx_lm.convert(hf_path, mlx_path, quantize=True, q_bits=B, q_group_size=G,
   q_mode=M, quant_predicate=P)`` (what ``python -m mlx_lm convert -q ...`` runs) into
   ``fixtures/<name>/``, untouched;
3. loads it back with ``mlx_lm.load`` and records into ``fixtures/<name>.json``: the config's
   ``quantization`` / ``quantization_config``, the safetensors header (name -> dtype, shape), for
   every quantized module the peer's ``mx.dequantize(weight, scales, biases, group_size, bits,
   mode)`` (its dtype, shape, sha256 of the float32 bytes, first values), the prompt's ids, the
   logits of every prompt position with every floating parameter (norms, scales, biases, dense
   weights) cast to float32 (``logits``, float32 forward) and as loaded (``logits_native``, in the
   dtype the model computes in), and 8 greedy tokens (argmax, full recompute, float32 model).

The output is deterministic on one machine (mlx CPU build): a rerun writes the same bytes.

Run from the repository root, with the project venv (torch + transformers) for the base models and
a second venv holding mlx for the rest::

    python3 -m venv /root/peers/mlx
    /root/peers/mlx/bin/pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2
    .venv/bin/python plugins/mlx/tests/make_mlx_fixtures.py --mlx-python /root/peers/mlx/bin/python

``--only NAME ...`` remakes some fixtures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
REPO = HERE.parents[2]
PROMPT = "The quick brown fox jumps over the lazy dog"
NEW_TOKENS = 8
#: seed of the RMSNorm weights (see :func:`_renorm`), picked among a few so that the greedy margins stay clear.
NORM_SEED = int(os.environ.get("FIXTURE_NORM_SEED", "2"))

#: name -> (base model, convert kwargs)
FIXTURE_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_q4_g64": ("llama", {"q_bits": 4, "q_group_size": 64}),
    "llama_q8_g64": ("llama", {"q_bits": 8, "q_group_size": 64}),
    "llama_q2_g32": ("llama", {"q_bits": 2, "q_group_size": 32}),
    "llama_q3_g64": ("llama", {"q_bits": 3, "q_group_size": 64}),
    "llama_q5_g64": ("llama", {"q_bits": 5, "q_group_size": 64}),
    "llama_q6_g128": ("llama", {"q_bits": 6, "q_group_size": 128}),
    "llama_mixed": ("llama", {"q_group_size": 64, "quant_predicate": "mixed_3_6"}),
    "llama_q4_tied": ("llama_tied", {"q_bits": 4, "q_group_size": 64}),
    "qwen3_q4_g64": ("qwen3", {"q_bits": 4, "q_group_size": 64}),
    "qwen3moe_q4_g64": ("qwen3moe", {"q_bits": 4, "q_group_size": 64}),
    "llama_mxfp4": ("llama", {"q_mode": "mxfp4"}),
    "llama_nvfp4": ("llama", {"q_mode": "nvfp4"}),
    "llama_mxfp8": ("llama", {"q_mode": "mxfp8"}),
}

BASES: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama_tied": {"tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
    "qwen3moe": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}


# ---------------------------------------------------------------- base models (torch side)


def _renorm(st: Path, seed: int = NORM_SEED) -> None:
    """Set every RMSNorm weight to 1 + N(0, 0.1): the helper draws them N(0, 0.08) like the rest,
    which leaves logits within +-0.3 and greedy margins around 0.01."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(st))
    gen = torch.Generator().manual_seed(seed)
    for k in sorted(tensors):
        if k.endswith("norm.weight"):
            t = tensors[k]
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            tensors[k] = (1.0 + 0.1 * noise).to(t.dtype)
    save_file(tensors, str(st), metadata={"format": "pt"})


def make_bases(out: Path, names: set[str]) -> list[int]:
    sys.path.insert(0, str(REPO / "core" / "src"))
    from anyquant.testing.tiny import make_tiny_dense, make_tokenizer

    for name in sorted(names):
        overrides = dict(BASES[name])
        path = make_tiny_dense(out / name, seed=0, dtype="bfloat16", **overrides)
        _renorm(path / "model.safetensors")
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        if name == "qwen3moe":
            cfg.setdefault("num_experts", cfg.get("num_local_experts", 4))
            cfg.setdefault("rope_theta", cfg["rope_parameters"]["rope_theta"])
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    ids: list[int] = make_tokenizer().encode(PROMPT)
    return ids


# ---------------------------------------------------------------- conversion + recording (mlx side)


def _f32_list(a: Any) -> Any:
    import numpy as np

    x = np.asarray(a, dtype=np.float32)
    if x.ndim == 0:
        return float(str(x))
    return [_f32_list(r) for r in x] if x.ndim > 1 else [float(str(v)) for v in x]


def _safetensors_header(path: Path) -> dict[str, Any]:
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None)
    tensors = {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in sorted(header.items())}
    return {"metadata": meta, "tensors": tensors}


def _sha(x: Any) -> str:
    import mlx.core as mx
    import numpy as np

    return hashlib.sha256(np.array(x.astype(mx.float32)).tobytes()).hexdigest()


def _forward(model: Any, ids: list[int]) -> Any:
    import mlx.core as mx

    out = model(mx.array([ids]))[0]
    mx.eval(out)
    return out


def record(base_dir: Path, names: list[str], prompt_ids: list[int]) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    import numpy as np
    from mlx.utils import tree_map
    from mlx_lm.convert import convert
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in names:
        base, kwargs = FIXTURE_SPECS[name]
        out_dir = FIXTURES / name
        if out_dir.exists():
            shutil.rmtree(out_dir)
        print(f"== {name}: convert {base} {kwargs}", flush=True)
        convert(str(base_dir / base), str(out_dir), quantize=True, **kwargs)

        cfg = json.loads((out_dir / "config.json").read_text())
        model, tok = mlx_lm.load(str(out_dir))
        ids = tok.encode(PROMPT)
        assert list(ids) == prompt_ids, (ids, prompt_ids)

        weights: dict[str, Any] = {}
        for path, m in model.named_modules():
            if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
                continue
            biases = m.get("biases")
            gscale = m.get("global_scale")
            kw = {"global_scale": gscale} if gscale is not None else {}
            d = mx.dequantize(m.weight, m.scales, biases, m.group_size, m.bits, m.mode, **kw)
            mx.eval(d)
            weights[path] = {
                "class": type(m).__name__,
                "bits": m.bits,
                "group_size": m.group_size,
                "mode": m.mode,
                "weight_dtype": str(m.weight.dtype).split(".")[-1],
                "scales_dtype": str(m.scales.dtype).split(".")[-1],
                "biases_dtype": None if biases is None else str(biases.dtype).split(".")[-1],
                "dtype": str(d.dtype).split(".")[-1],
                "shape": list(d.shape),
                "sha256_f32": _sha(d),
                "first4": _f32_list(d.astype(mx.float32).reshape(-1)[:4]),
            }

        native = _forward(model, prompt_ids)
        native_dtype = str(native.dtype).split(".")[-1]

        def to_f32(p: Any) -> Any:
            return p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p

        # mlx-lm's own dequantize_model (mx.dequantize per layer, in the scales' dtype), then float32: the forward
        # with the exact dequantized weights, which anyquant's dequantized/reference backends compute
        from mlx_lm.utils import dequantize_model

        dq_model, _ = mlx_lm.load(str(out_dir))
        dq_model = dequantize_model(dq_model)
        dq_model.update(tree_map(to_f32, dq_model.parameters()))
        dq_seq, dq_greedy = list(prompt_ids), []
        dq_logits = np.array(_forward(dq_model, dq_seq))
        for _ in range(NEW_TOKENS):
            dq_greedy.append(int(np.argmax(np.array(_forward(dq_model, dq_seq)[-1]))))
            dq_seq.append(dq_greedy[-1])

        model.update(tree_map(to_f32, model.parameters()))
        logits = _forward(model, prompt_ids)
        assert logits.dtype == mx.float32, logits.dtype

        seq = list(prompt_ids)
        greedy, margins = [], []
        for _ in range(NEW_TOKENS):
            last = np.array(_forward(model, seq)[-1])
            top = np.argsort(-last, kind="stable")[:2]
            greedy.append(int(top[0]))
            margins.append(float(str(np.float32(last[top[0]] - last[top[1]]))))
            seq.append(int(top[0]))

        # mlx-lm's own greedy decoding (KV cache, argmax sampler), for reference.
        from mlx_lm.generate import generate_step

        gen = [
            int(t)
            for t, _ in generate_step(
                mx.array(prompt_ids), model, max_tokens=NEW_TOKENS, sampler=lambda x: mx.argmax(x, axis=-1)
            )
        ]

        lg = np.array(logits)
        rec = {
            "name": name,
            "base": base,
            "convert_kwargs": kwargs,
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "quantization": cfg.get("quantization"),
            "quantization_config": cfg.get("quantization_config"),
            "files": sorted(p.name for p in out_dir.iterdir()),
            "safetensors": _safetensors_header(out_dir / "model.safetensors"),
            "prompt": PROMPT,
            "prompt_ids": prompt_ids,
            "weights": weights,
            "logits_dtype": "float32 (every floating parameter, incl. scales/biases, cast to float32)",
            "logits_sha256": hashlib.sha256(lg.astype(np.float32).tobytes()).hexdigest(),
            "logits": _f32_list(lg),
            "logits_dequantized_dtype": "float32 (mlx_lm.utils.dequantize_model, then every parameter float32)",
            "logits_dequantized": _f32_list(dq_logits),
            "greedy_dequantized": dq_greedy,
            "logits_native_dtype": native_dtype,
            "logits_native": _f32_list(np.array(native.astype(mx.float32))),
            "greedy": greedy,
            "greedy_margins": margins,
            "greedy_mlx_lm_generate_step": gen,
        }
        (FIXTURES / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
        size = sum(p.stat().st_size for p in out_dir.iterdir())
        print(f"   {name}: {size} bytes, greedy {greedy} (generate_step {gen})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlx-python", help="python of a venv with mlx + mlx-lm")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--record", nargs=2, metavar=("BASE_DIR", "PROMPT_IDS_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = args.only or list(FIXTURE_SPECS)
    if args.record:
        record(Path(args.record[0]), names, json.loads(args.record[1]))
        return
    if not args.mlx_python:
        ap.error("--mlx-python is required")
    with tempfile.TemporaryDirectory() as tmp:
        ids = make_bases(Path(tmp), {FIXTURE_SPECS[n][0] for n in names})
        subprocess.run(
            [args.mlx_python, __file__, "--record", tmp, json.dumps(ids), "--only", *names],
            check=True,
        )


if __name__ == "__main__":
    main()
