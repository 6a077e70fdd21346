"""The native runtime's compiled decode step against its module path, in one process per checkpoint.

For each checkpoint (anyquant's default backend, which is cpu-fast on this machine): greedy decode steps
after a short prompt, alternating the module path (``DecoderLayer`` modules, the step switched off) and the
compiled step (:mod:`anyquant_cpu.step`) ``--repeat`` times; prints the median milliseconds per token
of each, the speed-up, and whether both produced the same tokens and bitwise the same logits. A third path
builds every planned layer with the ``mixed`` functions (each linear dispatched by its kind inside the compiled
function) instead of the one-kind ones (``int4``, ``bf16``, ``ggml``), to compare them on uniform layers; another
compiles only the layers of one kind (layers that mix kinds through their modules: the step before the mixed
functions). ``--cpu-time``: the process's CPU time per token instead of wall time (on a machine other jobs load).
``--engines``: the same planned layers run three more ways (issue #41's TorchScript question): ``eager``, each
layer's plain Python function (the fused kernel calls without TorchScript, as ``PYTORCH_JIT=0`` runs them);
``compile``, each layer's function through ``torch.compile`` (compiled on a warm-up run first, not timed).

Checkpoints: the cached GPTQ and AWQ 4-bit g64 SmolLM2-135M of ``bench/gptq.py`` / ``bench/awq.py``, the
random-trellis EXL3 K=4 of ``bench/exl3.py --parts model`` and the bundled GGUF Q4_1 (those not cached
are made first, which for AWQ takes ~15 minutes); a path in ``--only`` is loaded as it is (e.g. a GGUF Q4_K_M).

    python bench/step.py [--threads 1] [--steps 60] [--repeat 4] [--only gptq,awq,exl3,gguf,/path/to/file.gguf]
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

from _measure import ENV, _unshadow, machine, quantized_model
from exl3 import random_exl3_model  # before _measure's helpers take bench/ off sys.path

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def checkpoint(name: str) -> Path:
    if name in ("gptq", "awq"):
        options = {"quantizer_backend": "gptqmodel"} if name == "awq" else {}
        return quantized_model(name, bits=4, group_size=64, **options)
    if name == "exl3":
        return random_exl3_model(4)
    if name == "gguf":
        import anyquant

        return Path(anyquant.default_model())
    if Path(name).exists():
        return Path(name)
    raise SystemExit(f"unknown checkpoint {name!r}")


def engine_steps(module: Any) -> dict[str, Any]:
    """The decode step of ``module`` with its layer functions as plain Python (``eager``) and through
    ``torch.compile`` (``compile``), beside TorchScript's (the default)."""
    import torch

    from anyquant_cpu import step as step_mod

    built: dict[str, Any] = {}
    original = step_mod.compiled_layer, step_mod._stack
    compiled: dict[str, Any] = {}

    def through_compile(kind: str) -> Any:
        if kind not in compiled:
            compiled[kind] = torch.compile(step_mod.LAYER_FUNCTIONS[kind], dynamic=True)
        return compiled[kind]

    try:
        step_mod._stack = lambda layers: None
        step_mod.compiled_layer = lambda kind: step_mod.LAYER_FUNCTIONS[kind]
        built["eager"] = step_mod.DecodeStep.build(module)
        step_mod.compiled_layer = through_compile
        built["compile"] = step_mod.DecodeStep.build(module)
    finally:
        step_mod.compiled_layer, step_mod._stack = original
    return built


def measure(
    path: str, threads: int, steps: int, repeat: int, cpu_time: bool = False, engines: bool = False
) -> dict[str, Any]:
    """In this process: load ``path``, then time both paths (``repeat`` alternating runs of ``steps``)."""
    _unshadow()
    import torch

    torch.set_num_threads(threads)
    import anyquant
    from anyquant.runtime.native import NativeCache, NativeCausalLM

    model = anyquant.load(path)
    module = model.module
    if not isinstance(module, NativeCausalLM):
        return {"error": f"not the native runtime: {type(module).__name__}"}
    ids = torch.tensor([model.tokenizer.encode(PROMPT)])
    compiled = NativeCausalLM._decode_step

    def run() -> tuple[float, list[int], Any]:
        cache = NativeCache(module.config.num_hidden_layers)
        out = module(ids, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        tokens = []
        clock = time.process_time if cpu_time else time.perf_counter
        t0 = clock()
        for _ in range(steps):
            out = module(nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(int(nxt))
        return (clock() - t0) / steps * 1e3, tokens, out.logits

    from anyquant_cpu.step import DecodeStep

    mixed = DecodeStep.build(module, uniform=False)  # every layer by the mixed functions
    one_kind = DecodeStep.build(module)  # as before the mixed functions: layers of mixed kinds through their modules
    if one_kind is not None:
        one_kind.layers = [
            None if p is not None and "mixed" in getattr(p[0], "name", getattr(p[0], "__name__", "")) else p
            for p in one_kind.layers
        ]
    paths = {"modules": lambda self: None, "one_kind": lambda self: one_kind, "step": compiled}
    paths["mixed"] = lambda self: mixed
    if engines:
        others = engine_steps(module)
        paths["eager"] = lambda self: others["eager"]
        paths["compile"] = lambda self: others["compile"]
    times: dict[str, list[float]] = {name: [] for name in paths}
    seen: dict[str, tuple[list[int], Any]] = {}
    with torch.inference_mode():
        if engines:  # torch.compile's compilation, not timed
            t0 = time.perf_counter()
            NativeCausalLM._decode_step = paths["compile"]
            run()
            compile_s = time.perf_counter() - t0
        for _ in range(repeat):
            for path_name in times:
                NativeCausalLM._decode_step = paths[path_name]
                ms, tokens, logits = run()
                times[path_name].append(ms)
                seen[path_name] = (tokens, logits)
    NativeCausalLM._decode_step = compiled
    step = module.__dict__.get("_step")
    planned = [p for p in step.layers if p is not None] if step is not None else []
    kinds = sorted({getattr(fn, "name", getattr(fn, "__name__", "?")) for fn, _ in planned})
    return {
        "backend": model.backend,
        "layers": f"{len(planned)}/{module.config.num_hidden_layers} ({', '.join(kinds)})",
        "modules_ms": statistics.median(times["modules"]),
        "one_kind_ms": statistics.median(times["one_kind"]),
        "step_ms": statistics.median(times["step"]),
        "mixed_ms": statistics.median(times["mixed"]),
        **(
            {
                "eager_ms": statistics.median(times["eager"]),
                "compile_ms": statistics.median(times["compile"]),
                "compile_s": compile_s,
            }
            if engines
            else {}
        ),
        "same_tokens": all(seen["modules"][0] == seen[p][0] for p in paths),
        "max_logit_diff": max(float((seen["modules"][1] - seen[p][1]).abs().max()) for p in paths),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60, help="decode steps per timed run (the KV buffers hold 64)")
    ap.add_argument("--repeat", type=int, default=4, help="alternating runs of each path")
    ap.add_argument("--only", default="gptq,awq,exl3,gguf")
    ap.add_argument("--cpu-time", action="store_true", help="the process's CPU time, not wall time (a loaded machine)")
    ap.add_argument("--engines", action="store_true", help="also the layers as plain Python and via torch.compile")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.threads, args.steps, args.repeat, args.cpu_time, args.engines)))
        return 0
    clock = "CPU time" if args.cpu_time else "wall time"
    print(
        f"# machine: {machine()}; threads {args.threads}; {args.steps} greedy steps, median of {args.repeat}; {clock}"
    )
    print(
        "| checkpoint | backend | layers compiled | module path ms/token | one-kind layers only ms/token "
        "| compiled step ms/token | speed-up | every layer by the mixed functions ms/token | same tokens | max logit diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    engine_rows: list[str] = []
    for name in args.only.split(","):
        path = checkpoint(name)
        cmd = [sys.executable, __file__, "--child", str(path), "--threads", str(args.threads)]
        cmd += ["--steps", str(args.steps), "--repeat", str(args.repeat)] + (["--cpu-time"] if args.cpu_time else [])
        env = {**ENV, **os.environ}
        if args.engines:
            cmd.append("--engines")
            env.pop("TORCH_COMPILE_DISABLE", None)  # torch.compile is what --engines measures
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"| {name} | failed: {proc.stderr.strip().splitlines()[-1:]} |")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        if "error" in r:
            print(f"| {name} | {r['error']} |")
            continue
        print(
            f"| {name} | {r['backend']} | {r['layers']} | {r['modules_ms']:.1f} | {r['one_kind_ms']:.1f} | {r['step_ms']:.1f} | "
            f"{r['modules_ms'] / r['step_ms']:.2f}x | {r['mixed_ms']:.1f} | {r['same_tokens']} | {r['max_logit_diff']:.1e} |"
        )
        if "eager_ms" in r:
            engine_rows.append(
                f"| {name} | {r['step_ms']:.1f} | {r['eager_ms']:.1f} | {r['compile_ms']:.1f} | {r['compile_s']:.0f} s |"
            )
    if engine_rows:
        print("\n| checkpoint | TorchScript ms/token | plain Python ms/token | torch.compile ms/token | compile time |")
        print("|---|---|---|---|---|")
        print("\n".join(engine_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
