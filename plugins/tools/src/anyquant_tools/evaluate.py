"""``anyquant eval`` and ``anyquant compare``: perplexity, memory, speed and load time per checkpoint.

- Perplexity: the text is tokenised once (no special tokens) and cut into fixed, non-overlapping
  windows of ``window`` tokens; each window is scored on its own (no carried context) and every
  token but the window's first is predicted. ``exp(sum of NLL / predicted tokens)``. A trailing
  partial window is dropped so every window has the same length; the result states the window,
  the tokens used and the tokens dropped.
- Memory: peak RSS (``VmHWM`` from ``/proc/self/status``, reset through ``/proc/self/clear_refs``
  before each load) on CPU; ``torch.cuda.max_memory_allocated`` on CUDA.
- Speed: prefill tokens/s of one forward pass over ``prefill_tokens`` tokens (after a warm-up);
  decode tokens/s from two greedy runs of the model's generator (1 and ``decode_tokens`` new
  tokens), so the prompt's cost cancels out.

torch and matplotlib are imported inside the functions that need them.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import numbers
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from anyquant._memory import release_free_heap
from anyquant.errors import AnyquantError
from anyquant.probe import display_name
from anyquant.protocols import LoadedModel
from anyquant.registry import Registry  # torch-free: imported so that typing.get_type_hints resolves the public API

__all__ = [
    "EvalResult",
    "EvaluationError",
    "compare",
    "evaluate",
    "perplexity",
    "plot",
    "to_markdown",
]

log = logging.getLogger(__name__)

DEFAULT_TEXT = "wiki"
DEFAULT_WINDOW = 512
DEFAULT_MAX_TOKENS = 4096
DEFAULT_PREFILL = 512
DEFAULT_DECODE = 32
DECODE_PROMPT = 16


class EvaluationError(AnyquantError):
    """An evaluation could not be run as asked (text too short, no tokenizer...)."""


@dataclass
class EvalResult:
    """One checkpoint's evaluation. ``to_dict()`` is JSON-ready."""

    path: str
    label: str
    format: str
    variant: str | None
    backend: str
    device: str
    dtype: str
    text: str
    window: int
    tokens: int  # tokens scored (windows * window)
    predicted_tokens: int
    windows: int
    tokens_available: int  # tokens in the whole text
    tokens_dropped: int  # read (up to max_tokens) but not scored: the trailing partial window
    perplexity: float
    load_s: float
    peak_memory_bytes: int | None
    memory_delta_bytes: int | None  # peak minus the process's RSS / allocation before the load
    memory_kind: str  # "rss" or "cuda_max_allocated"
    prefill_tokens: int
    prefill_tok_s: float | None
    decode_tokens: int
    decode_tok_s: float | None
    bits_per_weight: float | None = None
    bytes_on_disk: int | None = None
    parameters: int | None = None
    tokenizer_fingerprint: str | None = None
    rounds: int = 1
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------- perplexity


def _token_ids(model: LoadedModel, text_or_token_ids: str | Sequence[int] | Any) -> list[int]:
    if isinstance(text_or_token_ids, str):
        if model.tokenizer is None:
            raise EvaluationError("this model has no tokenizer: pass token ids instead of text")
        from anyquant_runtime.tokenizer import encode_text

        return encode_text(model.tokenizer, text_or_token_ids, add_special_tokens=False)
    tolist = getattr(text_or_token_ids, "tolist", None)
    ids = tolist() if callable(tolist) else list(text_or_token_ids)
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise EvaluationError("pass one sequence of token ids, not a batch")
        ids = ids[0]
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        raise EvaluationError("token ids must be integers (a float id would be truncated)")
    return [int(i) for i in ids]


def _config_int(model: LoadedModel, key: str) -> int | None:
    cfg = getattr(model.module, "config", None)
    value = getattr(cfg, key, None) if cfg is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _vocab_size(model: LoadedModel) -> int | None:
    return _config_int(model, "vocab_size")


def _context(model: LoadedModel) -> int | None:
    from anyquant_runtime.generate import context_length

    return context_length(model.module)


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _windows_nll(model: LoadedModel, windows: list[list[int]], batch_size: int) -> float:
    import torch
    import torch.nn.functional as F

    total = 0.0
    with torch.inference_mode():
        for start in range(0, len(windows), batch_size):
            x = torch.tensor(windows[start : start + batch_size], dtype=torch.long, device=model.device)
            logits = model.module(x).logits.float()
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += float(nll)
    return total


def perplexity(
    model: LoadedModel,
    text_or_token_ids: str | Sequence[int] | Any,
    *,
    window: int = DEFAULT_WINDOW,
    max_tokens: int | None = None,
    batch_size: int = 1,
) -> dict[str, Any]:
    """Perplexity over fixed non-overlapping windows of ``window`` tokens.

    ``max_tokens`` caps the tokens read from the text (before windowing). Returns ``perplexity``,
    ``nll_sum``, ``mean_nll``, ``window``, ``windows``, ``tokens`` (scored), ``predicted_tokens``,
    ``tokens_available`` (in the text), ``tokens_read`` (after ``max_tokens``) and
    ``tokens_dropped`` (read but not scored: the trailing partial window).
    """
    _check_counts(max_tokens=max_tokens, batch_size=batch_size, window=window)
    if window < 2:
        raise EvaluationError(f"window must be at least 2 tokens, got {window}")
    context = _context(model)
    if context is not None and window > context:
        raise EvaluationError(
            f"window={window} is longer than this model's context ({context} tokens, max_position_embeddings): "
            "positions past it are not what the model was made for; pass a smaller window"
        )
    ids = _token_ids(model, text_or_token_ids)
    vocab = _vocab_size(model)
    bad = next((i for i in ids if not 0 <= i < (vocab if vocab is not None else 2**63)), None)
    if bad is not None:
        raise EvaluationError(f"token id {bad} is not in this model's vocabulary (0 .. {vocab - 1 if vocab else '?'})")
    available = len(ids)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n_windows = len(ids) // window
    if n_windows == 0:
        raise EvaluationError(
            f"the text has {len(ids)} tokens (of {available}, max_tokens={max_tokens}), fewer than one "
            f"{window}-token window: pass a longer text or a smaller window"
        )
    windows = [ids[i * window : (i + 1) * window] for i in range(n_windows)]
    nll = _windows_nll(model, windows, batch_size)
    predicted = n_windows * (window - 1)
    return {
        "perplexity": math.exp(nll / predicted) if nll / predicted < 709 else math.inf,  # exp overflows past ~709
        "nll_sum": nll,
        "mean_nll": nll / predicted,
        "window": window,
        "windows": n_windows,
        "tokens": n_windows * window,
        "predicted_tokens": predicted,
        "tokens_available": available,
        "tokens_read": len(ids),
        "tokens_dropped": len(ids) - n_windows * window,
    }


# ---------------------------------------------------------------------- memory


def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _release_memory() -> None:
    gc.collect()
    release_free_heap()


class _MemoryMeter:
    """Peak memory across one model's evaluation: RSS high-water mark on CPU, allocator peak on CUDA."""

    def __init__(self, device: str) -> None:
        self.cuda = str(device).startswith("cuda")
        self.kind = "cuda_max_allocated" if self.cuda else "rss"
        self.notes: list[str] = []
        self.baseline = self._current()
        self._reset_peak()

    def _current(self) -> int | None:
        if self.cuda:
            import torch

            return int(torch.cuda.memory_allocated())
        kib = _proc_status_kib("VmRSS")
        return kib * 1024 if kib is not None else None

    def _reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")  # resets VmHWM to the current RSS
        except OSError:
            self.notes.append("peak RSS could not be reset: it is the process's lifetime peak")

    def peak(self) -> int | None:
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated())
        kib = _proc_status_kib("VmHWM")
        if kib is None:  # not Linux: ru_maxrss is KiB on Linux, bytes on macOS
            scale = 1 if sys.platform == "darwin" else 1024
            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
        return kib * 1024

    def delta(self) -> int | None:
        peak = self.peak()
        return peak - self.baseline if peak is not None and self.baseline is not None else None


# ---------------------------------------------------------------------- speed


def _prefill_tok_s(model: LoadedModel, ids: list[int]) -> float | None:
    import torch

    if len(ids) < 2:
        return None
    x = torch.tensor([ids], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model.module(x[:, : min(16, len(ids))])  # warm-up
        _sync(model.device)
        t0 = time.perf_counter()
        model.module(x)
        _sync(model.device)
        elapsed = time.perf_counter() - t0
    return len(ids) / elapsed if elapsed > 0 else None


def _decode_tok_s(model: LoadedModel, prompt: list[int], n_new: int, notes: list[str]) -> float | None:
    generate_ids = getattr(model.generator, "generate_ids", None)
    if n_new < 2:
        return None
    if not callable(generate_ids):
        notes.append("decode speed not measured: the model's generator has no generate_ids")
        return None

    def timed(n: int) -> tuple[int, float]:
        _sync(model.device)
        t0 = time.perf_counter()
        out = generate_ids(prompt, model.params(max_new_tokens=n, temperature=0.0))
        _sync(model.device)
        return len(out), time.perf_counter() - t0

    timed(2)  # warm-up
    _, t_one = timed(1)
    produced, t_all = timed(n_new)
    if produced < n_new:
        notes.append(f"decode stopped at end-of-sequence after {produced} of {n_new} tokens")
    if produced < 2 or t_all <= t_one:
        return None
    return (produced - 1) / (t_all - t_one)


# ---------------------------------------------------------------------- evaluate / compare


def _text_and_name(text: str) -> tuple[str, str]:
    """A corpus name (its held-out evaluation part), a file path, or ``hf:`` spec -> (text, name)."""
    from .calibration import evaluation_text

    return evaluation_text(text), text


def _static_info(path: str | Path, registry: Registry | None) -> dict[str, Any]:
    from anyquant.api import inspect

    try:
        totals = inspect(path, registry=registry).totals
    except AnyquantError as exc:
        log.info("no header report for %s: %s", path, exc)
        return {}
    bits = totals.get("avg_bits_quantized") or totals.get("avg_bits_all")
    return {
        "bits_per_weight": bits,
        "bytes_on_disk": totals.get("bytes_on_disk"),
        "parameters": totals.get("parameters"),
    }


def _fingerprint(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]


@dataclass
class _Run:
    """One load of one checkpoint: load time, memory meter, the loaded model."""

    model: LoadedModel
    load_s: float
    meter: _MemoryMeter


def _open(path: str | Path, load_kwargs: dict[str, Any]) -> _Run:
    from anyquant.api import load

    _release_memory()
    meter = _MemoryMeter(_expected_device(str(load_kwargs.get("device", "auto"))))
    t0 = time.perf_counter()
    model = load(path, **load_kwargs)
    load_s = time.perf_counter() - t0
    if str(model.device).startswith("cuda") != meter.cuda:
        meter.notes.append(f"the load chose {model.device}: memory measured as {meter.kind}")
    return _Run(model, load_s, meter)


def _expected_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _speeds(
    run: _Run, ids: list[int], prefill_tokens: int, decode_tokens: int, notes: list[str]
) -> tuple[float | None, float | None]:
    prefill = _prefill_tok_s(run.model, ids[:prefill_tokens])
    decode = _decode_tok_s(run.model, ids[:DECODE_PROMPT], decode_tokens, notes)
    return prefill, decode


def _mean(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else None


def _check_counts(**counts: int | None) -> None:
    """Counts are positive integers (``max_tokens`` may be None: all); ``-5`` used to slice ``ids[:-5]``
    (the whole corpus) and ``rounds=0`` ran one round, in silence."""
    for name, value in counts.items():
        if value is None and name == "max_tokens":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise EvaluationError(f"{name} must be a positive integer, got {value!r}")


def _evaluate_rounds(
    paths: Sequence[str | Path],
    *,
    text: str,
    window: int,
    max_tokens: int | None,
    prefill_tokens: int,
    decode_tokens: int,
    rounds: int,
    labels: Sequence[str] | None,
    registry: Registry | None,
    load_kwargs: dict[str, Any],
    progress: Callable[[str, float], None] | None = None,
) -> list[EvalResult]:
    _check_counts(max_tokens=max_tokens, prefill_tokens=prefill_tokens, decode_tokens=decode_tokens, rounds=rounds)
    body, text_name = _text_and_name(text)
    partial: dict[int, dict[str, Any]] = {}
    visits, done = max(1, rounds) * len(paths), 0
    for r in range(max(1, rounds)):
        order = range(len(paths)) if r % 2 == 0 else reversed(range(len(paths)))
        for i in order:
            if progress is not None:
                name = labels[i] if labels else display_name(paths[i])
                progress(f"{name} (round {r + 1})", done / visits)
            _one_visit(i, r, paths[i], body, partial, window, max_tokens, prefill_tokens, decode_tokens, load_kwargs)
            done += 1
    if progress is not None:
        progress("done", 1.0)
    results = []
    for i, path in enumerate(paths):
        p = partial[i]
        label = labels[i] if labels else display_name(path)
        results.append(
            EvalResult(
                path=str(path),
                label=label,
                text=text_name,
                # load time and memory: the least over the rounds. The process's first load also pays one-time
                # costs (imports), which went to whichever checkpoint was listed first.
                load_s=min(p["load_s"], default=0.0),
                peak_memory_bytes=min((v for v in p["peak"] if v is not None), default=None),
                memory_delta_bytes=min((v for v in p["delta"] if v is not None), default=None),
                prefill_tok_s=_mean(p["prefill"]),
                decode_tok_s=_mean(p["decode"]),
                prefill_tokens=min(prefill_tokens, p["ppl"]["tokens_available"]),
                decode_tokens=decode_tokens,
                rounds=max(1, rounds),
                notes=sorted({n for n in p["notes"] if n}),
                **p["static"],
                **_static_info(path, registry),
            )
        )
    _note_tokenizer_mismatch(results)
    return results


def _one_visit(
    i: int,
    r: int,
    path: str | Path,
    body: str,
    partial: dict[int, dict[str, Any]],
    window: int,
    max_tokens: int | None,
    prefill_tokens: int,
    decode_tokens: int,
    load_kwargs: dict[str, Any],
) -> None:
    log.info("evaluating %s (round %d)", path, r + 1)
    run = _open(path, load_kwargs)
    p = partial.setdefault(i, {"load_s": [], "peak": [], "delta": [], "prefill": [], "decode": [], "notes": []})
    p["load_s"].append(run.load_s)
    ids = _token_ids(run.model, body)
    if r == 0:
        ppl = perplexity(run.model, ids, window=window, max_tokens=max_tokens)
        p["ppl"] = ppl
        p["static"] = {
            "format": run.model.format,
            "variant": run.model.detection.variant,
            "backend": run.model.backend,
            "device": str(run.model.device),
            "dtype": str(run.model.dtype),
            "window": ppl["window"],
            "tokens": ppl["tokens"],
            "predicted_tokens": ppl["predicted_tokens"],
            "windows": ppl["windows"],
            "tokens_available": ppl["tokens_available"],
            "tokens_dropped": ppl["tokens_dropped"],
            "perplexity": ppl["perplexity"],
            "memory_kind": run.meter.kind,
            "tokenizer_fingerprint": _fingerprint(ids[: ppl["tokens"]]),
        }
    prefill, decode = _speeds(run, ids, prefill_tokens, decode_tokens, p["notes"])
    p["prefill"].append(prefill)
    p["decode"].append(decode)
    p["peak"].append(run.meter.peak())
    p["delta"].append(run.meter.delta())
    p["notes"] += run.meter.notes
    del run
    _release_memory()


def _note_tokenizer_mismatch(results: list[EvalResult]) -> None:
    prints = {r.tokenizer_fingerprint for r in results}
    if len(prints) > 1:
        for r in results:
            r.notes.append("tokenizers differ across the compared checkpoints: perplexities are not comparable")


def evaluate(
    path: str | Path,
    *,
    text: str = DEFAULT_TEXT,
    window: int = DEFAULT_WINDOW,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    prefill_tokens: int = DEFAULT_PREFILL,
    decode_tokens: int = DEFAULT_DECODE,
    label: str | None = None,
    registry: Registry | None = None,
    **load_kwargs: Any,
) -> EvalResult:
    """Load ``path`` and measure perplexity on ``text``, peak memory, prefill/decode speed, load time.

    ``text`` is a bundled corpus name (its held-out evaluation part), a ``.txt``/``.jsonl``/
    ``.parquet`` file, or a cached ``hf:`` dataset. ``load_kwargs`` go to :func:`anyquant.load`
    (``backend``, ``device``, ``dtype``...).
    """
    if registry is not None:
        load_kwargs["registry"] = registry
    return _evaluate_rounds(
        [path],
        text=text,
        window=window,
        max_tokens=max_tokens,
        prefill_tokens=prefill_tokens,
        decode_tokens=decode_tokens,
        rounds=1,
        labels=[label] if label else None,
        registry=registry,
        load_kwargs=load_kwargs,
    )[0]


def compare(
    paths: Sequence[str | Path],
    *,
    text: str = DEFAULT_TEXT,
    window: int = DEFAULT_WINDOW,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    prefill_tokens: int = DEFAULT_PREFILL,
    decode_tokens: int = DEFAULT_DECODE,
    rounds: int = 2,
    labels: Sequence[str] | None = None,
    registry: Registry | None = None,
    progress: Callable[[str, float], None] | None = None,
    **load_kwargs: Any,
) -> list[EvalResult]:
    """Evaluate several checkpoints on the same text and windows.

    Timings are taken over ``rounds`` rounds in alternating order (A B C, then C B A, ...), one
    checkpoint loaded at a time; speeds are averaged, load time and memory are the least over the rounds
    (the process's first load also pays one-time imports); perplexity is computed once per checkpoint.
    ``progress(stage, fraction)`` is called before each checkpoint's visit and once at the end.
    """
    if not paths:
        raise EvaluationError("compare needs at least one checkpoint")
    if labels is not None and len(labels) != len(paths):
        raise EvaluationError(f"{len(labels)} labels for {len(paths)} checkpoints")
    if registry is not None:
        load_kwargs["registry"] = registry
    return _evaluate_rounds(
        paths,
        text=text,
        window=window,
        max_tokens=max_tokens,
        prefill_tokens=prefill_tokens,
        decode_tokens=decode_tokens,
        rounds=rounds,
        labels=labels,
        registry=registry,
        load_kwargs=load_kwargs,
        progress=progress,
    )


# ---------------------------------------------------------------------- reporting


def _mib(n: int | None) -> str:
    return f"{n / 2**20:.1f}" if n is not None else "-"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return format(x, fmt) if x is not None else "-"


COLUMNS = (
    "checkpoint",
    "format",
    "bits/w",
    "perplexity",
    "peak MiB",
    "+MiB",
    "load s",
    "prefill tok/s",
    "decode tok/s",
)


def _row(r: EvalResult) -> list[str]:
    fmt = r.format + (f" {r.variant}" if r.variant else "")
    return [
        r.label,
        fmt,
        _num(r.bits_per_weight, ".2f"),
        _num(r.perplexity, ".3f"),
        _mib(r.peak_memory_bytes),
        _mib(r.memory_delta_bytes),
        _num(r.load_s, ".2f"),
        _num(r.prefill_tok_s),
        _num(r.decode_tok_s),
    ]


def _footer(results: Sequence[EvalResult]) -> str:
    r = results[0]
    return (
        f"text {r.text!r} ({r.tokens_available} tokens): {r.windows} windows x {r.window} tokens = {r.tokens} "
        f"scored ({r.predicted_tokens} predicted; partial window dropped: {r.tokens_dropped}); memory = {r.memory_kind} "
        f"(+MiB = over the process before the load); over {r.rounds} round(s): load time and memory the least, "
        "speeds averaged"
    )


def to_markdown(results: Sequence[EvalResult]) -> str:
    """A markdown table of the results, with the text, windows and token counts stated below it."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_row(r)) + " |" for r in results]
    if results:
        lines += ["", _footer(results)]
        notes = sorted({n for r in results for n in r.notes})
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def to_table(results: Sequence[EvalResult]) -> str:
    """A fixed-width table for the terminal."""
    rows = [list(COLUMNS)] + [_row(r) for r in results]
    widths = [max(len(row[c]) for row in rows) for c in range(len(COLUMNS))]
    out = [
        "  ".join(
            cell.ljust(w) if c < 2 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    out.insert(1, "-" * len(out[0]))
    if results:
        out += ["", _footer(results)] + [f"- {n}" for n in sorted({n for r in results for n in r.notes})]
    return "\n".join(out)


def check_png_path(png_path: str | Path) -> Path:
    """Where :func:`plot` may write: a ``.png`` name that is not a directory, under no file; checked before an
    evaluation runs (``compare --png`` found out only after minutes of it)."""
    path = Path(png_path).expanduser()
    if path.is_dir():
        raise EvaluationError(f"{png_path} is a directory; give a file name ending in .png")
    if path.suffix.lower() != ".png":
        raise EvaluationError(f"{png_path}: the plot is a PNG; give a name ending in .png")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise EvaluationError(f"{png_path}: {parent} is a file, not a directory")
    return path


def plot(results: Sequence[EvalResult], png_path: str | Path, *, title: str | None = None) -> Path:
    """PNG: perplexity vs bits per weight; bubble area = peak memory; colour = format."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    png_path = check_png_path(png_path)
    if not results:
        raise EvaluationError("nothing to plot: no results")

    def plottable(r: EvalResult) -> bool:
        return math.isfinite(r.perplexity) and r.bits_per_weight is not None

    skipped = [r.label for r in results if not plottable(r)]  # named on the figure, not silently missing
    first = results[0]
    results = [r for r in results if plottable(r)]
    formats = sorted({r.format for r in results})
    colours = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(formats)}
    mem = [
        r.memory_delta_bytes if r.memory_delta_bytes and r.memory_delta_bytes > 0 else r.peak_memory_bytes or 0
        for r in results
    ]
    top = max(mem) or 1
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for r, m in zip(results, mem, strict=True):
            x = r.bits_per_weight if r.bits_per_weight is not None else float("nan")
            ax.scatter(
                [x], [r.perplexity], s=80 + 1200 * m / top, color=colours[r.format], alpha=0.6, edgecolors="black"
            )
            ax.annotate(f"{r.label}\n{_mib(m)} MiB", (x, r.perplexity), fontsize=7, ha="center", va="bottom")
        for f in formats:
            ax.scatter([], [], color=colours[f], label=f, s=60)
        ax.legend(title="format", loc="best", fontsize=8)
        ax.set_xlabel("bits per weight (quantized linears; all tensors for dense)")
        ax.set_ylabel("perplexity")
        default = f"perplexity on {first.text!r}, {first.windows}x{first.window} tokens"
        ax.set_title(title or default + " (bubble = memory)", fontsize=10)
        if skipped:
            ax.text(
                0.01,
                0.01,
                f"not plotted (perplexity not finite, or bits unknown): {', '.join(skipped)}",
                transform=ax.transAxes,
                fontsize=7,
                color="firebrick",
            )
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")  # close perplexities: no "+3.53e1" offset
        ax.margins(x=0.15, y=0.2)  # room for the labels above the top bubble
        fig.tight_layout()
        png_path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png_path, format="png")
    finally:
        plt.close(fig)
    return png_path
