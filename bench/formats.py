"""CPU speed of the new format plugins against each peer library's own CPU path, on the same checkpoints.

Model: SmolLM2-135M-Instruct (the packaged Q4_1 GGUF, exported once by ``anyquant.export_dense`` to a dense
bfloat16 HF folder, as ``bench/_measure.py``'s ``dense_model()`` does), quantized once by each format's real peer
tool and cached under ``--cache`` (default ``.cache/bench/formats/``):

- ``ct-w4a16``: compressed-tensors int4 symmetric, group 64 (576 is not a multiple of 128), weights only;
- ``ct-w8a8``: compressed-tensors ``W8A8`` (int8 per-channel weights, dynamic per-token int8 activations);
- ``ct-nvfp4a16``, ``ct-nvfp4``: compressed-tensors ``NVFP4A16`` (FP4 weights, an E4M3 scale per 16 and a global
  scale) and ``NVFP4`` (the same with FP4 activations, their global scales calibrated on 16 random 64-token samples);
- ``ct-fp8``: compressed-tensors ``FP8_DYNAMIC`` (fp8 per-channel weights, dynamic per-token fp8 activations);
  all three by llm-compressor's ``oneshot`` (round to nearest, no calibration data) in its own Python
  (``--llmcompressor-python``, default ``$ANYQUANT_LLMCOMPRESSOR_PYTHON``, else ``make install``'s
  ``.venv-llmcompressor``), saved ``save_compressed=True``;
- ``bnb-nf4``: bitsandbytes NF4 with double quantization (bf16 compute), ``bnb-int8``: LLM.int8(), both by
  ``from_pretrained(dense, quantization_config=BitsAndBytesConfig(...), device_map="cpu")`` + ``save_pretrained``
  in this Python;
- ``fp8-b64``: ``quant_method: fp8`` (float8_e4m3fn weights + ``weight_scale_inv``) with 64x64 blocks, by
  transformers' own ``Fp8Quantize``: SmolLM2's 576 is 4.5 blocks of 128 and transformers' quantizer leaves
  such a tensor unquantized, so the 64x64 grid is the one ``quant_method: fp8`` checkpoint of this model both
  engines load;
- ``fp8-b128``: the usual 128x128 blocks with padded edge blocks (scale grid ceil(576 / 128) = 5), DeepSeek-V3's
  ``weight_quant`` arithmetic (as ``plugins/fp8/tests/make_fp8_fixtures.py`` writes its partial fixture):
  transformers refuses to load it, so its peer column shows that error;
- ``mlx-q4``: MLX affine 4-bit, group 64, by ``python -m mlx_lm convert -q`` in mlx's own Python
  (``--mlx-python``, default ``/root/peers/mlx/bin/python``);
- ``mxfp4-gptoss``: a gpt-oss model with random weights (hidden 768, 8 layers, 32 experts of 768, 4 a token;
  ``--model 1b``: hidden 1024, 12 layers: 1.2B expert weights), its experts written as random E2M1 codes and E8M0
  exponents in gpt-oss-20b's layout (transformers quantizes to MXFP4 only through a GPU kernel package); the peer
  reads it with ``Mxfp4Config(dequantize=True)``, what transformers does without that GPU kernel.

``--model 1b``: the same formats made from a synthetic ~1.1B Llama (TinyLlama-1.1B's shape, SmolLM2's vocabulary,
random bf16 weights), where the peak RSS / weight bytes row means something (the process itself, torch and
transformers imported, is ~0.4 GB: more than SmolLM2's 4-bit weights).

Engines, each sample a fresh process, the two engines alternating, ``--samples`` of each (medians):

- anyquant: ``anyquant.load(path)`` with its default backend (printed), tokens from its generator
  (``model.generator.token_steps``, what ``model.generate`` / ``complete`` run, fed token ids so that both
  engines see the same prompt);
- the peer: transformers ``AutoModelForCausalLM.from_pretrained(path, device_map="cpu")`` with the checkpoint's
  own quantizer as it runs on a CPU by default (compressed-tensors: its compressed forward where it runs on a
  CPU, ``--ct-peer auto``; otherwise decompressed at load, ``CompressedTensorsConfig(run_compressed=False)``;
  the table says which ran; bitsandbytes: its CPU backend; fp8: transformers dequantizes to bf16 on a machine
  without a GPU), ``model.generate(do_sample=False)`` with a streamer timing each token; MLX: ``mlx_lm.load`` +
  ``mlx_lm.stream_generate`` (greedy) in the mlx Python.

Rows: decode tokens/s (greedy, ``--decode`` new tokens after a 32-token prompt, timed from the first new token
on, end of sequence ignored), prefill tokens/s (time to the first new token of a ``--prefill``-token prompt of
held-out wiki text, after a 16-token warm-up), load seconds (``import torch`` / ``import mlx`` excluded, the
library's own import included), peak RSS (``VmHWM``) and peak RSS / the checkpoint's weight bytes (the sum of its
safetensors files), the RSS of each engine's runtime (a process of its own that imports torch, transformers, the
engine's libraries and, where the engine builds transformers' class, the architecture's modeling code, reading no
weight) and the peak RSS above it / the weight bytes (the model's own memory). Every engine runs at ``--threads`` (``torch.set_num_threads``; MLX's CPU: the BLAS / OpenMP
thread variables). Each sample records the share of the machine's CPU time other processes used while it ran
(``/proc/stat`` minus the sample's own process), as ``bench/llamacpp.py`` does; samples above ``--max-other``
are left out of the medians unless every sample is (then the least-loaded one, flagged ``*``).

MLX's own CPU path is slow (about 1 token/s for prefill and decode alike on a 2-core AVX512 host, one thread):
its sample takes ~9 minutes, so a run of every format takes ~14 minutes a sample.

    python bench/formats.py [--samples 3] [--formats ct-w4a16,ct-w8a8,ct-fp8,ct-nvfp4a16,ct-nvfp4,bnb-nf4,bnb-int8,...]
        [--cache DIR] [--llmcompressor-python PATH] [--mlx-python PATH] [--threads 2] [--decode 64]
        [--prefill 512] [--max-other 0.05] [--ct-peer auto|compressed|decompressed] [--model smollm2|1b] [--make-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _measure import (
    CACHE,
    ENV,
    REPO,
    _unshadow,
    bandwidth,
    checkpoint_bytes,
    compile_sources,
    cpu_times,
    other_share,
    peak_rss_mib,
)

PROMPT = 32
WARM = 16

#: format -> (label, how it is made)
FORMATS: dict[str, tuple[str, str]] = {
    "ct-w4a16": ("compressed-tensors W4A16 g64 (pack-quantized)", "llm-compressor oneshot"),
    "ct-w8a8": ("compressed-tensors W8A8 int8 (dynamic per-token acts)", "llm-compressor oneshot"),
    "ct-fp8": ("compressed-tensors FP8_DYNAMIC (float-quantized)", "llm-compressor oneshot"),
    "ct-nvfp4a16": ("compressed-tensors NVFP4A16 (nvfp4-pack-quantized, weights only)", "llm-compressor oneshot"),
    "ct-nvfp4": (
        "compressed-tensors NVFP4 (W4A4: FP4 activations, calibrated)",
        "llm-compressor oneshot + calibration",
    ),
    "bnb-nf4": ("bitsandbytes NF4, double quant", "transformers + bitsandbytes"),
    "bnb-int8": ("bitsandbytes LLM.int8()", "transformers + bitsandbytes"),
    "fp8-b64": ("quant_method fp8, 64x64 blocks", "transformers Fp8Quantize"),
    "fp8-b128": ("quant_method fp8, 128x128 padded edge blocks", "DeepSeek-V3 weight_quant arithmetic"),
    "mlx-q4": ("MLX affine 4-bit g64", "mlx_lm convert"),
    "mxfp4-gptoss": ("gpt-oss MXFP4 experts (random weights)", "written in gpt-oss-20b's layout"),
}

# ---------------------------------------------------------------------- making the checkpoints

_CT_MAKER = r"""
import json, sys, torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

src, dst, kind = sys.argv[1:4]
torch.set_num_threads(2)
if kind == "ct-w4a16":
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
    mod = QuantizationModifier(
        config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, targets="Linear", ignore=["lm_head"]
    )
else:
    scheme = {"ct-w8a8": "W8A8", "ct-fp8": "FP8_DYNAMIC", "ct-nvfp4a16": "NVFP4A16", "ct-nvfp4": "NVFP4"}[kind]
    mod = QuantizationModifier(scheme=scheme, targets="Linear", ignore=["lm_head"])
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
tok = AutoTokenizer.from_pretrained(src)
torch.manual_seed(0)
extra = {}
if kind == "ct-nvfp4":  # its activations' global scales are calibrated: 16 samples of 64 random tokens
    from datasets import Dataset
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, model.config.vocab_size, (64,), generator=g).tolist() for _ in range(16)]
    extra = {"dataset": Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 64 for _ in ids]}),
             "num_calibration_samples": 16, "max_seq_length": 64}
model = oneshot(model=model, recipe=mod, tokenizer=tok, **extra)
model.save_pretrained(dst, save_compressed=True)
tok.save_pretrained(dst)
"""

_BNB_MAKER = r"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

src, dst, kind = sys.argv[1:4]
torch.set_num_threads(2)
if kind == "bnb-nf4":
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
else:
    cfg = BitsAndBytesConfig(load_in_8bit=True)
model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg, device_map="cpu")
model.save_pretrained(dst)
AutoTokenizer.from_pretrained(src).save_pretrained(dst)
"""

_FP8_MAKER = r"""
import json, math, shutil, sys, torch
from safetensors.torch import load_file, save_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize

src, dst, kind = sys.argv[1:4]
block = [64, 64] if kind == "fp8-b64" else [128, 128]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Quantizer:
    def __init__(self):
        self.quantization_config = FineGrainedFP8Config(weight_block_size=block)


def padded(w):
    # DeepSeek-V3 weight_quant with padded edge blocks (plugins/fp8/tests/make_fp8_fixtures.py quantize_partial)
    fp8 = torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max
    rows, cols = w.shape
    sr, sc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    w32 = w.float()
    q = torch.empty(rows, cols, dtype=fp8)
    inv = torch.empty(sr, sc, dtype=torch.float32)
    for i in range(sr):
        for j in range(sc):
            rs, cs = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            blk = w32[rs, cs]
            amax = blk.abs().amax()
            scale = fmax / amax if amax > 0 else torch.tensor(1.0)
            inv[i, j] = (1.0 / scale).to(torch.float32)
            q[rs, cs] = (blk * scale).clamp(-fmax, fmax).to(fp8)
    return q, inv


quantizer = Fp8Quantize(_Quantizer())
out = {}
for key, value in load_file(f"{src}/model.safetensors").items():
    parts = key.rsplit(".", 2)
    if key.endswith(".weight") and parts[-2] in LINEARS:
        sk = key.rsplit(".", 1)[0] + ".weight_scale_inv"
        rows, cols = value.shape
        if rows % block[0] or cols % block[1]:
            q, inv = padded(value)
        else:
            res = quantizer._quantize_one(key, value)
            q, inv = res[key], res[sk]
        assert q.dtype == torch.float8_e4m3fn, key
        out[key], out[sk] = q.contiguous(), inv.contiguous()
    else:
        out[key] = value
import pathlib
d = pathlib.Path(dst)
d.mkdir(parents=True, exist_ok=True)
save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
cfg = json.loads(pathlib.Path(src, "config.json").read_text())
cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
(d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
for f in pathlib.Path(src).iterdir():
    if f.name.startswith(("tokenizer", "generation_config", "chat_template", "special_tokens")):
        shutil.copy(f, d / f.name)
"""


#: ``--model``: the packaged SmolLM2-135M, or a synthetic ~1.1B Llama (TinyLlama-1.1B's shape, SmolLM2's vocabulary,
#: random weights: bench/llamacpp.py's shape) where the process's own ~0.4 GB no longer dwarfs the weights
MODELS = ("smollm2", "1b")
SHAPE_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
}


def dense(cache: Path, model: str = "smollm2") -> Path:
    """The dense bf16 HF folder every format is made from: SmolLM2-135M-Instruct exported once from the packaged
    GGUF (the code path of ``_measure.dense_model()``, into this bench's cache), or the synthetic 1.1B Llama."""
    small = cache / "smollm2-135m-dense"
    if not (small / "config.json").is_file():
        _unshadow()
        import anyquant

        cache.mkdir(parents=True, exist_ok=True)
        anyquant.export_dense(anyquant.default_model(), small, dtype="bfloat16", overwrite=True)
    if model == "smollm2":
        return small
    out = cache / "llama-1b-dense"
    if not (out / "config.json").is_file():
        _unshadow()
        import shutil

        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = json.loads((small / "config.json").read_text())
        config = LlamaConfig(
            **{
                **{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype", "dtype")},
                **SHAPE_1B,
                "tie_word_embeddings": False,
            }
        )
        torch.manual_seed(0)
        model_1b = LlamaForCausalLM(config).to(torch.bfloat16)
        tmp = out.with_name(out.name + ".tmp")
        model_1b.save_pretrained(tmp)
        for f in small.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.name in (
                "vocab.json",
                "merges.txt",
            ):
                shutil.copy(f, tmp / f.name)
        tmp.rename(out)
    return out


def make(fmt: str, cache: Path, ct_python: str, mlx_python: str, model: str = "smollm2") -> tuple[Path | None, str]:
    """(the checkpoint folder, or None; seconds it took or the error)."""
    out = cache / (f"smollm2-135m-{fmt}" if model == "smollm2" else f"llama-{model}-{fmt}")
    if (out / "config.json").is_file():
        made = out / "bench_make_seconds.txt"
        return out, (made.read_text().strip() + " s (cached)") if made.is_file() else "cached"
    src = dense(cache, model)
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run(["rm", "-rf", str(tmp)], check=True)
    env = {**os.environ, **ENV, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    if fmt.startswith("ct-"):
        cmd = [ct_python, "-c", _CT_MAKER, str(src), str(tmp), fmt]
    elif fmt.startswith("bnb-"):
        cmd = [sys.executable, "-c", _BNB_MAKER, str(src), str(tmp), fmt]
    elif fmt.startswith("fp8-"):
        cmd = [sys.executable, "-c", _FP8_MAKER, str(src), str(tmp), fmt]
    elif fmt == "mxfp4-gptoss":
        cmd = [sys.executable, "-c", _MXFP4_MAKER, str(src), str(tmp), fmt]
    elif fmt == "mlx-q4":
        cmd = [mlx_python, "-m", "mlx_lm", "convert", "--hf-path", str(src), "--mlx-path", str(tmp), "-q"]
        cmd += ["--q-bits", "4", "--q-group-size", "64"]
    else:
        raise SystemExit(f"unknown format {fmt}")
    if not Path(cmd[0]).is_file():
        return None, f"no Python at {cmd[0]}"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(cache))
    seconds = time.perf_counter() - t0
    if proc.returncode or not (tmp / "config.json").is_file():
        return None, " ".join((proc.stderr or proc.stdout).split())[-400:] or f"exit status {proc.returncode}"
    (tmp / "bench_make_seconds.txt").write_text(f"{seconds:.0f}\n")
    tmp.rename(out)
    return out, f"{seconds:.0f} s"


def prompt_ids(cache: Path, src: Path, need: int) -> Path:
    """Held-out wiki text (the part anyquant's calibration never samples) as SmolLM2 token ids, cached as JSON:
    every engine is fed the same ids."""
    out = cache / "prompt.json"
    if not out.is_file() or len(json.loads(out.read_text())) < need:
        _unshadow()
        from _measure import corpus_text
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(src)(corpus_text("wiki", "evaluation")[:40000])["input_ids"]
        while len(ids) < need:
            ids = ids + ids
        out.write_text(json.dumps(ids))
    return out


_MXFP4_MAKER = r"""
import json, shutil, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM

src, dst, kind = sys.argv[1:4]
H, I, E, L, K = (768, 768, 32, 8, 4) if "smollm2" in Path(src).name else (1024, 1024, 32, 12, 4)
cfg = json.loads((Path(src) / "config.json").read_text())
config = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
    "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": H // 64,
    "num_key_value_heads": 4, "num_local_experts": E, "num_experts_per_tok": K, "experts_per_token": K,
    "layer_types": ["sliding_attention", "full_attention"] * (L // 2), "sliding_window": 128,
    "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-5,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": cfg["vocab_size"], "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
    "pad_token_id": cfg.get("eos_token_id"), "use_cache": True,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
with torch.device("meta"):
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in GptOssForCausalLM(GptOssConfig(**{
        k: v for k, v in config.items() if k != "quantization_config"})).state_dict().items()}
sd = {}
for name, (shape, _) in shapes.items():
    if ".mlp.experts." in name and not name.endswith("_bias"):
        rows, cols = shape[2], shape[1]  # the parameter is [E, in, out]; stored [E, out, in/32, 16]
        codes = torch.randint(0, 16, (E, rows, cols), generator=gen, dtype=torch.uint8)
        sd[name + "_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(E, rows, cols // 32, 16)
        sd[name + "_scales"] = torch.randint(119, 124, (E, rows, cols // 32), generator=gen, dtype=torch.uint8)
    elif "norm" in name:
        sd[name] = torch.ones(shape, dtype=torch.bfloat16)
    elif name.endswith("sinks") or name.endswith("bias"):
        sd[name] = (0.05 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    else:
        sd[name] = (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
out = Path(dst)
out.mkdir(parents=True)
save_file({k: v.contiguous() for k, v in sd.items()}, out / "model.safetensors", metadata={"format": "pt"})
(out / "config.json").write_text(json.dumps(config, indent=1))
for f in Path(src).iterdir():
    if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("vocab.json", "merges.txt"):
        shutil.copy(f, out / f.name)
"""

# ---------------------------------------------------------------------- one sample, in a fresh process


def _peer_torch(cfg: dict[str, Any]) -> tuple[Any, str]:
    """transformers ``from_pretrained`` with the checkpoint's quantizer as it runs on a CPU (returns the model
    and what ran)."""
    import torch
    from transformers import AutoModelForCausalLM

    path, fmt = cfg["path"], cfg["format"]
    kw: dict[str, Any] = {}
    how = "from_pretrained(device_map='cpu')"
    if fmt.startswith("ct-"):
        import compressed_tensors  # noqa: F401  (its import is the peer's, timed)
        from transformers import CompressedTensorsConfig

        if cfg.get("ct_peer") == "decompressed":
            kw["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
            how += ", CompressedTensorsConfig(run_compressed=False)"
        else:
            how += ", compressed-tensors default (compressed modules)"
    elif fmt.startswith("bnb-"):
        import bitsandbytes  # noqa: F401
    elif fmt.startswith("mxfp4-"):  # the Hub kernels transformers quantizes with are GPU-only: it dequantizes
        from transformers import Mxfp4Config

        kw["quantization_config"] = Mxfp4Config(dequantize=True)
        how += ", Mxfp4Config(dequantize=True)"
    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", **kw).eval()
    how += f"; q_proj after the load: {_q_proj(model)}"
    if fmt.startswith("bnb-nf4"):
        from bitsandbytes.functional import has_avx512bf16

        how += ", AVX512-BF16 gemv kernel" if has_avx512bf16() else ", dequantize_4bit + F.linear"
    torch.set_num_threads(int(cfg["threads"]))
    return model, how


def _q_proj(model: Any) -> str:
    """The first layer's q_proj: its class and the dtype it holds its weight in."""
    layer = model.model.layers[0].self_attn.q_proj
    weight = getattr(layer, "weight", None)
    if weight is None:
        weight = getattr(layer, "weight_packed", None)
    return f"{type(layer).__name__} {str(getattr(weight, 'dtype', '?')).removeprefix('torch.')}"


def runtime_child(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RSS of "the runtime" for ``cfg``'s engine, before any weight is read: torch, transformers and the engine's
    libraries imported, and the architecture's transformers modeling code where that engine builds its class (the
    peer always; anyquant where its native decoder does not run the architecture, gpt-oss's), mlx and mlx-lm."""
    _unshadow()
    if cfg["engine"] == "mlx":
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    else:
        import importlib

        import torch  # noqa: F401
        import transformers  # noqa: F401

        config = json.loads((Path(cfg["path"]) / "config.json").read_text())
        modeling = cfg["engine"] == "transformers"
        if cfg["engine"] == "anyquant":
            import anyquant
            from anyquant_runtime.build import choose_runtime

            anyquant.detect(cfg["path"])  # imports the plugin that owns it
            modeling = choose_runtime(config, "auto") == "transformers"
        elif cfg["format"].startswith("ct-"):
            import compressed_tensors  # noqa: F401
        elif cfg["format"].startswith("bnb-"):
            import bitsandbytes  # noqa: F401
        if modeling:
            kind = config.get("model_type", "")
            importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return {"runtime_rss_mib": int(line.split()[1]) / 1024}
    return {"error": "no VmRSS in /proc/self/status"}


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    ids: list[int] = json.loads(Path(cfg["ids"]).read_text())
    threads = int(cfg["threads"])
    info = ""
    _unshadow()
    if cfg["engine"] == "mlx":
        import mlx.core as mx  # (not timed, as torch's import is not)

        before = cpu_times()
        t0 = time.perf_counter()
        import mlx_lm
        from mlx_lm.generate import generate_step

        model, _tok = mlx_lm.load(cfg["path"])
        load_s = time.perf_counter() - t0
        info = f"mlx_lm {getattr(mlx_lm, '__version__', '?')}, mlx {mx.__version__}, device {mx.default_device()}"

        def steps(prompt: list[int], n: int) -> Any:
            for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
                yield int(token)

    else:
        import torch
        import transformers  # noqa: F401  (imported before the clock, as in bench/_measure.py)

        torch.set_num_threads(threads)
        before = cpu_times()
        t0 = time.perf_counter()
        if cfg["engine"] == "anyquant":
            import anyquant

            m = anyquant.load(cfg["path"])
            info = m.backend

            def steps(prompt: list[int], n: int) -> Any:
                for (token,) in m.generator.token_steps([prompt], m.params(max_new_tokens=n), ends=()):
                    yield int(token)

        else:
            model, info = _peer_torch(cfg)

            def steps(prompt: list[int], n: int) -> Any:
                """generate() in a thread-free way: a streamer records when each token is put."""
                stamps: list[tuple[float, list[int]]] = []

                class Clock:
                    def put(self, value: Any) -> None:
                        stamps.append((time.perf_counter(), value.reshape(-1).tolist()))

                    def end(self) -> None:
                        pass

                t = torch.tensor([prompt])
                with torch.inference_mode():
                    model.generate(
                        t,
                        attention_mask=torch.ones_like(t),
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=False,
                        pad_token_id=0,
                        streamer=Clock(),
                    )
                # the first put is the prompt; replay the tokens at their stamps
                for stamp, tokens in stamps[1:]:
                    yield stamp, tokens[-1]

        load_s = time.perf_counter() - t0

    def first_and_rest(prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        """(seconds to the first new token, seconds for the n - 1 after it, tokens)."""
        t1 = time.perf_counter()
        got: list[int] = []
        stamps: list[float] = []
        for item in steps(prompt, n):
            stamp, token = item if isinstance(item, tuple) else (time.perf_counter(), item)
            got.append(int(token))
            stamps.append(stamp)
        return stamps[0] - t1, stamps[-1] - stamps[0], got

    first_and_rest(ids[:WARM], 4)  # warm-up (the compressed-tensors peer decompresses here)
    if cfg["engine"] == "transformers":
        info += f"; after the first forward: {_q_proj(model)}"
    prefill_first, _, _ = first_and_rest(ids[: cfg["prefill"]], 1)
    _, rest, tokens = first_and_rest(ids[:PROMPT], cfg["decode"] + 1)
    return {
        "load_s": load_s,
        "info": info,
        "prefill_tok_s": cfg["prefill"] / prefill_first,
        "decode_tok_s": (len(tokens) - 1) / rest,
        "peak_rss_mib": peak_rss_mib(),
        "tokens": tokens[:16],
        "other_cpu": other_share(before, cpu_times()),
    }


def measure(cfg: dict[str, Any], python: str, runtime: bool = False) -> dict[str, Any]:
    threads = str(cfg["threads"])
    env = {**os.environ, **ENV, "HF_HUB_OFFLINE": "1"}
    env |= {k: threads for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    try:
        proc = subprocess.run(
            [python, __file__, "--runtime-child" if runtime else "--child"],
            input=json.dumps(cfg),
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 1800 s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        text = proc.stderr or proc.stdout
        # the first exception line (transformers reports a failed weight conversion above its final RuntimeError)
        cause = next((ln.strip() for ln in text.splitlines() if ln.split(":", 1)[0].endswith("Error")), "")
        last = " ".join(text.split())[-200:]
        return {"error": (f"{cause} ... {last}" if cause and cause not in last else last) or f"exit {proc.returncode}"}
    return dict(json.loads(lines[-1]))


# ---------------------------------------------------------------------- the table


def median_of(samples: list[dict[str, Any]], key: str, max_other: float) -> tuple[float | None, float, bool]:
    """(median of ``key`` over the samples at or under ``max_other``, the highest other-CPU share among those used,
    whether every sample was over it: then the least loaded one alone), as in bench/llamacpp.py."""
    good = [s for s in samples if "error" not in s and key in s]
    if not good:
        return None, 0.0, False
    kept = [s for s in good if s["other_cpu"] <= max_other]
    flagged = not kept
    if flagged:
        kept = [min(good, key=lambda s: s["other_cpu"])]
    return float(statistics.median(s[key] for s in kept)), max(s["other_cpu"] for s in kept), flagged


def cell(samples: list[dict[str, Any]], key: str, fmt: str, max_other: float) -> tuple[str, float | None, float]:
    value, other, flagged = median_of(samples, key, max_other)
    if value is None:
        err = next((s["error"] for s in samples if "error" in s), "no sample")
        return f"error: {err[:240].replace('|', '/')}", None, 0.0
    return fmt.format(value) + ("*" if flagged else ""), value, other


def versions(ct_python: str, mlx_python: str) -> str:
    from importlib.metadata import version

    import torch
    import transformers

    def of(python: str, names: str) -> str:
        code = f"from importlib.metadata import version as v; print(', '.join(n + ' ' + v(n) for n in {names!r}))"
        try:
            proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
            return proc.stdout.strip() or "n/a"
        except (OSError, subprocess.TimeoutExpired):
            return "n/a"

    ours = ", ".join(f"{n} {version(n)}" for n in ("anyquant", "compressed-tensors", "bitsandbytes") if _installed(n))
    return (
        f"this Python: torch {torch.__version__}, transformers {transformers.__version__}, {ours}; "
        f"llm-compressor Python: {of(ct_python, ('llmcompressor', 'compressed-tensors', 'transformers'))}; "
        f"mlx Python: {of(mlx_python, ('mlx', 'mlx-lm'))}"
    )


def _installed(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
    except PackageNotFoundError:
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=3, help="fresh processes per engine and format")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated: " + ", ".join(FORMATS))
    ap.add_argument("--cache", type=Path, default=CACHE / "formats", help="where the checkpoints are made once")
    ap.add_argument(
        "--llmcompressor-python",
        default=os.environ.get("ANYQUANT_LLMCOMPRESSOR_PYTHON") or str(REPO / ".venv-llmcompressor" / "bin" / "python"),
        help="a Python with llmcompressor (default: $ANYQUANT_LLMCOMPRESSOR_PYTHON, else make install's .venv-llmcompressor)",
    )
    ap.add_argument("--mlx-python", default="/root/peers/mlx/bin/python", help="a Python with mlx and mlx-lm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=64, help="greedy tokens per decode sample")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill sample")
    ap.add_argument("--max-other", type=float, default=0.05, help="leave out samples where other processes used more")
    ap.add_argument(
        "--ct-peer",
        choices=("auto", "compressed", "decompressed"),
        default="auto",
        help="compressed-tensors peer: its default (compressed) modules, or run_compressed=False; auto: the "
        "default, falling back to run_compressed=False where it fails",
    )
    ap.add_argument("--model", choices=MODELS, default="smollm2", help="the model every format is made from")
    ap.add_argument("--make-only", action="store_true", help="make the checkpoints and stop")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--runtime-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child or args.runtime_child:
        run = runtime_child if args.runtime_child else child
        print(json.dumps(run(json.loads(sys.stdin.read()))))
        return 0

    t_start = time.perf_counter()
    wanted = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in wanted:
        if f not in FORMATS:
            ap.error(f"unknown format {f!r}; known: {', '.join(FORMATS)}")
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    src = dense(cache, args.model)
    made: dict[str, tuple[Path | None, str]] = {}
    for f in wanted:
        made[f] = make(f, cache, args.llmcompressor_python, args.mlx_python, args.model)
        path, note = made[f]
        print(f"# {f}: {path or 'NOT made'} ({FORMATS[f][1]}: {note})", flush=True)
    if args.make_only:
        return 0

    _unshadow()
    from _measure import machine

    compile_sources()  # the loads read anyquant's modules compiled, as installed
    ids = prompt_ids(cache, src, args.prefill + PROMPT)
    before = cpu_times()
    bw = bandwidth(args.threads)
    bw_other = other_share(before, cpu_times())
    print(f"# machine: {machine()}")
    print(f"# {versions(args.llmcompressor_python, args.mlx_python)}")
    print(
        f"# {args.threads} threads every engine; bandwidth {bw / 1e9:.1f} GB/s (torch copy, other CPU {bw_other:.0%}); "
        f"load average {os.getloadavg()[0]:.2f}; samples {args.samples}, other-CPU limit {args.max_other:.0%}; "
        f"decode {args.decode} tokens after {PROMPT}, prefill {args.prefill}",
        flush=True,
    )

    table = [
        "| format | row | peer | anyquant | anyquant / peer | other CPU (max of used samples) |",
        "|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for f in wanted:
        path, note = made[f]
        label = FORMATS[f][0]
        if path is None:
            table.append(f"| {label} | checkpoint not made: {note[-200:].replace('|', '/')} | | | | |")
            continue
        common = {"threads": args.threads, "decode": args.decode, "prefill": args.prefill, "ids": str(ids)}
        common |= {"path": str(path), "format": f}
        peer_name = "mlx_lm" if f == "mlx-q4" else "transformers"
        peer_python = args.mlx_python if f == "mlx-q4" else sys.executable
        peer_cfg = {**common, "engine": "mlx" if f == "mlx-q4" else "transformers"}
        if f.startswith("ct-"):
            peer_cfg["ct_peer"] = "decompressed" if args.ct_peer == "decompressed" else "compressed"
        engines = [(peer_name, peer_cfg, peer_python), ("anyquant", {**common, "engine": "anyquant"}, sys.executable)]
        samples: dict[str, list[dict[str, Any]]] = {peer_name: [], "anyquant": []}
        for i in range(args.samples):
            for name, cfg, python in engines if i % 2 == 0 else engines[::-1]:
                r = measure(cfg, python)
                if "error" in r and name == "transformers" and f.startswith("ct-") and args.ct_peer == "auto":
                    notes.append(
                        f"{f}: the compressed-tensors default failed ({r['error'][-200:]}); run_compressed=False"
                    )
                    peer_cfg["ct_peer"] = "decompressed"
                    r = measure(cfg, python)
                brief = r.get("error") or {k: round(v, 3) for k, v in r.items() if isinstance(v, float)}
                print(f"# {f} / {name} sample {i + 1}: {brief}", file=sys.stderr, flush=True)
                samples[name].append(r)
        weight_bytes = checkpoint_bytes(path)
        for name, cfg, python in engines:  # "the runtime" of each, in a process of its own
            base = measure(cfg, python, runtime=True).get("runtime_rss_mib")
            for s in samples[name]:
                if base is not None and "peak_rss_mib" in s:
                    s["runtime_rss_mib"] = base
                    s["above_x"] = (s["peak_rss_mib"] - base) * 2**20 / weight_bytes
        backend = next((s["info"] for s in samples["anyquant"] if s.get("info")), "?")
        peer_info = next((s["info"] for s in samples[peer_name] if s.get("info")), "?")
        for s in (*samples["anyquant"], *samples[peer_name]):
            if "peak_rss_mib" in s:
                s["rss_x"] = s["peak_rss_mib"] * 2**20 / weight_bytes
        rows = [
            ("decode tok/s", "decode_tok_s", "{:.1f}"),
            (f"prefill {args.prefill} tok/s", "prefill_tok_s", "{:.0f}"),
            ("load s (lower is better)", "load_s", "{:.2f}"),
            ("peak RSS MiB (VmHWM; lower is better)", "peak_rss_mib", "{:.0f}"),
            (f"peak RSS / weight bytes ({weight_bytes / 2**20:.1f} MiB)", "rss_x", "{:.2f}x"),
            ("RSS of the runtime MiB (libraries imported, no weight read)", "runtime_rss_mib", "{:.0f}"),
            ("peak RSS above the runtime / weight bytes", "above_x", "{:.2f}x"),
        ]
        for title, key, fmt in rows:
            pt, pv, po = cell(samples[peer_name], key, fmt, args.max_other)
            at, av, ao = cell(samples["anyquant"], key, fmt, args.max_other)
            if key != "decode_tok_s":  # an engine's error is spelled out once, in its first row
                pt, at = ("error (above)" if v is None else t for t, v in ((pt, pv), (at, av)))
            ratio = f"{av / pv:.2f}x" if av and pv else "-"
            first = f" {label}: anyquant `{backend}`, peer {peer_name} " if key == "decode_tok_s" else " "
            table.append(f"|{first}| {title} | {pt} | {at} | {ratio} | {max(po, ao):.1%} |")
        pt_tokens = next((s["tokens"] for s in samples[peer_name] if s.get("tokens")), None)
        aq_tokens = next((s["tokens"] for s in samples["anyquant"] if s.get("tokens")), None)
        if pt_tokens and aq_tokens:
            agree = 0
            while agree < min(len(pt_tokens), len(aq_tokens)) and pt_tokens[agree] == aq_tokens[agree]:
                agree += 1
            table.append(f"| | greedy tokens the same as the peer's (of the first 16) | {agree} | | | |")
        notes.append(f"{f}: peer path: {peer_info}")
    print()
    print("\n".join(table))
    print()
    for line in notes:
        print(f"- {line}")
    print(f"\n# {time.perf_counter() - t_start:.0f} s in all; load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
