"""Write the ModelOpt fixtures (``fixtures/<name>/`` + ``fixtures/<name>.json``) with NVIDIA ModelOpt itself: FP8,
NVFP4 and MIXED_PRECISION (NVFP4 + FP8).

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

NVFP4 (``NVFP4_DEFAULT_CFG``; the mixed fixture adds FP8 quantizers on the MLP linears, and the export writes
``MIXED_PRECISION`` with ``quantized_layers``): ModelOpt quantizes (max calibration) and exports on a CPU, but its
NVFP4 fake quantizer runs on CUDA only ("amax must be a CUDA tensor for dynamic block quantization"), so steps 3 and
the weight comparison of 5 are skipped, the exported-weights forward of 6 runs with 16-bit inputs at the NVFP4
linears, and one more forward is recorded (``logits_float32_vllm_emulation``): the exported weights (ModelOpt's
``NVFP4QTensor.dequantize``) with every quantized linear's input quantized as vLLM does where the GPU has no FP4
(NVFP4: its emulation, :func:`nvfp4_inputs_as_vllm_emulates`; FP8: ``QuantFP8``, :func:`fp8_inputs_as_vllm`).

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
from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor
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
    # NVFP4 (W4A4): uint8 weights (two E2M1 codes a byte), F8_E4M3 weight_scale per 16, F32 weight_scale_2 and
    # input_scale; layer 1's down_proj left unquantized (exclude_modules names it)
    "llama_modelopt_nvfp4": {
        "seed": 14,
        "config": {"hidden_size": 256, "intermediate_size": 384},
        "quant_cfg": "NVFP4_DEFAULT_CFG",
        "disable": ["*layers.1.mlp.down_proj*"],
    },
    "qwen3_modelopt_nvfp4": {
        "seed": 15,
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
        "quant_cfg": "NVFP4_DEFAULT_CFG",
    },
    # MIXED_PRECISION: NVFP4_DEFAULT_CFG with every MLP linear's weight and input quantizers set to FP8's (per tensor,
    # static input scale), as FP8_DEFAULT_CFG sets them; the export finds two formats and writes quantized_layers
    "llama_modelopt_mixed": {
        "seed": 16,
        "config": {"hidden_size": 256, "intermediate_size": 384},
        "quant_cfg": "NVFP4_DEFAULT_CFG",
        "fp8": ["*mlp*weight_quantizer", "*mlp*input_quantizer"],
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
    entries += [{"quantizer_name": pat, "cfg": {"num_bits": (4, 3), "axis": None}} for pat in spec.get("fp8", [])]
    cfg["quant_cfg"] = entries
    return cfg


def modelopt_dequant(algo: str, w: torch.Tensor, s: torch.Tensor, s2: torch.Tensor | None = None) -> torch.Tensor:
    """ModelOpt's own decompression of an exported weight (``FP8QTensor.dequantize``, ``NVFP4QTensor.dequantize``) in
    float32."""
    if algo == "NVFP4":
        qt = NVFP4QTensor(torch.Size((w.shape[0], 2 * w.shape[1])), torch.float32, w)
        return qt.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16})
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


def nvfp4_inputs_as_vllm_emulates(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """A linear's input through NVFP4 as vLLM's emulation (``nvfp4_emulation_utils``: ``ref_nvfp4_quant`` then its
    dequantization, ModelOpt's ``input_global_scale_inv = 1 / input_scale`` as the global scale ``g``) computes it:
    per 16 inputs ``s = e4m3(clamp(g * (max|x| * (1 / 6)), +-448))``, ``q = E2M1(clamp(x * (1 / (s * (1 / g))),
    +-6))`` (ties: 0.25, 1.25, 2.5, 5 down, 0.75, 1.75, 3.5 up), back as ``q * (s / g)`` in ``x``'s dtype. Written
    out here from vLLM's description (vLLM is not installed here)."""

    def recip(t: torch.Tensor) -> torch.Tensor:
        return 1.0 / (t + (t == 0) * 1e8)

    g = (1.0 / input_scale.reshape(())).to(torch.float32)
    shape = x.shape
    xb = x.reshape(-1, shape[-1] // 16, 16)
    vmax = xb.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    s = torch.clamp(g * (vmax * (1 / 6.0)), min=-448, max=448).to(torch.float8_e4m3fn).to(torch.float32)
    scaled = torch.clamp(xb.to(torch.float32) * recip(s * recip(g)), -6.0, 6.0)
    a = scaled.abs()
    q = torch.full_like(a, 6.0)
    for value, lo_ok in ((4.0, a <= 5.0), (3.0, a < 3.5), (2.0, a <= 2.5), (1.5, a < 1.75), (1.0, a <= 1.25)):
        q = torch.where(lo_ok, torch.full_like(a, value), q)
    q = torch.where(a < 0.75, torch.full_like(a, 0.5), q)
    q = torch.where(a <= 0.25, torch.zeros_like(a), q)
    q = q * torch.sign(scaled)
    return (q * (s / g)).reshape(shape).to(x.dtype)


def fp8_inputs_as_vllm(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """An FP8 linear's input (MIXED_PRECISION's FP8 layers) as vLLM's ``QuantFP8`` quantizes it with the static
    ``input_scale`` ``s``: ``e4m3(clamp(float32(x) * (1 / s), +-448)) * s``."""
    s = input_scale.reshape(()).to(torch.float32)
    q = (x.to(torch.float32) * s.reciprocal()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * s).to(x.dtype)


def vllm_emulation_forward(
    peer: torch.nn.Module,
    sd: dict[str, torch.Tensor],
    prefixes: list[str],
    run: Any,
    exported_logits: torch.Tensor,
) -> dict[str, Any]:
    """ModelOpt's model with the exported weights (ModelOpt's own dequantization, weight quantizers off) and each NVFP4
    linear's input quantized as vLLM's emulation does (:func:`nvfp4_inputs_as_vllm_emulates` with the exported
    ``input_scale``, ModelOpt's input quantizer off): the checkpoint as vLLM runs it where the GPU has no FP4."""
    hooks = []
    for prefix in prefixes:
        mod = peer.get_submodule(prefix)
        mod.input_quantizer.disable()
        scale = sd[f"{prefix}.input_scale"].float()
        how = nvfp4_inputs_as_vllm_emulates if sd[f"{prefix}.weight"].dtype == torch.uint8 else fp8_inputs_as_vllm
        hooks.append(mod.register_forward_pre_hook(lambda m, args, s=scale, f=how: (f(args[0], s),)))
    em_logits, gen, margins = run(peer)
    for h in hooks:
        h.remove()
    top = float(em_logits.abs().max())
    return {
        "peer_forward_vllm_emulation": (
            "ModelOpt's model with each NVFP4 linear's weight set to NVFP4QTensor.dequantize of the exported tensors "
            "(weight quantizer disabled) and its input quantized as vLLM's NVFP4 emulation does (input_quantizer "
            "disabled; nvfp4_inputs_as_vllm_emulates with the exported input_scale), float32"
        ),
        "logits_float32_vllm_emulation": f32_list(em_logits),
        "greedy_float32_vllm_emulation": gen.tolist(),
        "greedy_float32_vllm_emulation_top2_margins": margins,
        "vllm_emulation_vs_16bit_inputs_max_rel": float((em_logits - exported_logits).abs().max()) / top,
    }


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

    def run(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        with torch.no_grad():
            lg = m(ids).logits[0]
            res = m.generate(
                ids,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id,
            )
        margins = [float(sc[0].float().topk(2).values[0] - sc[0].float().topk(2).values[1]) for sc in res.scores]
        return lg, res.sequences[0, ids.shape[1] :], margins

    # ModelOpt's own forward of the fake-quantized model, in float32 (not for NVFP4 on a CPU: its NVFP4 fake
    # quantizer asserts "amax must be a CUDA tensor for dynamic block quantization")
    nvfp4 = str(spec["quant_cfg"]).startswith("NVFP4")  # NVFP4 and the mixed NVFP4 + FP8
    peer = model.float()
    for n, b in rotary.items():
        peer.get_buffer(n).copy_(b)
    logits: torch.Tensor | None = None
    gen: list[int] | None = None
    margins: list[float] | None = None
    if not nvfp4:
        logits, g, margins = run(peer)
        gen = g.tolist()

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
        if key.endswith(".weight") and t.dtype in (torch.float8_e4m3fn, torch.uint8):
            prefix = key.removesuffix(".weight")
            layer_algo = "NVFP4" if t.dtype == torch.uint8 else ("FP8" if algo == "MIXED_PRECISION" else algo)
            dq = modelopt_dequant(layer_algo, t, sd[f"{prefix}.weight_scale"], sd.get(f"{prefix}.weight_scale_2"))
            weights[key] = {
                "dtype": "float32",
                "shape": list(dq.shape),
                "sha256": sha(dq),
                "sha256_raw_fp8" if t.dtype == torch.float8_e4m3fn else "sha256_raw_packed": raw_sha(t),
                "first4": dq.reshape(-1)[:4].tolist(),
            }
            if not nvfp4:
                mod = peer.get_submodule(prefix)
                with torch.no_grad():
                    fake = mod.weight_quantizer(mod.weight.float())
                same_as_fake[key] = bool(torch.equal(fake, dq))
                fake_diff[key] = float((fake - dq).abs().max() / dq.abs().max())
            exported[prefix] = dq

    # ModelOpt's forward again with the exported weights: each quantized linear's weight replaced by its dequantized
    # checkpoint weight and its weight quantizer disabled (inputs and KV cache still quantized by ModelOpt; NVFP4:
    # inputs left 16-bit here, its input quantizer needs CUDA, and quantized below as vLLM's emulation does)
    for prefix, dq in exported.items():
        mod = peer.get_submodule(prefix)
        mod.weight.data = dq.clone()
        mod.weight_quantizer.disable()
        if nvfp4 and sd[f"{prefix}.weight"].dtype == torch.uint8:
            mod.input_quantizer.disable()
    ck_logits, ck_g, ck_margins = run(peer)
    ck_gen = ck_g.tolist()
    emulated: dict[str, Any] = {}
    if nvfp4:  # every quantized linear's input as vLLM quantizes it (NVFP4: its emulation; FP8: QuantFP8)
        emulated = vllm_emulation_forward(peer, sd, list(exported), run, ck_logits)

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
        "peer_forward": (
            "modelopt fake-quantized model (mtq.quantize), model.float(), inputs/KV quantized as it does"
            if not nvfp4
            else "none: ModelOpt 0.47's NVFP4 fake quantizer runs on CUDA only (it asserts a CUDA amax)"
        ),
        "logits_float32": None if logits is None else f32_list(logits),
        "logits_float32_sha256": None if logits is None else sha(logits),
        "greedy_float32": gen,
        "greedy_float32_top2_margins": margins,
        "peer_forward_exported_weights": (
            "the same ModelOpt model with each FP8 linear's weight set to its exported dequantized weight and its "
            "weight quantizer disabled (input and KV quantizers as calibrated), float32"
            if not nvfp4
            else "the same ModelOpt model with each NVFP4 linear's weight set to its exported dequantized weight "
            "(NVFP4QTensor.dequantize), its weight and input quantizers disabled: 16-bit inputs, float32"
        ),
        "logits_float32_exported_weights": f32_list(ck_logits),
        "greedy_float32_exported_weights": ck_gen,
        "greedy_float32_exported_weights_top2_margins": ck_margins,
        **emulated,
    }
    print(
        f"{name}: {algo}, {len(weights)} quantized linears, dequant == fake-quant weight for "
        f"{sum(same_as_fake.values())}/{len(same_as_fake)} (max rel diff {max(fake_diff.values(), default=0):.2e}), "
        f"greedy {gen}, with the exported weights {ck_gen}, {emulated.get('greedy_float32_vllm_emulation')} "
        f"emulated ({emulated.get('vllm_emulation_vs_16bit_inputs_max_rel')} from 16-bit inputs)"
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
