"""CPU speed against llama.cpp (issue #28): the same GGUF files through llama-cpp-python and anyquant.

Models:
- the bundled SmolLM2-135M-Instruct Q4_1 GGUF (``anyquant.default_model()``); a GPTQ 4-bit of the same model is
  added as an anyquant-only row (against llama.cpp on the Q4_1) with ``--gptq DIR``, or when bench/gptq.py's
  cached one exists; other checkpoints of SmolLM2 (an AWQ, an EXL3) likewise with ``--checkpoint LABEL=DIR``;
- a ~1.1B Llama-shaped GGUF with synthetic weights (hidden 2048, 22 layers of 32 heads / 4 KV heads, MLP 5632,
  SmolLM2's 49,152-token vocabulary; Q4_0 layers, tied Q8_0 embedding): written once under
  ``.cache/bench/llamacpp/`` by the ``gguf`` package's writer, streaming tensor by tensor, with its ``gguf.quants``
  quantizers (one random matrix per shape, quantized once; each layer gets its own row permutation of it), and
  the tokenizer metadata copied from SmolLM2's GGUF, so both engines load the same file and the same token ids;
- the same 1.1B model as llama.cpp's own quantizer makes it (``--models 1b-q4_k_m,1b-q6_k,1b-q8_0,1b-iq4_xs,1b-iq4_nl``;
  issue #42 §3): written once at F16 by the same writer from the same random floats (std 0.02, tied embedding), then
  quantized by ``llama_model_quantize`` (``LLAMA_FTYPE_MOSTLY_Q4_K_M`` / ``_Q6_K`` / ``_Q8_0`` / ``_IQ4_XS`` /
  ``_IQ4_NL``, default parameters, no importance matrix) in llama.cpp's Python, each file once: its Q4_K_M is Q4_K
  with Q6_K where it puts more bits (the tied embedding; attn_v and ffn_down in 10 of the 22 layers), as for real
  models; its Q6_K is all Q6_K, its Q8_0 all Q8_0, its IQ4_XS / IQ4_NL the table types wherever llama.cpp puts them.
  Those files need llama-cpp-python (below) to be made; the ~2.2 GB F16 source is deleted once all of them exist.

Rows (each sample a fresh process per engine, the engines alternating, ``--samples`` of each; per-row medians):
decode tokens/s (greedy, ``--decode`` tokens after a 32-token prompt, timed from the first new token on, end of
sequence ignored), prefill tokens/s (time to the first token of a 512-token prompt of held-out wiki text; for
anyquant's default runs it through a bfloat16 GEMM where the CPU has AMX or AVX512-BF16; the row is repeated with
``cpu_fast_prefill="float32"``, the exact weights in float32), with
``--long`` the peak RSS (``VmHWM``) and seconds of an 8,000-token prompt (slow), load seconds (``import torch`` and
``import llama_cpp`` excluded; anyquant's own import included), bytes of the file's weights a decode step reads
(every tensor, the embedding's one row; the whole embedding where it is the tied head) and the share of the bandwidth
bound that makes (bandwidth measured once with a torch copy at the same thread count). Each sample records the share
of the machine's CPU time other processes used while it ran (``/proc/stat`` minus the sample's own process);
samples above ``--max-other`` (5 %) are left out of the medians (a row whose every sample is above it keeps its
least-loaded one, flagged ``*``).

llama.cpp comes from llama-cpp-python in its own Python (``--llama-python PATH``; default: ``$LLAMA_PYTHON``, then
``/root/llvenv/bin/python``, then this Python if it imports ``llama_cpp``); without one the llama.cpp column is
skipped. Nothing is built here. The one-time build (~20-25 min on 2 cores), from the sdist so that the CPU
features are chosen, not a generic wheel's::

    python -m venv /root/llvenv && /root/llvenv/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_BUILD_EXAMPLES=OFF \\
      -DLLAMA_BUILD_TESTS=OFF" /root/llvenv/bin/pip wheel --no-deps llama_cpp_python-0.3.36.tar.gz
    /root/llvenv/bin/pip install llama_cpp_python-0.3.36-*.whl

llama.cpp runs with its extra CPU buffer types (``use_extra_bufts``: its repacked Q4_0 / Q8_0 / K-quant kernels,
which interleave 8 rows' blocks at load) where they run: on AMX hosts they segfault (ggml-org/llama.cpp#20824), so
the bench tries them once in a child process (``--llama-extra-bufts auto``, the default) and otherwise loads with
them off (llama.cpp's plain kernels); the header says which.

    python bench/llamacpp.py [--threads 2] [--samples 3] [--decode 64] [--long] [--max-other 0.05]
        [--models smollm2,1b,1b-q4_k_m,1b-q6_k,1b-q8_0,1b-iq4_xs,1b-iq4_nl] [--llama-python PATH] [--llama-extra-bufts auto|on|off]
        [--gptq DIR] [--checkpoint LABEL=DIR]
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
    _unshadow,
    bandwidth,
    compile_sources,
    cpu_times,
    llama_cpp_extra_bufts,
    llama_cpp_model,
    other_share,
    peak_rss_mib,
)

ROOT = CACHE / "llamacpp"
#: the >= 1B model: TinyLlama-1.1B's shape with SmolLM2's vocabulary
SHAPE = {"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "ffn": 5632, "context": 8192}
#: ``--models`` names of the llama.cpp-quantized 1.1B files: (llama.cpp's ftype, the row's label)
KQUANTS = {
    "1b-q4_k_m": ("Q4_K_M", "Llama-shaped 1.1B Q4_K_M GGUF (llama.cpp's quantizer, synthetic weights)"),
    "1b-q6_k": ("Q6_K", "Llama-shaped 1.1B Q6_K GGUF (llama.cpp's quantizer, synthetic weights)"),
    "1b-q8_0": ("Q8_0", "Llama-shaped 1.1B Q8_0 GGUF (llama.cpp's quantizer, synthetic weights)"),
    "1b-iq4_xs": ("IQ4_XS", "Llama-shaped 1.1B IQ4_XS GGUF (llama.cpp's quantizer, synthetic weights)"),
    "1b-iq4_nl": ("IQ4_NL", "Llama-shaped 1.1B IQ4_NL GGUF (llama.cpp's quantizer, synthetic weights)"),
}
PROMPT = 32
PREFILL = 512
LONG = 8000


# ---------------------------------------------------------------------- the synthetic >= 1B GGUF


def make_gguf(smol: Path, out: Path, f16: bool = False) -> Path:
    """The Llama-shaped Q4_0 GGUF (tied Q8_0 embedding), made once; peak memory ~0.5 GB (the embedding's floats are
    quantized in slices of 4,096 rows). With ``f16`` every matrix is stored in F16 instead (the same floats: the
    random draws are the same), the source for llama.cpp's quantizer (:func:`make_kquant`)."""
    if out.is_file():
        return out
    _unshadow()
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    reader = gguf.GGUFReader(smol)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    h, ffn, head_dim = SHAPE["hidden"], SHAPE["ffn"], SHAPE["hidden"] // SHAPE["heads"]
    kv = SHAPE["kv_heads"] * head_dim
    rng = np.random.default_rng(0)

    def quantized(rows: int, cols: int, qtype: Q) -> Any:
        parts = []
        for start in range(0, rows, 4096):
            w = rng.standard_normal((min(4096, rows - start), cols), dtype=np.float32) * 0.02
            parts.append(w.astype(np.float16) if f16 else quantize(w, qtype))
        return np.concatenate(parts)

    shapes = {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h)}
    shapes |= {"ffn_gate": (ffn, h), "ffn_up": (ffn, h), "ffn_down": (h, ffn)}
    base = {name: quantized(r, c, Q.Q4_0) for name, (r, c) in shapes.items()}
    norm = np.ones(h, dtype=np.float32)
    plan: list[tuple[str, Any]] = [("token_embd.weight", lambda: quantized(vocab, h, Q.Q8_0))]
    for i in range(SHAPE["layers"]):
        plan.append((f"blk.{i}.attn_norm.weight", lambda: norm))
        for name in shapes:
            plan.append((f"blk.{i}.{name}.weight", lambda name=name: base[name][rng.permutation(len(base[name]))]))
        plan.append((f"blk.{i}.ffn_norm.weight", lambda: norm))
    plan.append(("output_norm.weight", lambda: norm))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name("synthetic Llama 1.1B (bench/llamacpp.py)")
    writer.add_context_length(SHAPE["context"])
    writer.add_embedding_length(h)
    writer.add_block_count(SHAPE["layers"])
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(SHAPE["heads"])
    writer.add_head_count_kv(SHAPE["kv_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for name, _ in plan:
        if name.endswith("norm.weight"):
            writer.add_tensor_info(name, (h,), np.dtype(np.float32), h * 4)
        else:
            short = name.rsplit(".", 2)[-2]
            rows, cols = (vocab, h) if short == "token_embd" else shapes[short]
            if f16:
                writer.add_tensor_info(name, (rows, cols), np.dtype(np.float16), rows * cols * 2)
                continue
            qtype = Q.Q8_0 if short == "token_embd" else Q.Q4_0
            size, block = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (rows, cols // size * block)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), rows * byte_shape[1], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, make in plan:
        writer.write_tensor_data(make())
    writer.close()
    tmp.rename(out)
    return out


_QUANTIZE = """
import ctypes, sys
import llama_cpp
src, dst, ftype = sys.argv[1:4]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))
"""


def make_kquant(smol: Path, ftype: str, llama_python: str) -> Path:
    """The 1.1B model as llama.cpp's quantizer makes it at ``ftype`` (:data:`KQUANTS`: ``Q4_K_M``, ``IQ4_XS``, ...), made once:
    ``llama_model_quantize`` with its default parameters, run in llama.cpp's Python, from the F16 GGUF
    (:func:`make_gguf`, made first if need be; deleted once every file of :data:`KQUANTS` exists)."""
    out = ROOT / f"llama-1.1b-synthetic.{ftype}.gguf"
    if out.is_file():
        return out
    src = make_gguf(smol, ROOT / "llama-1.1b-synthetic.F16.gguf", f16=True)
    tmp = out.with_suffix(".tmp")
    proc = subprocess.run(
        [llama_python, "-c", _QUANTIZE, str(src), str(tmp), ftype], capture_output=True, text=True, env=os.environ
    )
    if proc.returncode or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = " ".join((proc.stderr or proc.stdout).split())[-300:]
        raise SystemExit(f"llama.cpp's quantizer ({ftype}) failed (exit status {proc.returncode}): {tail}")
    tmp.rename(out)
    if all((ROOT / f"llama-1.1b-synthetic.{f}.gguf").is_file() for f, _ in KQUANTS.values()):
        src.unlink()
    return out


def decode_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the file's tensors, bytes one decode step reads: every tensor, one embedding row unless the
    embedding is also the head)."""
    _unshadow()
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    total = sum(tensors.values())
    embd = tensors.get("token_embd.weight", 0)
    if "output.weight" in tensors and embd:
        rows = next(int(t.shape[-1]) for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
        return total, total - embd + embd // rows
    return total, total


def prompt_ids(smol: Path) -> Path:
    """Held-out wiki text as SmolLM2 token ids (both models share the vocabulary), cached as JSON."""
    out = ROOT / "prompt.json"
    if not out.is_file():
        _unshadow()
        from _measure import corpus_text

        import anyquant

        tok = anyquant.load(smol).tokenizer
        text = corpus_text("wiki", "evaluation")[:80000]
        ids = tok(text)["input_ids"]
        while len(ids) < LONG + PROMPT:
            ids = ids + ids
        ROOT.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(ids))
    return out


# ---------------------------------------------------------------------- one sample, in a fresh process


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    ids: list[int] = json.loads(Path(cfg["ids"]).read_text())
    threads = cfg["threads"]
    long = bool(cfg.get("long"))
    if cfg["engine"] == "llama.cpp":
        import llama_cpp  # noqa: F401  (its import is not timed: as torch's is not for anyquant)

        before = cpu_times()
        t0 = time.perf_counter()
        llm = llama_cpp_model(
            cfg["path"],
            extra_bufts=bool(cfg.get("extra_bufts")),
            n_ctx=LONG + 64 if long else 1024,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
        )
        load_s = time.perf_counter() - t0
        backend = ""

        def steps(prompt: list[int], n: int) -> Any:
            llm.reset()
            for i, token in enumerate(llm.generate(prompt, temp=0.0, top_k=1)):
                yield int(token)
                if i + 1 == n:
                    return

    else:
        _unshadow()
        import torch

        torch.set_num_threads(threads)
        before = cpu_times()
        t0 = time.perf_counter()
        import anyquant

        m = anyquant.load(cfg["path"], backend=cfg.get("backend", "auto"))
        load_s = time.perf_counter() - t0
        backend = m.backend

        def steps(prompt: list[int], n: int, model: Any = m) -> Any:
            for (token,) in model.generator.token_steps([prompt], model.params(max_new_tokens=n), ends=()):
                yield int(token)

    def first_and_rest(prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        """(seconds to the first token, seconds for the n - 1 after it, tokens)."""
        t1 = time.perf_counter()
        got: list[int] = []
        t_first = t1
        for token in steps(prompt, n):
            got.append(token)
            if len(got) == 1:
                t_first = time.perf_counter()
        return t_first - t1, time.perf_counter() - t_first, got

    result: dict[str, Any] = {"load_s": load_s, "backend": backend}
    if long:
        first, _, _ = first_and_rest(ids[:LONG], 1)
        result |= {"long_s": first, "long_rss_mib": peak_rss_mib()}
    else:
        first_and_rest(ids[:16], 4)  # warm-up
        first, _, _ = first_and_rest(ids[:PREFILL], 1)
        _, rest, tokens = first_and_rest(ids[:PROMPT], cfg["decode"] + 1)
        result |= {"prefill_tok_s": PREFILL / first, "decode_tok_s": (len(tokens) - 1) / rest, "tokens": tokens[:16]}
        if cfg["engine"] == "anyquant":  # the same prompt with the option that keeps prompts exact (float32)
            exact = anyquant.load(cfg["path"], backend=cfg.get("backend", "auto"), cpu_fast_prefill="float32")
            for _ in steps(ids[:96], 1, exact):  # warm-up past the few-rows path
                pass
            t1 = time.perf_counter()
            for _ in steps(ids[:PREFILL], 1, exact):
                pass
            result["prefill_exact_tok_s"] = PREFILL / (time.perf_counter() - t1)
    result["other_cpu"] = other_share(before, cpu_times())
    return result


def measure(cfg: dict[str, Any], python: str) -> dict[str, Any]:
    proc = subprocess.run(
        [python, __file__, "--child"],
        input=json.dumps(cfg),
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        timeout=1800,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": " ".join((proc.stderr or proc.stdout).split())[-300:] or f"exit status {proc.returncode}"}
    return dict(json.loads(lines[-1]))


# ---------------------------------------------------------------------- the table


def find_llama_python(given: str | None) -> str | None:
    for candidate in (given, os.environ.get("LLAMA_PYTHON"), "/root/llvenv/bin/python", sys.executable):
        if not candidate or not Path(candidate).is_file():
            continue
        ok = subprocess.run([candidate, "-c", "import llama_cpp"], capture_output=True).returncode == 0
        if ok:
            return candidate
        if candidate == given:
            raise SystemExit(f"--llama-python {given}: this Python cannot import llama_cpp")
    return None


def median_of(samples: list[dict[str, Any]], key: str, max_other: float) -> tuple[float | None, float, bool]:
    """(median of ``key`` over the samples at or under ``max_other``, the highest other-CPU share among those used,
    whether every sample was over it: then the least loaded one alone)."""
    good = [s for s in samples if "error" not in s and key in s]
    if not good:
        return None, 0.0, False
    kept = [s for s in good if s["other_cpu"] <= max_other]
    flagged = not kept
    if flagged:
        kept = [min(good, key=lambda s: s["other_cpu"])]
    return float(statistics.median(s[key] for s in kept)), max(s["other_cpu"] for s in kept), flagged


def cell(samples: list[dict[str, Any]] | None, key: str, fmt: str, max_other: float) -> tuple[str, float | None, float]:
    """(the table's text, the median, the other-CPU share) of one engine's samples for one row."""
    if samples is None:
        return "-", None, 0.0
    value, other, flagged = median_of(samples, key, max_other)
    if value is None:
        err = next((s["error"] for s in samples if "error" in s), "no sample")
        return f"error: {err[-120:].replace('|', '/')}", None, 0.0
    return fmt.format(value) + ("*" if flagged else ""), value, other


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--samples", type=int, default=3, help="fresh processes per engine and row")
    ap.add_argument("--decode", type=int, default=64, help="greedy tokens per decode sample")
    ap.add_argument(
        "--long",
        action="store_true",
        help="also the 8,000-token prompt's peak RSS and seconds (slow; half as many samples, at least one)",
    )
    ap.add_argument("--max-other", type=float, default=0.05, help="discard samples where other processes used more")
    ap.add_argument(
        "--models",
        default="smollm2,1b",
        help="comma-separated: smollm2, 1b (the synthetic 1.1B at Q4_0), 1b-q4_k_m, 1b-q6_k, 1b-q8_0, 1b-iq4_xs, "
        "1b-iq4_nl (the same "
        "model through llama.cpp's quantizer; made once, needs llama-cpp-python)",
    )
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python")
    ap.add_argument(
        "--llama-extra-bufts",
        choices=("auto", "on", "off"),
        default="auto",
        help="llama.cpp's extra CPU buffer types (repacked kernels): auto = on where a trial load runs",
    )
    ap.add_argument("--gptq", type=Path, help="a GPTQ 4-bit of SmolLM2-135M (anyquant row against the Q4_1)")
    ap.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="another checkpoint of SmolLM2-135M (an AWQ, an EXL3): an anyquant row against the Q4_1 (repeatable)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(sys.stdin.read()))))
        return 0
    if unknown := {m.strip() for m in args.models.split(",")} - {"smollm2", "1b", *KQUANTS}:
        ap.error(f"--models: unknown {', '.join(sorted(unknown))}")

    _unshadow()
    import anyquant

    compile_sources()  # the loads time modules read, as installed, not compiled from source
    t_start = time.perf_counter()
    smol = Path(anyquant.default_model())
    llama_python = find_llama_python(args.llama_python)
    if llama_python is None:
        print("# llama.cpp column skipped: no Python with llama-cpp-python (--llama-python PATH; see the docstring)")
    extra_bufts = args.llama_extra_bufts == "on"
    if llama_python is not None:
        if args.llama_extra_bufts == "auto":
            extra_bufts = llama_cpp_extra_bufts(llama_python, smol)
        print(
            "# llama.cpp: extra CPU buffer types "
            + ("on (its repacked kernels)" if extra_bufts else "off (its plain kernels; --llama-extra-bufts)")
        )
    ids = prompt_ids(smol)
    wanted = {m.strip() for m in args.models.split(",")}
    models: list[tuple[str, Path, Path | None]] = []  # (label, llama.cpp's file, anyquant's path when another)
    if "smollm2" in wanted:
        models.append(("SmolLM2-135M Q4_1 GGUF", smol, None))
        gptq = args.gptq or next(iter(sorted(CACHE.glob("smollm2-135m-gptq-b4-g64-*"))), None)
        if gptq is not None and (gptq / "config.json").is_file():
            models.append(("SmolLM2-135M GPTQ 4-bit g64 (llama.cpp: the Q4_1)", smol, gptq))
        for spec in args.checkpoint:
            label, _, folder = spec.rpartition("=")
            if not folder:
                ap.error(f"--checkpoint {spec!r}: expected LABEL=DIR")
            models.append((f"SmolLM2-135M {label} (llama.cpp: the Q4_1)", smol, Path(folder)))
    if "1b" in wanted:
        t0 = time.perf_counter()
        big = make_gguf(smol, ROOT / "llama-1.1b-synthetic.Q4_0.gguf")
        print(f"# 1B GGUF: {big} ({big.stat().st_size / 1e6:.0f} MB; {time.perf_counter() - t0:.0f} s to make or find)")
        models.append(("Llama-shaped 1.1B Q4_0 GGUF (synthetic weights)", big, None))
    for name, (ftype, label) in KQUANTS.items():
        if name not in wanted:
            continue
        if llama_python is None:
            print(f"# {name} skipped: llama.cpp's quantizer makes it (--llama-python PATH; see the docstring)")
            continue
        t0 = time.perf_counter()
        path = make_kquant(smol, ftype, llama_python)
        took = time.perf_counter() - t0
        print(f"# {name}: {path} ({path.stat().st_size / 1e6:.0f} MB; {took:.0f} s to make or find)", flush=True)
        models.append((label, path, None))
    before = cpu_times()
    bw = bandwidth(args.threads)
    bw_other = other_share(before, cpu_times())
    load = os.getloadavg()
    print(
        f"# {args.threads} threads; bandwidth {bw / 1e9:.1f} GB/s (torch copy, other CPU {bw_other:.0%}); "
        f"load average {load[0]:.2f}; samples {args.samples}, other-CPU limit {args.max_other:.0%}",
        flush=True,
    )

    kinds = [{}] + ([{"long": True}] if args.long else [])
    table: list[str] = [
        "| model | row | llama.cpp | anyquant | anyquant / llama.cpp | other CPU (max of used samples) |",
        "|---|---|---|---|---|---|",
    ]
    bound_rows: list[tuple[int, int, int, dict[str, float | None]]] = []
    for label, file, own in models:
        common = {"threads": args.threads, "decode": args.decode, "ids": str(ids)}
        engines = [("anyquant", {**common, "engine": "anyquant", "path": str(own or file)}, sys.executable)]
        if llama_python:
            ll_cfg = {**common, "engine": "llama.cpp", "path": str(file), "extra_bufts": extra_bufts}
            engines.insert(0, ("llama.cpp", ll_cfg, llama_python))
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in engines}
        for extra in kinds:
            for i in range(args.samples if not extra else max(1, args.samples // 2)):
                for name, cfg, python in engines if i % 2 == 0 else engines[::-1]:
                    r = measure({**cfg, **extra}, python)
                    brief = r.get("error") or {k: round(v, 3) for k, v in r.items() if isinstance(v, float)}
                    print(f"# {label} / {name} {extra or ''} sample {i + 1}: {brief}", file=sys.stderr, flush=True)
                    samples[name].append(r)
        backend = next((s["backend"] for s in samples["anyquant"] if s.get("backend")), "")
        total, per_token = decode_bytes(file) if own is None else (0, 0)

        rows = [
            ("decode tok/s", "decode_tok_s", "{:.1f}", True),
            (f"prefill {PREFILL} tok/s", "prefill_tok_s", "{:.0f}", True),
            (
                f"prefill {PREFILL} tok/s, `cpu_fast_prefill='float32'` (exact prompts; llama.cpp: as above)",
                "prefill_exact_tok_s",
                "{:.0f}",
                True,
            ),
            ("load s (after import torch / llama_cpp)", "load_s", "{:.2f}", False),
        ]
        if args.long:
            rows += [
                (f"{LONG}-token prompt: peak RSS MiB", "long_rss_mib", "{:.0f}", False),
                (f"{LONG}-token prompt: s", "long_s", "{:.1f}", False),
            ]
        decode: dict[str, float | None] = {}
        for title, key, fmt, higher in rows:
            lt, lv, lo = cell(samples.get("llama.cpp"), key.replace("_exact", ""), fmt, args.max_other)
            at, av, ao = cell(samples["anyquant"], key, fmt, args.max_other)
            if key == "decode_tok_s":
                decode = {"llama.cpp": lv, "anyquant": av}
            ratio = f"{av / lv:.2f}x" if av and lv else "-"
            note = "" if higher else " (lower is better)"
            first = f" {label}, anyquant `{backend}` " if key == "decode_tok_s" else " "
            table.append(f"|{first}| {title}{note} | {lt} | {at} | {ratio} | {max(lo, ao):.1%} |")
        if per_token:
            bound_rows.append((len(table), per_token, total, decode))
            table.append("")  # filled once the bandwidth is measured again
        ll = next((s["tokens"] for s in samples.get("llama.cpp", []) if s.get("tokens")), None)
        aq = next((s["tokens"] for s in samples["anyquant"] if s.get("tokens")), None)
        if ll and aq and own is None:
            agree = 0
            while agree < min(len(ll), len(aq)) and ll[agree] == aq[agree]:
                agree += 1
            table.append(f"| | greedy tokens the same as llama.cpp's (of the first 16) | {agree} | | | |")
    before = cpu_times()
    again = bandwidth(args.threads)  # once more after the samples: the bound is the better of the two
    if again > bw:
        bw, bw_other = again, other_share(before, cpu_times())
    for at, per_token, total, decode in bound_rows:
        shares = [f"{v * per_token / bw:.0%}" if v else "-" for v in (decode.get("llama.cpp"), decode.get("anyquant"))]
        table[at] = (
            f"| | decode: file bytes read per token {per_token / 1e6:.0f} MB (of {total / 1e6:.0f} MB), "
            f"% of the {bw / 1e9:.1f} GB/s bound | {shares[0]} | {shares[1]} | | |"
        )
    print(f"\n# bandwidth bound {bw / 1e9:.1f} GB/s (the better of two copies; other CPU {bw_other:.0%} in it)\n")
    print("\n".join(table))
    print(f"\n# {time.perf_counter() - t_start:.0f} s in all; load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
