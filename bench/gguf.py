"""GGUF: anyquant vs transformers' gguf loading, on the bundled SmolLM2-135M-Instruct Q4_1.

Each row runs in a fresh process: load time, RSS right after loading (above the runtime's RSS
once torch/transformers/the plugin are imported) and peak RSS over the whole run, prefill
tokens/s (512 held-out wiki tokens, best of 2), decode tokens/s (64 greedy tokens after a 32-token
prompt, best of 2), perplexity on 2,048 held-out wiki tokens (512-token windows).

Rows: transformers' ``from_pretrained(gguf_file=)`` (dequantizes every tensor to dense fp32),
anyquant ``auto`` (what ``anyquant.load`` picks here: ``cpu-fast`` where torch's int4 kernel runs,
the Q4_1 linears repacked for it: bfloat16 decode, exact fp32 prompts over 64 tokens; the Q8_0
embedding and the tied head packed), ``cpu-fast`` with ``embedding="dense"`` (a dense fp32
embedding + tied head), ``dequantized`` (the exact choice: the same dense fp32 weights as
transformers', file pages released after load), ``packed`` (Q4_1 linears, the Q8_0 embedding and
the tied head stay packed, file-backed, dequantized on every forward) and ``packed`` with
``embedding="dense"``.

Goal (issue #5): faster load and at most half the peak memory of transformers' path, no slower
decode.

    python bench/gguf.py [--threads 2] [--only PREFIX,...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from _measure import machine, markdown_table, run_rows

BASELINE = "transformers gguf (fp32)"


def rows(path: str, threads: int) -> list[tuple[str, dict[str, Any]]]:
    common = {
        "path": path,
        "threads": threads,
        "text": "wiki",
        "text_part": "evaluation",
        "prefill_tokens": 512,
        "ppl_tokens": 2048,
        "decode_tokens": 64,
        "repeat": 2,
        "decode_repeat": 2,
    }
    return [
        (BASELINE, {"kind": "transformers-gguf", **common}),
        ("anyquant auto", {"kind": "anyquant", "backend": "auto", **common}),
        (
            "anyquant cpu-fast, dense embedding",
            {"kind": "anyquant", "backend": "cpu-fast", "options": {"embedding": "dense"}, **common},
        ),
        ("anyquant dequantized", {"kind": "anyquant", "backend": "dequantized", **common}),
        ("anyquant packed", {"kind": "anyquant", "backend": "packed", **common}),
        (
            "anyquant packed, dense embedding",
            {"kind": "anyquant", "backend": "packed", "options": {"embedding": "dense"}, **common},
        ),
    ]


def goals(results: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The issue's goals for each anyquant row, with its numbers and met / NOT met."""
    base = dict(results).get(BASELINE, {})
    if not base or "error" in base:
        return [f"{BASELINE} failed: {base.get('error', 'missing')}"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = []
    for name, r in results:
        if name == BASELINE or "error" in r:
            continue
        load = r["load_s"] / base["load_s"]
        peak = r["peak_rss_mib"] / base["peak_rss_mib"]
        peak_above = (r["peak_rss_mib"] - r["base_rss_mib"]) / (base["peak_rss_mib"] - base["base_rss_mib"])
        above = (r["load_rss_mib"] - r["base_rss_mib"]) / (base["load_rss_mib"] - base["base_rss_mib"])
        decode = r["decode_tok_s"] / base["decode_tok_s"]
        ran = f" [{r['backend']}]" if r.get("backend") and r["backend"] not in name else ""
        lines.append(
            f"{name}{ran}: load {load:.2f}x ({verdict(load < 1)}); peak RSS above the shared runtime "
            f"{peak_above:.2f}x ({verdict(peak_above <= 0.5)}; whole process {peak:.2f}x, end of load {above:.2f}x); "
            f"decode {decode:.2f}x ({verdict(decode >= 1)}); ppl {r.get('ppl', float('nan')):.4f} "
            f"vs {base.get('ppl', float('nan')):.4f}"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated row-name prefixes to run (plus the baseline)")
    args = ap.parse_args()
    import anyquant

    path = Path(anyquant.default_model())
    ckpt = path.stat().st_size
    print(f"# {path.name}: {ckpt / 2**20:.0f} MiB; threads {args.threads}")
    print(f"# machine: {machine()}")
    todo = rows(str(path), args.threads)
    if args.only:
        prefixes = (BASELINE, *(p.strip() for p in args.only.split(",")))
        todo = [(n, c) for n, c in todo if n.startswith(prefixes)]
    t0 = time.perf_counter()
    results = run_rows(todo)
    print(markdown_table(results, ckpt, BASELINE))
    print()
    for line in goals(results):
        print(f"- {line}")
    print(f"# {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
