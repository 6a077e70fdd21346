"""AWQ on CPU: the same table as ``bench/gptq.py`` for AWQ 4-bit g64 (GEMM), plus AWQ vs GPTQ perplexity.

SmolLM2-135M-Instruct quantized by ``anyquant.quantize(method="awq", quantizer_backend="gptqmodel")``
(GPTQModel's AWQ in a worker, fp16) with the same bits, group size and calibration texts as the GPTQ
bench (cached under ``.cache/bench/``); a second AWQ checkpoint made by anyquant's own quantizer
(zero point) adds a perplexity row, and ``--autoawq`` one made by AutoAWQ 0.2.9's own quantizer. Rows: anyquant's backends, GPTQModel's AWQ CPU backends, transformers
``from_pretrained`` of the checkpoint, dense fp32; then the GPTQ checkpoint's perplexity through
anyquant (auto backend) on the same held-out text.

    python bench/awq.py [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time

from _measure import checkpoint_bytes, dense_model, machine, quantize_seconds, quantized_model
from gptq import rows, run_and_report

AWQ_BACKENDS = (
    ("AWQ_TORCH", "float16"),
    ("AWQ_TORCH_FUSED", "float32"),
    ("AWQ_TORCH_ATEN", "bfloat16"),
    ("AWQ_TORCH_INT8", "float32"),
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated row-name prefixes to run")
    ap.add_argument("--autoawq", action="store_true", help="add AutoAWQ 0.2.9's own quantizer (slow on CPU: fp16)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    path = quantized_model("awq", bits=4, group_size=64, quantizer_backend="gptqmodel")
    native_path = quantized_model("awq", bits=4, group_size=64, quantizer_backend="anyquant", zero_point=True)
    autoawq_path = quantized_model("awq", bits=4, group_size=64, quantizer_backend="autoawq") if args.autoawq else None
    gptq_path = quantized_model("gptq", bits=4, group_size=64)
    dense = dense_model()
    ckpt = checkpoint_bytes(path)
    print(f"# AWQ 4-bit g64 (GEMM) SmolLM2-135M: {path}")
    print(
        f"# checkpoint {ckpt / 2**20:.0f} MiB; quantized once in {quantize_seconds(path) or 0:.0f} s (cached); "
        f"threads {args.threads}"
    )
    print(f"# machine: {machine()}")
    todo = rows("awq", str(path), str(dense), args.threads, AWQ_BACKENDS)
    gptq_row = (
        "GPTQ 4-bit g64, same calibration (anyquant auto)",
        {**dict(todo)["anyquant auto"], "path": str(gptq_path), "decode_tokens": 16},
    )
    native_row = (
        "AWQ 4-bit g64 zero-point by anyquant's own quantizer (anyquant auto)",
        {**dict(todo)["anyquant auto"], "path": str(native_path), "decode_tokens": 16},
    )
    todo += [gptq_row, native_row]
    autoawq_row = (
        "AWQ 4-bit g64 zero-point by AutoAWQ 0.2.9 (anyquant auto)",
        {**dict(todo)["anyquant auto"], "path": str(autoawq_path), "decode_tokens": 16},
    )
    if autoawq_path is not None:
        todo.append(autoawq_row)
    results = run_and_report(todo, ckpt, args.only)
    r = dict(results)
    awq, gptq = r.get("anyquant auto", {}), r.get(gptq_row[0], {})
    if "ppl" in awq and "ppl" in gptq:
        print(
            f"- AWQ vs GPTQ (4-bit, g64, same 32x256 calibration): ppl {awq['ppl']:.4f} vs {gptq['ppl']:.4f} "
            f"({(awq['ppl'] - gptq['ppl']) / gptq['ppl']:+.2%}); dense fp32 "
            f"{r.get('dense fp32 (transformers)', {}).get('ppl', float('nan')):.4f}"
        )
    native = r.get(native_row[0], {})
    if "ppl" in native and "ppl" in awq:
        print(
            f"- AWQ by anyquant's quantizer (zero point, quantized in {quantize_seconds(native_path) or 0:.0f} s) vs "
            f"GPTQModel's AWQ (same settings, {quantize_seconds(path) or 0:.0f} s): ppl {native['ppl']:.4f} vs {awq['ppl']:.4f}"
        )
    auto = r.get(autoawq_row[0], {})
    if "ppl" in auto and "ppl" in native:
        print(
            f"- AWQ by anyquant's quantizer vs AutoAWQ 0.2.9's own (same calibration, quantized in "
            f"{quantize_seconds(native_path) or 0:.0f} s vs {quantize_seconds(autoawq_path) or 0:.0f} s): "
            f"ppl {native['ppl']:.4f} vs {auto['ppl']:.4f}"
        )
    print(f"\n# wall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
