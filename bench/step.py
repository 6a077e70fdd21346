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
``compile``, each layer's function through ``torch.compile``; ``compile_stack``, every layer in one
``torch.compile`` call (as the scripted ``_Stack`` runs them). Both compile on a warm-up run first, not timed; the
anyquant kernel ops get shape-only fake kernels here so that a layer is one graph, not one per op between them;
``TORCH_COMPILE_DISABLE`` is dropped from the child's environment. Every path runs once untimed first (TorchScript
scripts and profiles on its first calls too).

Checkpoints: the cached GPTQ and AWQ 4-bit g64 SmolLM2-135M of ``bench/gptq.py`` / ``bench/awq.py``, the
random-trellis EXL3 K=4 of ``bench/exl3.py --parts model`` and the bundled GGUF Q4_1 (those not cached
are made first, which for AWQ takes ~15 minutes); a path in ``--only`` is loaded as it is (e.g. a GGUF Q4_K_M).

    python bench/step.py [--threads 1] [--steps 60] [--repeat 4] [--cpu-time] [--engines]
        [--only gptq,awq,exl3,gguf,/path/to/file.gguf]
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


#: output shapes of the anyquant kernel ops the layer functions call, for torch.compile's tracing (the C++ library
#: registers CPU kernels only: without these, Dynamo breaks the graph at each call)
FAKES = {
    "rms_norm": lambda x, *_: x.new_empty(x.shape),
    "ggml_gemv": lambda x, blocks, kind, rows, *_: x.new_empty(*x.shape[:-1], rows),
    "ggml_gemv_cat": lambda x, blocks, kinds, rows, *_: x.new_empty(*x.shape[:-1], sum(rows)),
    "ggml_experts": lambda x, *_: x.new_empty(x.shape),
}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def engine_steps(module: Any) -> dict[str, Any]:
    """The decode step of ``module`` with its layer functions as plain Python (``eager``), through
    ``torch.compile`` per layer (``compile``) and all layers in one ``torch.compile`` call (``compile_stack``), beside
    TorchScript's (the default)."""
    import torch

    from anyquant_cpu import kernels
    from anyquant_cpu import step as step_mod

    if kernels.available():
        for op, fake in FAKES.items():
            torch.library.register_fake(f"anyquant::{op}")(fake)

    built: dict[str, Any] = {}
    original = step_mod.compiled_layer, step_mod._stack
    compiled: dict[str, Any] = {}

    def through_compile(kind: str) -> Any:
        if kind not in compiled:
            compiled[kind] = torch.compile(step_mod.LAYER_FUNCTIONS[kind])  # start: dynamic once it changes
        return compiled[kind]

    def compiled_stack(layers: list[Any]) -> Any:
        planned = [(step_mod.LAYER_FUNCTIONS[layer.kind], layer.args) for layer in layers]

        def stack(h: Any, cos: Any, sin: Any, mask: Any, keys: Any, values: Any, starts: Any) -> Any:
            for i, (function, args) in enumerate(planned):
                h = function(h, cos, sin, keys[i], values[i], starts[i], mask, *args)
            return h

        return torch.compile(stack)

    try:
        step_mod._stack = lambda layers: None
        step_mod.compiled_layer = lambda kind: step_mod.LAYER_FUNCTIONS[kind]
        built["eager"] = step_mod.DecodeStep.build(module)
        step_mod.compiled_layer = through_compile
        built["compile"] = step_mod.DecodeStep.build(module)
        step_mod.compiled_layer, step_mod._stack = (lambda kind: step_mod.LAYER_FUNCTIONS[kind]), compiled_stack
        built["compile_stack"] = step_mod.DecodeStep.build(module)
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
    from anyquant_runtime.native import NativeCache, NativeCausalLM

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
        paths["compile_stack"] = lambda self: others["compile_stack"]
    times: dict[str, list[float]] = {name: [] for name in paths}
    seen: dict[str, tuple[list[int], Any]] = {}
    with torch.inference_mode():
        warmed: dict[str, dict[str, float]] = {}
        for path_name in times:  # untimed: TorchScript's scripting and profiling runs, torch.compile's compilation
            NativeCausalLM._decode_step = paths[path_name]
            before, t0, cpu0 = (
                (rss_mib(), compile_stats()) if engines else (0.0, {}),
                time.perf_counter(),
                time.process_time(),
            )
            run()
            if path_name.startswith("compile"):
                after = compile_stats()
                warmed[path_name] = {"s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}
                warmed[path_name]["rss_mib"] = rss_mib() - before[0]
                warmed[path_name].update({k: after[k] - before[1][k] for k in after})
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
                "compile_stack_ms": statistics.median(times["compile_stack"]),
                "warm_up": warmed,
            }
            if engines
            else {}
        ),
        "same_tokens": all(seen["modules"][0] == seen[p][0] for p in paths),
        "max_logit_diff": max(float((seen["modules"][1] - seen[p][1]).abs().max()) for p in paths),
        "per_path": {
            p: [seen["modules"][0] == seen[p][0], float((seen["modules"][1] - seen[p][1]).abs().max())] for p in paths
        },
    }


def compile_stats() -> dict[str, int]:
    """Dynamo's graphs (a recompilation makes one more) and graph breaks in this process."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "breaks": int(sum(counters["graph_break"].values())),
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
            same = ", ".join(f"{p} {r['per_path'][p][0]} {r['per_path'][p][1]:.1e}" for p in list(r["per_path"])[2:])
            w = r["warm_up"]
            warm = " / ".join(
                f"{w[p]['s']:.1f} s ({w[p]['cpu_s']:.1f} CPU), {w[p]['rss_mib']:+.0f} MiB, {w[p]['graphs']}g {w[p]['breaks']}b"
                for p in w
            )
            engine_rows.append(
                f"| {name} | {r['modules_ms']:.1f} | {r['step_ms']:.1f} | {r['eager_ms']:.1f} | {r['compile_ms']:.1f} | "
                f"{r['compile_stack_ms']:.1f} | {warm} | {same} |"
            )
    if engine_rows:
        print(
            "\n| checkpoint | module path ms/token | TorchScript step ms/token | eager functions ms/token "
            "| torch.compile per layer ms/token | torch.compile all layers ms/token "
            "| warm-up run of each: wall s (CPU s), RSS, graphs, breaks | same tokens, max logit diff |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(engine_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
