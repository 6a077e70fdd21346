"""Peer worker: produce GPTQ fixtures with GPTQModel's own code, in a separate process.

Usage: ``python gptqmodel_worker.py --out DIR --params PARAMS.json``.  Run through
``tests.peers.fixtures.build_peer_fixture``; never import this module in the test
process (``import gptqmodel`` patches transformers globally).

Modes (``params["mode"]``):

* ``packer``: for each case, pack random codes with GPTQModel's ``TorchLinear``
  packers (``pack_block`` as the quantize pipeline uses it, and ``pack_original``),
  convert v2 -> v1 like the writer does for ``format="gptq"``, then load the
  tensors into a fresh ``TorchLinear`` the way the loader does (v1 -> v2 word add)
  and record its ``dequantize_weight()`` (eval path and generic path).
* ``quantized``: build a tiny random Llama (byte-level tokenizer, fp16), quantize
  it with ``GPTQModel.quantize`` for each variant, save the checkpoint, reload it
  with ``BACKEND.TORCH`` and record every ``TorchLinear.dequantize_weight()``,
  logits on a fixed prompt and greedy tokens.  With ``params["method"] == "awq"``
  the variants use ``AWQConfig`` and ``BACKEND.AWQ_TORCH`` (quantize and reload);
  the recorded weight is GPTQModel's ``dequantize_gemm`` on each loaded
  ``AwqTorchLinear``, exactly as its forward computes it.
* ``reload``: load an existing checkpoint (``params["checkpoint"]``, written by anyquant) with
  GPTQModel's torch kernel and record the same dequantized weights, logits and greedy tokens.

Exit code 77 (with a JSON line ``{"unavailable": reason}``) when gptqmodel cannot
be imported.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

UNAVAILABLE_EXIT = 77
_ENV_DEFAULTS = {
    "TORCH_COMPILE_DISABLE": "1",
    "GPTQMODEL_CPU_WORKERS": "2",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def _case_name(case: dict[str, Any]) -> str:
    if "name" in case:
        return str(case["name"])
    kind = "sym" if case["sym"] else "asym"
    order = "desc" if case["desc_act"] else "nodesc"
    return f"b{case['bits']}_g{case['group_size']}_{kind}_{order}_{case['format']}"


# --------------------------------------------------------------------------- packer


def _random_case_tensors(case: dict[str, Any], in_f: int, out_f: int, seed: int) -> dict[str, Any]:
    import torch

    bits, group_size = case["bits"], case["group_size"]
    gen = torch.Generator().manual_seed(seed)
    maxq = (1 << bits) - 1
    group = in_f if group_size == -1 else group_size
    num_groups = math.ceil(in_f / group)
    g_idx = torch.arange(in_f, dtype=torch.int32) // group
    if case["desc_act"]:
        perm = torch.randperm(in_f, generator=gen)
        g_idx = torch.empty(in_f, dtype=torch.int32)
        g_idx[perm] = torch.arange(in_f, dtype=torch.int32) // group
    codes = torch.randint(0, maxq + 1, (in_f, out_f), generator=gen, dtype=torch.int32)
    if case["sym"]:
        zeros = torch.full((num_groups, out_f), 1 << (bits - 1), dtype=torch.int32)
    else:
        zeros = torch.randint(0, maxq + 1, (num_groups, out_f), generator=gen, dtype=torch.int32)
        zeros[-1, : out_f // 2] = 0  # forces carries through the v1 packed-word arithmetic
        zeros[0, -4:] = maxq
    scales = (torch.rand(num_groups, out_f, generator=gen) * 0.02 + 1e-3).half()
    return {"codes": codes, "zeros": zeros, "scales": scales, "g_idx": g_idx}


def _make_linear(tensors: dict[str, Any]) -> Any:
    import torch

    codes, zeros, scales, g_idx = (tensors[k] for k in ("codes", "zeros", "scales", "g_idx"))
    index = g_idx.long()
    # Exact in fp32, so GPTQModel's round((W + z*s) / s) recovers `codes` exactly.
    weight = ((codes - zeros[index]).float() * scales.float()[index]).t().contiguous()
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    return linear


def _new_torch_linear(case: dict[str, Any], in_f: int, out_f: int) -> Any:
    import torch
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear

    return TorchLinear(
        bits=case["bits"],
        group_size=case["group_size"],
        sym=case["sym"],
        desc_act=case["desc_act"],
        in_features=in_f,
        out_features=out_f,
        bias=False,
        pack_dtype=torch.int32,
    )


def _pack(case: dict[str, Any], tensors: dict[str, Any], method: str) -> Any:
    module = _new_torch_linear(case, tensors["codes"].shape[0], tensors["codes"].shape[1])
    linear = _make_linear(tensors)
    scales = tensors["scales"].float().t().contiguous()  # GPTQModel packers take [N, G]
    zeros = tensors["zeros"].float().t().contiguous()
    getattr(module, method)(linear, scales, zeros, tensors["g_idx"].clone())
    return module


def _to_v1(module: Any, bits: int) -> None:
    from gptqmodel.quantization import QuantizeConfig
    from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module

    config = QuantizeConfig(bits=bits, offload_to_disk=False)
    convert_gptq_v2_to_v1_format_module(module=module, quantize_config=config)


def _gptqmodel_dequant(case: dict[str, Any], ckpt: dict[str, Any]) -> dict[str, Any]:
    """Load checkpoint tensors like the loader does and dequantize with TorchLinear."""
    import torch
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module

    in_f = ckpt["g_idx"].numel()
    module = _new_torch_linear(case, in_f, ckpt["scales"].shape[1])
    module.load_state_dict({k: v.clone() for k, v in ckpt.items()}, strict=False)
    if case["format"] == "gptq":
        convert_gptq_v1_to_v2_format_module(module, bits=case["bits"], pack_dtype=torch.int32)
    module.post_init()
    module.eval()
    with torch.inference_mode():
        eval_weight = module.dequantize_weight()
        generic_weight = PackableQuantLinear.dequantize_weight(module)
    return {
        "dequant_eval": eval_weight.contiguous(),
        "dequant_generic": generic_weight.contiguous(),
        "qzeros_loaded_v2": module.qzeros.detach().clone(),
    }


def _model_dequant_zeros(qzeros: Any, bits: int, out_f: int) -> Any:
    from gptqmodel.utils.model_dequant import _correct_gptq_v1_qzeros, unpack_cols

    return unpack_cols(_correct_gptq_v1_qzeros(qzeros.clone(), bits), bits)[:, :out_f].contiguous()


def _packer_case(case: dict[str, Any], in_f: int, out_f: int, seed: int) -> dict[str, Any]:
    tensors = _random_case_tensors(case, in_f, out_f, seed)
    block = _pack(case, tensors, "pack_block")
    original = _pack(case, tensors, "pack_original")
    result = dict(tensors)
    result["qweight_pack_block"] = block.qweight.clone()
    result["qzeros_pack_block_v2"] = block.qzeros.clone()
    result["qweight_pack_original"] = original.qweight.clone()
    result["qzeros_pack_original_v2"] = original.qzeros.clone()
    if case["format"] == "gptq":
        _to_v1(block, case["bits"])
    ckpt = {k: getattr(block, k).detach().clone().contiguous() for k in ("qweight", "qzeros", "scales", "g_idx")}
    result.update({f"ckpt_{k}": v for k, v in ckpt.items()})
    result.update(_gptqmodel_dequant(case, ckpt))
    if case["format"] == "gptq":
        result["zeros_model_dequant"] = _model_dequant_zeros(ckpt["qzeros"], case["bits"], out_f)
    return result


def run_packer(params: dict[str, Any], out: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    in_f, out_f = params["in_features"], params["out_features"]
    cases = {}
    for i, case in enumerate(params["cases"]):
        name = _case_name(case)
        tensors = _packer_case(case, in_f, out_f, params["seed"] + i)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"{name}.safetensors"))
        cases[name] = case
    return {"mode": "packer", "cases": cases}


# --------------------------------------------------------------------------- quantized


def _byte_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _build_base(model_params: dict[str, Any], base: Path, seed: int) -> Any:
    """A tiny random model of ``model_params["model_type"]`` (default ``llama``; the rest are config values)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = _byte_tokenizer()
    vocab = tokenizer.get_vocab()
    model_params = dict(model_params)
    model_type = model_params.pop("model_type", "llama")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(vocab),
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
        **model_params,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float16)
    with torch.no_grad():  # random init leaves the norms at 1 (q/k norms, Gemma's extra ones): vary them
        for name, param in model.named_parameters():
            if model_type != "llama" and param.dim() == 1 and name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    model.save_pretrained(str(base))
    tokenizer.save_pretrained(str(base))
    return tokenizer


def _calibration_texts(count: int, chars: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    words = (
        "the model weight group scale zero point token layer quantized matrix vector "
        "of and to in is a cat river north seven"
    ).split()
    texts = []
    for _ in range(count):
        pieces: list[str] = []
        while sum(len(p) + 1 for p in pieces) < chars:
            pieces.append(rng.choice(words))
        texts.append(" ".join(pieces).capitalize() + ".")
    return texts


def _quantize_config(method: str, variant: dict[str, Any]) -> Any:
    from gptqmodel import QuantizeConfig
    from gptqmodel.quantization.config import AWQConfig

    common = {
        "bits": variant["bits"],
        "group_size": variant["group_size"],
        "sym": variant["sym"],
        "format": variant["format"],
        "offload_to_disk": False,
    }
    if method == "awq":
        return AWQConfig(**common)
    # GAR (GPTQModel's default without desc_act) needs group_size > 0 and excludes desc_act.
    gar = variant["group_size"] > 0 and not variant["desc_act"]
    return QuantizeConfig(desc_act=variant["desc_act"], act_group_aware=gar, **common)


def _quantize_variant(base: Path, vdir: Path, method: str, variant: dict[str, Any], cal: list[str], tok: Any) -> None:
    import torch
    from gptqmodel import BACKEND, GPTQModel

    model = GPTQModel.load(str(base), _quantize_config(method, variant), dtype=torch.float16)
    # AWQ's default kernel choice wants CUDA; AWQ_TORCH is the CPU packer/kernel.
    backend = BACKEND.AWQ_TORCH if method == "awq" else BACKEND.AUTO
    model.quantize(cal, tokenizer=tok, batch_size=4, backend=backend)
    model.save(str(vdir))
    del model
    gc.collect()


def _module_dequant(method: str, module: Any) -> Any | None:
    """GPTQModel's own dequantized weight ([in, out]) for its CPU torch modules."""
    if method == "gptq":
        from gptqmodel.nn_modules.qlinear.torch import TorchLinear

        return module.dequantize_weight() if isinstance(module, TorchLinear) else None
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    if not isinstance(module, AwqTorchLinear):
        return None
    # The exact call AwqTorchLinear.forward makes before its matmul.
    return dequantize_gemm(
        qweight=module.qweight,
        qzeros=module.qzeros,
        scales=module.scales,
        bits=module.bits,
        group_size=module.group_size,
    )


def _reload_dequant(vdir: Path, method: str, dtype: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    import torch
    from gptqmodel import BACKEND, GPTQModel

    backend = BACKEND.AWQ_TORCH if method == "awq" else BACKEND.TORCH
    model = GPTQModel.load(str(vdir), backend=backend, device="cpu", dtype=dtype)
    weights, info = {}, {}
    with torch.inference_mode():
        for name, module in model.model.named_modules():
            weight = _module_dequant(method, module)
            if weight is None:
                continue
            weights[f"{name}.weight"] = weight.contiguous()
            info[name] = {
                "class": type(module).__name__,
                "training": module.training,
                "scales_dtype": str(module.scales.dtype),
            }
    return model, weights, info


def _logits_and_greedy(model: Any, vocab: int, params: dict[str, Any]) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(params["seed"])
    input_ids = torch.randint(0, min(vocab, 256), (1, params["prompt_len"]), generator=gen)
    with torch.inference_mode():
        logits = model.model(input_ids=input_ids).logits.float()
        prompt = input_ids[:, : params["greedy_prompt_len"]]
        greedy = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=params["new_tokens"],
            do_sample=False,
        )
    return {"input_ids": input_ids, "logits": logits.contiguous(), "greedy_tokens": greedy.contiguous()}


def _variant(base: Path, out: Path, variant: dict[str, Any], cal: list[str], tok: Any, params: dict) -> dict:
    import torch
    from safetensors.torch import save_file

    method = params.get("method", "gptq")
    vdir = out / "quantized" / _case_name(variant)
    jdir = out / "judges" / _case_name(variant)  # outside the checkpoint: loaders glob *.safetensors
    jdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _quantize_variant(base, vdir, method, variant, cal, tok)
    quantize_s = time.monotonic() - started
    model, weights, info = _reload_dequant(vdir, method, torch.float16)
    save_file(weights, str(jdir / "gptqmodel_dequant.safetensors"))
    record: dict[str, Any] = {"variant": variant, "modules": info, "quantize_seconds": round(quantize_s, 2)}
    try:
        save_file(_logits_and_greedy(model, len(tok.get_vocab()), params), str(jdir / "gptqmodel_logits.safetensors"))
    except Exception as exc:  # logits are a bonus for later tests; keep the dequant fixture
        record["logits_error"] = repr(exc)
    del model
    if _case_name(variant) == params.get("bf16_variant"):
        model, weights, info = _reload_dequant(vdir, method, torch.bfloat16)
        save_file(weights, str(jdir / "gptqmodel_dequant_bf16.safetensors"))
        record["bf16_modules"] = info
        del model
    gc.collect()
    record["seconds"] = round(time.monotonic() - started, 2)
    return record


def run_quantized(params: dict[str, Any], out: Path) -> dict[str, Any]:
    base = out / "base"
    tok = _build_base(params["model"], base, params["seed"])
    cal = _calibration_texts(params["calibration_samples"], params["calibration_chars"], params["seed"])
    variants = {}
    for variant in params["variants"]:
        variants[_case_name(variant)] = _variant(base, out, variant, cal, tok, params)
    return {"mode": "quantized", "method": params.get("method", "gptq"), "base": "base", "variants": variants}


def run_reload(params: dict[str, Any], out: Path) -> dict[str, Any]:
    """Load a checkpoint someone else wrote (``params["checkpoint"]``, e.g. anyquant's own AWQ
    quantizer) with GPTQModel and record what it computes: every module's dequantized weight, the
    logits on a fixed prompt and greedy tokens. ``params["digest"]`` (the weights' hash) keys the cache."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    method = params.get("method", "awq")
    ckpt = Path(params["checkpoint"])
    jdir = out / "judges" / "reload"
    jdir.mkdir(parents=True, exist_ok=True)
    model, weights, info = _reload_dequant(ckpt, method, torch.float16)
    save_file(weights, str(jdir / "gptqmodel_dequant.safetensors"))
    vocab = len(AutoTokenizer.from_pretrained(str(ckpt)).get_vocab())
    save_file(_logits_and_greedy(model, vocab, params), str(jdir / "gptqmodel_logits.safetensors"))
    return {"mode": "reload", "method": method, "digest": params["digest"], "modules": info}


# --------------------------------------------------------------------------- main


def _versions() -> dict[str, str]:
    from importlib import metadata

    names = ("gptqmodel", "torch", "transformers", "safetensors")
    result = {}
    for name in names:
        try:
            result[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            result[name] = "absent"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--params", required=True, type=Path)
    args = parser.parse_args(argv)
    params = json.loads(args.params.read_text())
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import torch

        torch.set_num_threads(int(params.get("torch_threads", 1)))
        import gptqmodel  # noqa: F401
    except Exception as exc:  # any import failure means "peer unavailable"
        print(json.dumps({"unavailable": f"cannot import torch + gptqmodel: {exc!r}"}))
        return UNAVAILABLE_EXIT
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    runner = {"packer": run_packer, "quantized": run_quantized, "reload": run_reload}[params["mode"]]
    manifest = runner(params, args.out)
    manifest["versions"] = _versions()
    manifest["seconds"] = round(time.monotonic() - started, 2)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
