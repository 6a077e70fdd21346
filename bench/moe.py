"""MoE decode on CPU: anyquant runs only the routed experts, against every expert computed and GPTQModel.

A Qwen3-MoE-shaped model with synthetic weights (hidden 1024, 16 heads of 64, 4 KV heads, 8 layers, 8 experts
of intermediate 768, top-2: 172M parameters, 39M active per token), written once under ``.cache/bench/moe``
as a dense fp16 checkpoint and as GPTQ 4-bit (symmetric, group 128, round-to-nearest, GPTQModel's v1 layout
and ``quantization_config``). Each row runs in a fresh process, the rows twice in alternating order (best of
the two kept): decode tokens/s (64 greedy tokens after a 32-token prompt) and, for anyquant's rows, the bytes
of the weights read per decode token (the modules one decode step runs, measured by hooks: a routed expert
counts only when some token chose it; an embedding counts one row).

Rows:
- anyquant ``cpu-fast`` (the CPU default): only the selected experts run;
- anyquant ``cpu-fast``, every expert computed (each expert runs on every token, its output weighted by the
  routing weight, 0 for experts not chosen): what an implementation without sparse dispatch reads;
- GPTQModel 7.6 on the same GPTQ files: its two fastest CPU backends (``GPTQ_TORCH_FUSED`` fp32,
  ``GPTQ_TORCH_ATEN`` bf16; see bench/gptq.py);
- ``--gguf FILE`` (a GGUF Q4_K_M of the same shape; ``--llama-cpp DIR`` makes it from the dense checkpoint with
  llama.cpp's own converter and quantizer) with ``--llama-python PY`` (a Python with llama-cpp-python):
  llama.cpp's decode on it (with its repacked kernels where they run: see bench/llamacpp.py), and anyquant's GGUF
  loader on the same file.

Goals (issue #25): bytes per token within 1.2x of the active parameters' bytes; decode at least 1.5x
GPTQModel's fastest CPU path and at least 0.7x llama.cpp.

    python bench/moe.py [--threads 2] [--llama-cpp /path/to/llama.cpp --llama-python /path/to/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _measure import CACHE, ENV, _unshadow, compile_sources, llama_cpp_extra_bufts, llama_cpp_model, machine

SHAPE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "moe_intermediate_size": 768,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}
GROUP = 128
VOCAB = 512
PROMPT, NEW = 32, 64


def build(root: Path) -> tuple[Path, Path]:
    """(dense fp16 dir, GPTQ dir), made once."""
    dense, gptq = root / "dense", root / "gptq"
    if (gptq / "config.json").is_file():
        return dense, gptq
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from anyquant.testing.tiny import make_tiny_dense
    from anyquant_runtime.packing import pack_cols, pack_rows

    make_tiny_dense(dense, dtype="float16", vocab_size=VOCAB, **SHAPE)
    _tokenizer(dense)
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    state = {}
    for key, value in model.state_dict().items():  # transformers 5: experts as 3-D tensors; split them back
        if key.endswith("experts.gate_up_proj"):
            for e, w in enumerate(value):
                gate, up = w.chunk(2)
                state[f"{key.removesuffix('gate_up_proj')}{e}.gate_proj.weight"] = gate
                state[f"{key.removesuffix('gate_up_proj')}{e}.up_proj.weight"] = up
        elif key.endswith("experts.down_proj"):
            for e, w in enumerate(value):
                state[f"{key.removesuffix('down_proj')}{e}.down_proj.weight"] = w
        else:
            state[key] = value
    out: dict[str, torch.Tensor] = {}
    for key, w in state.items():
        name = key.removesuffix(".weight")
        leaf = name.rpartition(".")[2]
        if w.dim() != 2 or ".layers." not in key or leaf == "gate":  # the router stays fp16, as GPTQModel keeps it
            out[key] = w.half()
            continue
        n, k = w.shape
        wg = w.t().reshape(k // GROUP, GROUP, n)
        scale = (wg.abs().amax(dim=1) / 7).clamp_min(1e-6).half()  # [G, N]
        codes = (torch.round(wg / scale.float()[:, None]) + 8).clamp(0, 15).to(torch.int32).reshape(k, n)
        out[f"{name}.qweight"] = pack_rows(codes, 4)
        out[f"{name}.qzeros"] = pack_cols(torch.full((k // GROUP, n), 7, dtype=torch.int32), 4)  # v1: zero - 1
        out[f"{name}.scales"] = scale
        out[f"{name}.g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
    gptq.mkdir(parents=True)
    save_file(out, str(gptq / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "sym": True,
        "desc_act": False,
        "checkpoint_format": "gptq",
        "lm_head": False,
        "pack_dtype": "int32",
        "meta": {"quantizer": ["gptqmodel:7.6.0"]},
    }
    (gptq / "config.json").write_text(json.dumps(config, indent=1))
    for f in dense.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            (gptq / f.name).write_bytes(f.read_bytes())
    return dense, gptq


def _tokenizer(out: Path) -> None:
    """A byte-level BPE with merges (llama.cpp refuses a BPE vocabulary without them), trained on a little of the
    wiki corpus, replacing make_tiny_dense's merge-free one; ids as the model's config expects."""
    from _measure import corpus_text
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from anyquant.testing.tiny import CHAT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 3,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text("wiki")[:200_000].splitlines(), trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    for f in out.glob("tokenizer*"):
        f.unlink()
    fast.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    ids = {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id, "pad_token_id": fast.pad_token_id}
    (out / "config.json").write_text(json.dumps({**config, **ids}, indent=1))


def make_gguf(dense: Path, out: Path, llama_cpp: Path, llama_python: str) -> Path:
    """The dense model as GGUF Q4_K_M, made by llama.cpp's own converter (F16) and quantizer."""
    if out.is_file():
        return out
    f16 = out.with_suffix(".f16.gguf")
    code = f"""
import runpy, sys
sys.path[:0] = [{str(llama_cpp)!r}, {str(llama_cpp / "gguf-py")!r}]
sys.argv = ["convert_hf_to_gguf.py", {str(dense)!r}, "--outfile", {str(f16)!r}, "--outtype", "f16"]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"  # the byte-level vocabulary's hash is unknown to it
runpy.run_path({str(llama_cpp / "convert_hf_to_gguf.py")!r}, run_name="__main__")
"""
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    )
    quantize = f"""
import ctypes, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 2
assert llama_cpp.llama_model_quantize({str(f16)!r}.encode(), {str(out)!r}.encode(), ctypes.byref(p)) == 0
"""
    subprocess.run([llama_python, "-c", quantize], check=True)
    f16.unlink()
    return out


def active_bytes(gptq: Path) -> tuple[int, int]:
    """(bytes of all weights, bytes one token needs: every non-expert tensor, top_k / E of the experts', and one
    embedding row instead of the table), from the checkpoint's headers."""
    from anyquant.probe import Probe

    probe = Probe.open(gptq)
    cfg = probe.config or {}
    share = cfg["num_experts_per_tok"] / (cfg.get("num_experts") or cfg["num_local_experts"])
    total = active = 0
    for name, t in probe.tensors.items():
        total += t.nbytes
        if name == "model.embed_tokens.weight":
            active += t.nbytes // t.shape[0]
        else:
            active += int(t.nbytes * share) if ".experts." in name else t.nbytes
    return total, active


def _all_experts(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """Every expert on every token, weighted by its routing weight (0 where not chosen)."""
    import torch

    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        weight = ((top_k_index == e) * top_k_weights).sum(-1, keepdim=True)
        out += self[e](hidden_states) * weight.to(out.dtype)
    return out


def _leaf_bytes(module: Any) -> int:
    import torch

    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    if isinstance(module, torch.nn.Embedding):
        return int(module.embedding_dim * module.weight.element_size())
    if callable(getattr(module, "packed_bytes", None)) and not tensors:  # an opaque oneDNN weight (bf16 prepacked)
        return int(module.packed_bytes())
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and not t.is_meta)


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    _unshadow()  # bench/gguf.py would stand for the gguf package
    import random

    prompt = random.Random(0).choices(range(256), k=PROMPT)
    if cfg["kind"] != "llama.cpp":  # llama.cpp's Python has no torch
        import torch

        torch.set_num_threads(cfg["threads"])
    t0 = time.perf_counter()
    if cfg["kind"] == "llama.cpp":
        llm = llama_cpp_model(
            cfg["path"],
            extra_bufts=bool(cfg.get("extra_bufts")),
            n_ctx=256,
            n_threads=cfg["threads"],
            n_threads_batch=cfg["threads"],
            n_batch=64,
        )
        load_s = time.perf_counter() - t0

        def generate() -> list[int]:
            llm.reset()
            got: list[int] = []
            for token in llm.generate(prompt, temp=0.0, top_k=1):
                got.append(int(token))
                if len(got) == NEW:
                    break
            return got

    elif cfg["kind"] == "gptqmodel":
        from gptqmodel import BACKEND, GPTQModel

        model = GPTQModel.load(
            cfg["path"], backend=getattr(BACKEND, cfg["backend"]), device="cpu", dtype=getattr(torch, cfg["dtype"])
        )
        load_s = time.perf_counter() - t0

        @torch.inference_mode()
        def generate() -> list[int]:
            t = torch.tensor([prompt])
            out = model.generate(
                t, attention_mask=torch.ones_like(t), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
            )
            return [int(x) for x in out[0, len(prompt) :]]

    else:
        import anyquant

        if cfg.get("all_experts"):
            from anyquant_runtime.experts import Experts

            Experts.forward = _all_experts  # type: ignore[method-assign]
        m = anyquant.load(cfg["path"], backend=cfg.get("backend", "auto"), **cfg.get("options", {}))
        load_s = time.perf_counter() - t0
        cfg["backend"] = m.backend
        m.generator.eos_ids = set()  # always NEW tokens, as the other rows

        def generate() -> list[int]:
            with torch.inference_mode():
                return m.generator.generate_ids(prompt, m.params(max_new_tokens=NEW))

    generate()  # warm-up
    best = float("inf")
    for _ in range(2):
        t1 = time.perf_counter()
        tokens = generate()
        best = min(best, time.perf_counter() - t1)
    result = {"load_s": load_s, "decode_tok_s": len(tokens) / best, "backend": cfg.get("backend", ""), "tokens": tokens}
    if cfg["kind"] == "anyquant":
        result["bytes_per_token"] = _bytes_per_token(m.module)
    return result


def _bytes_per_token(module: Any) -> float:
    """Bytes of the weights of the modules one decode step runs (after a 4-token prompt), averaged over 8 steps."""
    import torch

    seen: set[int] = set()
    total = [0]

    def hook(mod: Any, *_: Any) -> None:
        if id(mod) not in seen:
            seen.add(id(mod))
            total[0] += _leaf_bytes(mod)

    handles = [m.register_forward_pre_hook(hook) for m in module.modules() if not list(m.children())]
    counts = []
    with torch.inference_mode():
        out = module(torch.tensor([[1, 2, 3, 4]]), use_cache=True)
        past = out.past_key_values
        for step in range(8):
            seen.clear()
            total[0] = 0
            out = module(torch.tensor([[5 + step]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            counts.append(total[0])
    for h in handles:
        h.remove()
    return sum(counts) / len(counts)


def measure(cfg: dict[str, Any], python: str = sys.executable) -> dict[str, Any]:
    env = {**os.environ, **ENV}
    proc = subprocess.run(
        [python, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True, env=env, timeout=1800
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout)[-400:]}
    return dict(json.loads(lines[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", type=Path, help="a GGUF Q4_K_M of the same shape")
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python, for the llama.cpp row")
    parser.add_argument(
        "--llama-cpp", type=Path, help="a llama.cpp source tree: make the GGUF Q4_K_M (needs --llama-python)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    dense, gptq = build(CACHE / "moe")
    if args.llama_cpp and args.llama_python and not args.gguf:
        args.gguf = make_gguf(dense, CACHE / "moe" / "moe.Q4_K_M.gguf", args.llama_cpp, args.llama_python)
    total, active = active_bytes(gptq)
    common = {"threads": args.threads}
    rows: list[tuple[str, dict[str, Any], str]] = [
        ("anyquant GPTQ cpu-fast (routed experts)", {**common, "kind": "anyquant", "path": str(gptq)}, sys.executable),
        (
            "anyquant GPTQ cpu-fast, `cpu_fast_kernel='gq4'` (experts on the block kernel)",
            {**common, "kind": "anyquant", "path": str(gptq), "options": {"cpu_fast_kernel": "gq4"}},
            sys.executable,
        ),
        (
            "anyquant GPTQ cpu-fast, every expert computed",
            {**common, "kind": "anyquant", "path": str(gptq), "all_experts": True},
            sys.executable,
        ),
        (
            "GPTQModel GPTQ_TORCH_FUSED fp32",
            {**common, "kind": "gptqmodel", "path": str(gptq), "backend": "GPTQ_TORCH_FUSED", "dtype": "float32"},
            sys.executable,
        ),
        (
            "GPTQModel GPTQ_TORCH_ATEN bf16",
            {**common, "kind": "gptqmodel", "path": str(gptq), "backend": "GPTQ_TORCH_ATEN", "dtype": "bfloat16"},
            sys.executable,
        ),
    ]
    if args.gguf:
        rows.append(("anyquant GGUF (auto)", {**common, "kind": "anyquant", "path": str(args.gguf)}, sys.executable))
        if args.llama_python:
            # its repacked kernels (extra CPU buffer types) where they run: they segfault on AMX hosts
            extra = llama_cpp_extra_bufts(args.llama_python, args.gguf)
            print(f"# llama.cpp: extra CPU buffer types {'on (repacked kernels)' if extra else 'off (they fail here)'}")
            ll_cfg = {**common, "kind": "llama.cpp", "path": str(args.gguf), "extra_bufts": extra}
            rows.append(("llama.cpp GGUF", ll_cfg, args.llama_python))
    compile_sources()  # the loads time modules read, as installed, not compiled from source
    results: dict[str, dict[str, Any]] = {}
    for order in (rows, rows[::-1]):
        for name, cfg, python in order:
            r = measure(cfg, python)
            print(f"# {name}: {r}", file=sys.stderr, flush=True)
            old = results.get(name)
            if old is None or "error" in old or ("error" not in r and r["decode_tok_s"] > old["decode_tok_s"]):
                results[name] = r
    load = os.getloadavg()
    print(f"{machine()}; {args.threads} threads; load average {load[0]:.2f}")
    print(f"checkpoint: {total / 2**20:.1f} MiB of weights; active per token {active / 2**20:.1f} MiB\n")
    fastest_gm = max(
        (r["decode_tok_s"] for n, r in results.items() if n.startswith("GPTQModel") and "error" not in r), default=0
    )
    llama = results.get("llama.cpp GGUF", {}).get("decode_tok_s")
    first = results[rows[0][0]].get("tokens", [])[:16]
    print(
        "| row | backend | load s | decode tok/s | MiB read per token (x active) | vs GPTQModel fastest | vs llama.cpp "
        "| first 16 greedy tokens = row 1's |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, _, _ in rows:
        r = results[name]
        if "error" in r:
            print(f"| {name} | error: {' '.join(r['error'].split())[-150:]} | | | | | | |")
            continue
        read = (
            f"{r['bytes_per_token'] / 2**20:.1f} ({r['bytes_per_token'] / active:.2f}x)"
            if "bytes_per_token" in r
            else "-"
        )
        vs_gm = f"{r['decode_tok_s'] / fastest_gm:.2f}x" if fastest_gm else "-"
        vs_ll = f"{r['decode_tok_s'] / llama:.2f}x" if llama else "-"
        same = "yes" if r["tokens"][:16] == first else "no"
        print(
            f"| {name} | {r.get('backend', '')} | {r['load_s']:.1f} | {r['decode_tok_s']:.1f} | {read} | {vs_gm} "
            f"| {vs_ll} | {same} |"
        )


if __name__ == "__main__":
    main()
