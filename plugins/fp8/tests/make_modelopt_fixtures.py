"""Write the ModelOpt FP8 fixtures (``fixtures/<name>/`` + ``fixtures/<name>.json``) with NVIDIA ModelOpt itself.

Not run by the tests (they only read what this wrote). For each fixture it

1. builds a small random bf16 model from :func:`anyquant.testing.tiny.tiny_llama_config` (hidden 256, as
   ``make_fp8_fixtures.py`` does; norms not all ones);
2. quantizes it on the CPU with ``modelopt.torch.quantization.quantize(model, cfg, forward_loop)`` (``max``
   calibration over the prompt and two more texts), ``cfg`` one of ModelOpt's own configs: ``FP8_DEFAULT_CFG`` (+
   ``FP8_KV_CFG``'s KV-cache quantizers, and one decoder linear left unquantized so that ``exclude_modules`` names
   it), ``FP8_PER_CHANNEL_PER_TOKEN_CFG``, ``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG``;
3. records ModelOpt's own forward of the fake-quantized model (``model.float()``: every quantizer ModelOpt inserted
   applies, inputs included) -- the float32 logits at every position of the prompt and 8 greedy tokens;
4. exports a deep copy with ``modelopt.torch.export.export_hf_checkpoint(model, export_dir=...)``: ModelOpt's
   unified HF checkpoint (``model.safetensors``, ``config.json`` with ``quantization_config``
   ``{"quant_method": "modelopt", "quant_algo": ..., "ignore": [...], "kv_cache_scheme": ...}`` and
   ``hf_quant_config.json``), to which the tokenizer is added;
5. records, from the exported files, every quantized linear's dequantized weight as ModelOpt defines it:
   ``FP8QTensor(shape, float32, weight).dequantize(scale=..., block_sizes=...)`` (``float32(e4m3) * weight_scale``,
   per tensor / per output channel / per 128x128 block; for ``FP8`` also checked equal to
   ``export.quant_utils.from_quantized_weight(weight, weight_scale, "fp8", float32)``): dtype, shape, sha256 of
   the float32 values; and whether it equals the fake-quantized weight ModelOpt's forward used (it does not, for
   most: the export divides the bf16 weight by ``amax / 448`` in bf16 before the e4m3 cast, the fake quantizer
   multiplies by ``448 / amax`` in float32: some codes differ by one e4m3 step);
6. records ModelOpt's forward once more with the exported weights: each FP8 linear's weight set to its dequantized
   checkpoint weight, its weight quantizer disabled, its input (and the KV) quantizers as calibrated -- the
   checkpoint as ModelOpt's own forward runs it (``logits_float32_exported_weights``, greedy tokens).

Run with a venv holding nvidia-modelopt 0.47.0 (outside the repo; its ``[hf]`` extra pins transformers<5.15, so
transformers 5.14.1 here)::

    python3.11 -m venv /root/peers/modelopt
    /root/peers/modelopt/bin/pip install nvidia-modelopt==0.47.0 torch==2.13.0 "transformers>=4.57,<5.15" \\
        safetensors accelerate requests
    TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1 PYTHONPATH=core/src \\
        /root/peers/modelopt/bin/python plugins/fp8/tests/make_modelopt_fixtures.py [NAME ...]

The output is deterministic for a given torch/transformers/modelopt.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import modelopt
import modelopt.torch.quantization as mtq
import torch
import transformers
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.export.quant_utils import from_quantized_weight
from modelopt.torch.quantization.qtensor import FP8QTensor
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from anyquant.testing.tiny import make_tokenizer, tiny_llama_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPT = "The quick brown fox jumps over the lazy dog"
CALIBRATION = (PROMPT, "Pack my box with five dozen liquor jugs.", "Sphinx of black quartz, judge my vow! 0123456789")
NEW_TOKENS = 8

FIXTURE_SPECS: dict[str, dict[str, Any]] = {
    # per-tensor weight + static per-tensor input scale + FP8 KV cache (k_proj.k_scale / v_proj.v_scale);
    # layer 1's down_proj left unquantized: exclude_modules names it beside lm_head and the embedding
    "llama_modelopt_fp8": {
        "seed": 11,
        "config": {"hidden_size": 256, "intermediate_size": 384},
        "quant_cfg": "FP8_DEFAULT_CFG",
        "kv": True,
        "disable": ["*layers.1.mlp.down_proj*"],
    },
    # per-output-channel weight scale, dynamic per-token input quantization
    "qwen3_modelopt_fp8_pcpt": {
        "seed": 12,
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
        "quant_cfg": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    },
    # 128x128 block weight scales ([out/128, 1, in/128, 1]), weight only
    "llama_modelopt_fp8_pb_wo": {
        "seed": 13,
        "config": {"hidden_size": 256, "intermediate_size": 384},
        "quant_cfg": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",
    },
}


def f32_list(t: torch.Tensor) -> list[list[float]]:
    """A float32 tensor's values as the shortest decimals that read back to the same float32 (a smaller json)."""
    return [[float(str(v)) for v in row] for row in t.detach().float().numpy()]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def raw_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def quant_cfg(spec: dict[str, Any]) -> dict[str, Any]:
    cfg = copy.deepcopy(getattr(mtq, spec["quant_cfg"]))
    entries = list(cfg["quant_cfg"])
    if spec.get("kv"):
        kv = mtq.FP8_KV_CFG["quant_cfg"]
        entries += [e for e in (kv if isinstance(kv, list) else [kv]) if e.get("quantizer_name") != "*"]
    entries += [{"quantizer_name": pat, "enable": False} for pat in spec.get("disable", [])]
    cfg["quant_cfg"] = entries
    return cfg


def modelopt_dequant(algo: str, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """ModelOpt's own decompression of an exported FP8 weight (``FP8QTensor.dequantize``) in float32."""
    qt = FP8QTensor(w.shape, torch.float32, w)
    if algo == "FP8":
        out = qt.dequantize(dtype=torch.float32, scale=s)
        ref = from_quantized_weight(w, s, "fp8", torch.float32)
        assert torch.equal(out, ref)
        return out
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return qt.dequantize(dtype=torch.float32, scale=s.reshape(-1, 1))
    if algo == "FP8_PB_WO":
        grid = s.reshape(s.shape[0], s.shape[2]) if s.dim() == 4 else s
        return qt.dequantize(dtype=torch.float32, scale=grid, block_sizes={-1: 128, -2: 128})
    raise ValueError(algo)


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
    # the rotary tables are buffers: kept in float32 (as from_pretrained makes them) for the float32 forward below
    rotary = {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    model = model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    tok = make_tokenizer()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    calib = [tok(t, return_tensors="pt").input_ids for t in CALIBRATION]

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for x in calib:
                m(x)

    qcfg = quant_cfg(spec)
    model = mtq.quantize(model, qcfg, forward_loop)

    # the exported checkpoint, from a copy (export writes the quantized weights into the modules it exports)
    export_hf_checkpoint(copy.deepcopy(model), export_dir=out)
    tok.save_pretrained(out)

    # ModelOpt's own forward of the fake-quantized model, in float32
    peer = model.float()
    for n, b in rotary.items():
        peer.get_buffer(n).copy_(b)
    with torch.no_grad():
        logits = peer(ids).logits[0]
        res = peer.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
        )
    gen = res.sequences[0, ids.shape[1] :]
    margins = [float(sc[0].float().topk(2).values[0] - sc[0].float().topk(2).values[1]) for sc in res.scores]

    hf = json.loads((out / "hf_quant_config.json").read_text())
    algo = str(hf["quantization"]["quant_algo"]).upper()
    cj = json.loads((out / "config.json").read_text())
    sd = load_file(out / "model.safetensors")
    weights: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    same_as_fake = {}
    fake_diff = {}
    exported: dict[str, torch.Tensor] = {}
    for key in sorted(sd):
        t = sd[key]
        entry: dict[str, Any] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        if t.numel() <= 8 and t.dtype == torch.float32:
            entry["values"] = t.reshape(-1).tolist()
        tensors[key] = entry
        if key.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            prefix = key.removesuffix(".weight")
            dq = modelopt_dequant(algo, t, sd[f"{prefix}.weight_scale"])
            weights[key] = {
                "dtype": "float32",
                "shape": list(dq.shape),
                "sha256": sha(dq),
                "sha256_raw_fp8": raw_sha(t),
                "first4": dq.reshape(-1)[:4].tolist(),
            }
            mod = peer.get_submodule(prefix)
            with torch.no_grad():
                fake = mod.weight_quantizer(mod.weight.float())
            same_as_fake[key] = bool(torch.equal(fake, dq))
            fake_diff[key] = float((fake - dq).abs().max() / dq.abs().max())
            exported[prefix] = dq

    # ModelOpt's forward again with the exported weights: each FP8 linear's weight replaced by its dequantized
    # checkpoint weight and its weight quantizer disabled (inputs and KV cache still quantized by ModelOpt)
    for prefix, dq in exported.items():
        mod = peer.get_submodule(prefix)
        mod.weight.data = dq.clone()
        mod.weight_quantizer.disable()
    with torch.no_grad():
        ck_logits = peer(ids).logits[0]
        ck_res = peer.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
        )
    ck_gen = ck_res.sequences[0, ids.shape[1] :]
    ck_margins = [float(sc[0].float().topk(2).values[0] - sc[0].float().topk(2).values[1]) for sc in ck_res.scores]

    record: dict[str, Any] = {
        "name": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "modelopt": modelopt.__version__,
        "quant_cfg": spec["quant_cfg"],
        "quant_cfg_entries_added": {"kv": bool(spec.get("kv")), "disable": spec.get("disable", [])},
        "quant_algo": algo,
        "hf_quant_config": hf,
        "config": cj,
        "tensors": tensors,
        "prompt": PROMPT,
        "calibration": list(CALIBRATION),
        "prompt_ids": ids[0].tolist(),
        "dequantized_weights": weights,
        "dequantized_equals_fake_quant_weight": same_as_fake,
        # the fake quantizer computes x * (448 / amax) and back by 1 / (448 / amax); the export divides by amax / 448
        "fake_quant_weight_max_rel_diff": fake_diff,
        "peer_forward": "modelopt fake-quantized model (mtq.quantize), model.float(), inputs/KV quantized as it does",
        "logits_float32": f32_list(logits),
        "logits_float32_sha256": sha(logits),
        "greedy_float32": gen.tolist(),
        "greedy_float32_top2_margins": margins,
        "peer_forward_exported_weights": (
            "the same ModelOpt model with each FP8 linear's weight set to its exported dequantized weight and its "
            "weight quantizer disabled (input and KV quantizers as calibrated), float32"
        ),
        "logits_float32_exported_weights": f32_list(ck_logits),
        "greedy_float32_exported_weights": ck_gen.tolist(),
        "greedy_float32_exported_weights_top2_margins": ck_margins,
    }
    print(
        f"{name}: {algo}, {len(weights)} FP8 linears, dequant == fake-quant weight for "
        f"{sum(same_as_fake.values())}/{len(same_as_fake)} (max rel diff {max(fake_diff.values()):.2e}), "
        f"greedy {gen.tolist()}, with the exported weights {ck_gen.tolist()}"
    )
    return record


def main() -> None:
    torch.set_num_threads(2)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    names = sys.argv[1:] or list(FIXTURE_SPECS)
    for name in names:
        rec = build(name, FIXTURE_SPECS[name])
        (FIXTURES / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
