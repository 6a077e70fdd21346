"""One ``quantize`` for every method: early validation, atomic output, a quality gate.

The method's plugin supplies a :class:`~anyquant.protocols.Quantizer` (lazy ``FormatSpec.quantizer``).
This module owns what every method shares:

1. validate before any work (source exists and is dense, destination is not inside the source, an
   existing non-empty destination needs ``overwrite=True``, the quantizer's own parameter checks);
2. write into a temporary directory beside ``dst``;
3. re-detect the result (it must be the method's format) and compare its perplexity on a short
   held-out text with the source's: a result far worse is a :class:`QuantizeError`, not an output;
4. rename into place. A failure or Ctrl-C removes the temporary directory: ``dst`` is either the
   finished, checked model or untouched.

Upstream quantizers (GPTQModel, AutoAWQ, exllamav3) patch transformers globally on import, so they
run in a worker subprocess (:func:`run_worker`).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from anyquant.errors import AnyquantError, QuantizeError
from anyquant.probe import Probe, resolve_checkpoint
from anyquant.protocols import QuantizeSpec, undeclared_options
from anyquant.registry import Registry, load_spec_object

from ._staging import check_destination, lock_destination, publish_modes, replace_dir, staging_dir

__all__ = [
    "CORE_QUANTIZE_OPTIONS",
    "DEFAULT_CALIBRATION",
    "QualityReport",
    "WorkerError",
    "calibration_batch",
    "calibration_texts",
    "quantize",
    "run_worker",
]

log = logging.getLogger(__name__)

Progress = Callable[[str, float], None]
PROGRESS_PREFIX = "ANYQUANT-PROGRESS "

#: environment for upstream quantizers on small CPU machines (see shared/ENVIRONMENT.md).
WORKER_ENV = {
    "TORCH_COMPILE_DISABLE": "1",
    "GPTQMODEL_CPU_WORKERS": str(max(1, min(os.cpu_count() or 2, 2))),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

#: a short English text of our own for the quality gate when no corpus file is installed.
FALLBACK_EVAL_TEXT = (
    "The river runs through the middle of the old town, and most of the houses on its banks are "
    "more than two hundred years old. In the spring the water rises and the lower streets are often "
    "closed for a few days. The town council has argued for years about building a wall, but the "
    "merchants fear that a wall would hide the river, which is the reason visitors come at all. "
    "Every morning the baker on the bridge opens his shop before sunrise. He sells bread, small "
    "cakes and coffee to the fishermen, who leave before the light and come back at noon with "
    "whatever the river has given them. Children walk to the school on the hill, and in the "
    "afternoon they return along the water, throwing stones and counting the boats. "
) * 3


class WorkerError(QuantizeError):
    """The quantizer's worker process failed; the message carries the tail of its log."""


@dataclass(frozen=True)
class QualityReport:
    source_ppl: float
    result_ppl: float
    tokens: int
    max_ratio: float

    @property
    def ratio(self) -> float:
        return self.result_ppl / self.source_ppl

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


def _check_paths(src: Path, dst: Path, overwrite: bool) -> None:
    if not src.exists():
        raise QuantizeError(f"source {src} does not exist")
    check_destination(src, dst, overwrite, QuantizeError)


def heldout_text() -> str:
    """The held-out part of the bundled wiki corpus (never drawn for calibration; what ``anyquant eval`` and
    ``compare`` score by default), or a short text of our own when the corpus files are not installed."""
    from .calibration import CalibrationError, evaluation_text

    try:
        return evaluation_text("wiki")
    except CalibrationError:
        return FALLBACK_EVAL_TEXT


def eval_text() -> str:
    """The quality gate's text: the start of :func:`heldout_text`."""
    return heldout_text()[:12000]


#: general web text plus code, against domain shift between calibration and use.
DEFAULT_CALIBRATION = "c4:0.5,code:0.25,wiki:0.25"


def calibration_texts(spec: QuantizeSpec) -> list[str]:
    """A quantizer's calibration samples: explicit texts (``options["texts"]``), or a named source / mix / file
    via :mod:`anyquant_tools.calibration` (default :data:`DEFAULT_CALIBRATION`).

    Either way they are checked against the whole held-out evaluation text (n-gram overlap): the quality
    gate's, and what ``anyquant eval``/``compare`` score (the check covered only the gate's 12,000
    characters before, so calibration text from further on slipped through).
    """
    from .calibration import check_overlap, sample

    texts = spec.options.get("texts")
    if texts:
        texts = [str(t) for t in texts]
        check_overlap(texts, heldout_text())
        return texts
    return sample(
        spec.calibration or DEFAULT_CALIBRATION,
        n_samples=spec.calibration_samples,
        seq_len=spec.calibration_seq_len,
        seed=int(spec.options.get("seed", 0)),
        evaluation=heldout_text(),
    )


def calibration_batch(tokenizer: Any, texts: Sequence[str], seq_len: int, min_tokens: int = 32) -> Any:
    """Token ids ``[rows, length]`` (a torch tensor) for in-process quantizers: each text tokenized and cut to
    ``seq_len``; texts shorter than ``min(seq_len, min_tokens)`` tokens are dropped and the rest cut to the
    shortest one, so every row has the same length. :class:`QuantizeError` when nothing is left."""
    import torch

    rows = [ids[:seq_len] for ids in tokenizer(list(texts))["input_ids"] if len(ids) >= min(seq_len, min_tokens)]
    if not rows:
        raise QuantizeError("no calibration sample is long enough to use")
    length = min(len(r) for r in rows)
    return torch.tensor([r[:length] for r in rows])


def quality_check(
    src: Path, result: Path, *, max_ratio: float, max_tokens: int = 1024, registry: Registry | None = None
) -> QualityReport:
    """Perplexity of ``result`` vs ``src`` on a short held-out text; raises when the ratio is too high."""
    from anyquant.api import load

    from .evaluate import perplexity

    text = eval_text()
    ppls = []
    tokens = 0
    for path in (src, result):
        model = load(path, registry=registry)
        ids = model.tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]  # as perplexity() reads text
        out = perplexity(model, ids, window=min(512, len(ids)))
        ppls.append(float(out["perplexity"]))
        tokens = int(out["tokens"])
        del model
    report = QualityReport(ppls[0], ppls[1], tokens, max_ratio)
    if not report.ratio <= max_ratio:  # also catches NaN
        raise QuantizeError(
            f"the quantized model is far worse than its source: perplexity {report.result_ppl:.4g} vs "
            f"{report.source_ppl:.4g} ({report.ratio:.2f}x, limit {max_ratio}x) on {tokens} held-out tokens. "
            "Nothing was written. Try more calibration data, more bits or a smaller group size, or raise "
            "max_ppl_ratio if this loss is acceptable."
        )
    return report


def _check_arguments(**kw: Any) -> None:
    """Core's arguments of :func:`quantize`, typed, before anything is read (a method's own ranges are its
    quantizer's ``validate``): a string ``"no"`` for ``sym`` was truthy, ``max_ppl_ratio="3"`` failed after
    the whole quantization."""

    def bad(name: str, want: str) -> QuantizeError:
        return QuantizeError(f"{name}={kw[name]!r}: expected {want}")

    if not isinstance(kw["method"], str):
        raise bad("method", "a string such as 'gptq', 'awq' or 'exl3'")
    bits = kw["bits"]
    if isinstance(bits, bool) or not isinstance(bits, numbers.Real) or not math.isfinite(bits):
        raise bad("bits", "a number")
    if isinstance(kw["group_size"], bool) or not isinstance(kw["group_size"], numbers.Integral):
        raise bad("group_size", "an integer (-1: one group per column)")
    for name in ("desc_act", "quality", "overwrite"):
        if not isinstance(kw[name], bool):
            raise bad(name, "True or False")
    if kw["sym"] is not None and not isinstance(kw["sym"], bool):
        raise bad("sym", "True, False or None (the method's default)")
    for name in ("calibration_samples", "calibration_seq_len"):
        v = kw[name]
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise bad(name, "an integer >= 1")
    if kw["calibration_seq_len"] < 16:
        raise bad("calibration_seq_len", "at least 16 tokens (a calibration text is a context, not a word)")
    ratio = kw["max_ppl_ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not math.isfinite(ratio) or ratio < 1:
        raise bad("max_ppl_ratio", "a finite number >= 1 (the result's perplexity over the source's)")


def quantize(
    src: str | Path,
    dst: str | Path,
    *,
    method: str,
    bits: float = 4,
    group_size: int = 128,
    sym: bool | None = None,
    desc_act: bool = False,
    calibration: str | os.PathLike[str] | Sequence[str] | None = None,
    calibration_samples: int = 128,
    calibration_seq_len: int = 512,
    overwrite: bool = False,
    max_ppl_ratio: float = 3.0,
    quality: bool = True,
    progress: Progress | None = None,
    revision: str | None = None,
    registry: Registry | None = None,
    **options: Any,
) -> Path:
    """Quantize the dense checkpoint ``src`` into ``dst`` with ``method`` (``gptq``, ``awq``, ``exl3``).

    Returns ``dst``. Raises :class:`QuantizeError` (nothing written) on bad parameters, a failed
    quantizer, a result that does not detect as ``method``, or a quality gate failure. ``src`` may be a
    model id in the local Hugging Face cache, ``revision`` its branch, tag or commit.
    """
    from anyquant.api import default_registry

    reg = registry or default_registry()
    # a model id (owner/name[@revision]): its snapshot in the local Hugging Face cache
    src, dst = resolve_checkpoint(src, revision), Path(dst)
    _check_arguments(
        method=method,
        bits=bits,
        group_size=group_size,
        sym=sym,
        desc_act=desc_act,
        calibration_samples=calibration_samples,
        calibration_seq_len=calibration_seq_len,
        max_ppl_ratio=max_ppl_ratio,
        quality=quality,
        overwrite=overwrite,
    )
    if isinstance(calibration, os.PathLike):  # a file, as a path object: its name as the string form takes it
        calibration = os.fspath(calibration)
    if calibration == "":
        raise QuantizeError("calibration='' names no source: pass a named source, a mix, a file, or None (default)")
    if isinstance(calibration, str):
        from .calibration import CalibrationError, check_spec

        try:
            check_spec(calibration, registry)
        except CalibrationError as exc:
            raise QuantizeError(f"calibration={calibration!r}: {exc}") from exc
    elif calibration is not None:
        texts = None if isinstance(calibration, (bytes, Mapping)) else list(calibration)
        if texts is None or not texts or not all(isinstance(t, str) for t in texts):
            raise QuantizeError("calibration must be a source name, a mix, a file path, or a non-empty list of texts")
        calibration = texts
    _check_paths(src, dst, overwrite)
    source_probe = Probe.open(src)
    if not source_probe.root.is_dir() or source_probe.path.is_file():
        raise QuantizeError(f"{src}: quantize needs a model directory (config.json, weights, tokenizer), not one file")
    if not any(n.startswith(("tokenizer", "vocab")) for n in source_probe.tokenizer_files):
        raise QuantizeError(
            f"{src} has no tokenizer files: calibration, the quality check and the output need the source's tokenizer"
        )
    if method.lower() == "exl3" and group_size != 128:
        raise QuantizeError(f"group_size={group_size}: exl3 has no groups (its scales are per channel); leave it out")
    detection = reg.detect(source_probe)
    if detection.format != "dense":
        hint = " Export it first: anyquant export PATH --to dense OUT." if detection.format == "gguf" else ""
        raise QuantizeError(f"{src} is {detection.format}, not a dense checkpoint; quantize needs dense weights.{hint}")
    method, options = resolve_method(reg, method, options)
    fmt = reg.format(method)
    if fmt.quantizer is None:
        raise QuantizeError(f"format {method!r} has no quantizer registered")
    quantizer = load_spec_object(fmt, "quantizer")
    _check_options(quantizer, options, method)
    spec = QuantizeSpec(
        method=method.lower(),
        bits=bits,
        group_size=group_size,
        sym=sym,
        desc_act=desc_act,
        calibration=calibration if isinstance(calibration, str) or calibration is None else "<texts>",
        calibration_samples=calibration_samples,
        calibration_seq_len=calibration_seq_len,
        options={
            **options,
            **({"texts": list(calibration)} if calibration is not None and not isinstance(calibration, str) else {}),
        },
    )
    check = getattr(quantizer, "validate", None)
    if callable(check):
        check(source_probe, spec)
    lock = lock_destination(dst)  # one writer at a time, released below; the commit rechecks overwrite
    tmp = staging_dir(dst)
    report_progress = progress or (lambda stage, frac: log.info("quantize: %s (%.0f%%)", stage, 100 * frac))
    try:
        started = time.monotonic()
        out = Path(quantizer.quantize(src, tmp, spec, report_progress))
        report_progress("checking the result", 0.92)
        got = reg.detect(Probe.open(out))
        if got.format != spec.method:
            raise QuantizeError(f"the quantizer wrote a {got.format} checkpoint, not {spec.method}")
        if quality:
            qr = quality_check(src, out, max_ratio=max_ppl_ratio, registry=reg)
            log.info("quality: perplexity %.4g -> %.4g (%.2fx)", qr.source_ppl, qr.result_ppl, qr.ratio)
            (out / "anyquant_quality.json").write_text(json.dumps(qr.to_dict(), indent=1))
        publish_modes(out)  # a quantizer's files (and the 0700 staging directory) get the umask's modes
        replace_dir(out, dst, overwrite=overwrite, error=QuantizeError)
        report_progress("done", 1.0)
        log.info("quantized %s -> %s (%s) in %.1fs", src, dst, spec.method, time.monotonic() - started)
        return dst
    except AnyquantError:
        raise
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        raise QuantizeError(f"quantizing {src} with {spec.method} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        lock.release()


def resolve_method(reg: Registry, method: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The format whose quantizer runs ``method``, and the options it runs with. A format's own name runs its own
    quantizer, unless ``quantizer_backend`` names one that another format's quantizer declares for that method
    (its ``method_aliases``, keys ``"awq@llmcompressor"``: llm-compressor's AWQ writes compressed-tensors); a name no
    format quantizes (``w4a16``, ``w8a8``, ``fp8``) is looked up in the aliases, which add their options."""
    name, backend = method.lower(), options.get("quantizer_backend")
    own = name in reg.formats() and reg.format(name).quantizer is not None
    keys = [f"{name}@{backend}"] if isinstance(backend, str) and backend != "auto" else []
    keys += [] if own else [name]
    for fmt in sorted(reg.formats()) if keys else ():
        spec = reg.format(fmt)
        if spec.quantizer is None:
            continue
        aliases = getattr(load_spec_object(spec, "quantizer"), "method_aliases", None) or {}
        hit = next((k for k in keys if k in aliases), None)
        if hit is not None:
            return fmt, {**aliases[hit], **options}
    return name, dict(options)


#: the ``quantize(..., **options)`` keywords core itself reads, for every method
CORE_QUANTIZE_OPTIONS: Mapping[str, str] = MappingProxyType(
    {"seed": "calibration sampling (and the quantizer's own randomness); default 0"}
)


def _check_options(quantizer: Any, options: Mapping[str, Any], method: str) -> None:
    """An option the quantizer does not read (its ``quantize_options``) is a typo, not a no-op: refuse it
    before any work. A quantizer without the attribute (a third party's) gets every option unchecked."""
    found = undeclared_options(quantizer, "quantize_options", options, CORE_QUANTIZE_OPTIONS)
    if found is not None and found[0]:
        raise QuantizeError(
            f"unknown quantize option(s) {found[0]} for method {method!r}; it reads "
            f"{found[1]} (and quantize()'s own bits, group_size, sym, desc_act, "
            "calibration, calibration_samples, calibration_seq_len, overwrite, max_ppl_ratio, quality, progress)"
        )


def route_backend(
    options: Mapping[str, Any],
    readers: Mapping[str, Set[str]],
    auto: str | Callable[[], str],
    *,
    auto_picks: Sequence[str] | None = None,
    key: str = "quantizer_backend",
) -> str:
    """Which of a method's quantizers runs, so that no option is silently dropped.

    ``options[key]`` is ``"auto"`` (the default) or a name in ``readers``, which maps each quantizer to the
    options of ``options`` that only some quantizers read (an option no entry names is read by all and
    plays no part). A named quantizer must read every such option given, else a :class:`QuantizeError`
    says which one does. ``"auto"`` runs ``auto`` (a name, or a callable asked only when the options leave
    a choice) when it reads them all, else the first of ``auto_picks`` (default: every quantizer, in
    ``readers``' order) that does; if none does, a :class:`QuantizeError` says who reads what.
    """
    names = ("auto", *readers)
    chosen = options.get(key, "auto")
    if chosen not in names:
        raise QuantizeError(f"{key}={chosen!r} is not one of {names}")
    specific = frozenset().union(*readers.values())
    given = sorted(k for k in options if k in specific)

    def reading(keys: Sequence[str], among: Sequence[str]) -> list[str]:
        return [b for b in among if set(keys) <= readers[b]]

    if chosen != "auto":
        unread = [k for k in given if k not in readers[chosen]]
        if unread:
            who = reading(unread, list(readers))
            does = f"{key} {' or '.join(repr(b) for b in who)} does" if who else "no single quantizer reads them all"
            raise QuantizeError(f"{key}={chosen!r} does not read {unread} ({does}); drop them or choose that quantizer")
        return str(chosen)
    candidates = reading(given, list(auto_picks or readers))
    if not candidates and (named := reading(given, list(readers))):
        raise QuantizeError(
            f"options {given} are read only by {key} {' or '.join(repr(b) for b in named)}, which 'auto' does not "
            f"pick: name it ({key}={named[0]!r})"
        )
    if not candidates:
        by = "; ".join(f"{k!r} by {' or '.join(repr(b) for b in readers if k in readers[b])}" for k in given)
        raise QuantizeError(f"options {given} are not all read by one quantizer ({by}): one runs; drop some")
    if given and len(candidates) == 1:
        return candidates[0]
    default = auto() if callable(auto) else auto
    return default if default in candidates else candidates[0]


def run_worker(
    module: str,
    job: Mapping[str, Any],
    *,
    scratch: Path,
    progress: Progress | None = None,
    timeout: float | None = None,
    python: str | None = None,
) -> dict[str, Any]:
    """Run ``python -m module job.json`` in a subprocess (cwd ``scratch``) and relay its progress.

    ``python``: another interpreter (a venv of its own for a quantizer whose pins clash with this one's: then
    ``module`` is a script's path, run as ``python SCRIPT job.json``, since that venv has no anyquant).

    The worker prints ``ANYQUANT-PROGRESS {"stage": ..., "fraction": ...}`` lines on stdout and a
    final ``ANYQUANT-PROGRESS {"result": {...}}``; everything else goes to ``scratch/worker.log``.
    A non-zero exit raises :class:`WorkerError` with the log's tail; Ctrl-C terminates the worker.
    """
    scratch = scratch.resolve()  # the worker runs with cwd=scratch: every path it gets is absolute
    scratch.mkdir(parents=True, exist_ok=True)
    job_file = scratch / "job.json"
    job_file.write_text(json.dumps(job))
    env = {**os.environ, **{k: v for k, v in WORKER_ENV.items() if k not in os.environ}}
    log_path = scratch / "worker.log"
    result: dict[str, Any] = {}
    with log_path.open("w") as log_fh:
        argv = [sys.executable, "-m", module] if python is None else [python, module]
        proc = subprocess.Popen(
            [*argv, str(job_file)],
            cwd=scratch,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log_fh,
            text=True,
        )
        try:
            assert proc.stdout is not None
            deadline = time.monotonic() + timeout if timeout else None
            for line in proc.stdout:
                if line.startswith(PROGRESS_PREFIX):
                    msg = json.loads(line[len(PROGRESS_PREFIX) :])
                    if "result" in msg:
                        result = msg["result"]
                    elif progress is not None:
                        progress(str(msg.get("stage", "")), float(msg.get("fraction", 0.0)))
                else:
                    log_fh.write(line)
                if deadline and time.monotonic() > deadline:
                    proc.kill()
                    raise WorkerError(f"{module} ran past its {timeout}s limit")
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if code != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise WorkerError(f"{module} exited with code {code}. Last lines of its log:\n{tail}")
    return result


def watch_parent(interval: float = 1.0) -> None:
    """For worker scripts: exit when the parent process dies (it was killed with SIGKILL, or by the OOM
    killer, so it could not stop this worker): a daemon thread polls the parent's pid. Without it an
    orphaned GPTQModel worker went on quantizing for up to half an hour, writing nowhere."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="anyquant-watch-parent", daemon=True).start()


def emit_progress(stage: str, fraction: float) -> None:
    """For worker scripts: report a stage to the parent."""
    print(PROGRESS_PREFIX + json.dumps({"stage": stage, "fraction": fraction}), flush=True)


def emit_result(result: Mapping[str, Any]) -> None:
    print(PROGRESS_PREFIX + json.dumps({"result": dict(result)}), flush=True)
