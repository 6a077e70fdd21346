"""exllamav3's own converter as anyquant's EXL3 quantizer on CUDA (``quantizer_backend="exllamav3"``).

``anyquant.quantize(src, dst, method="exl3", ...)`` runs, through :func:`anyquant_tools.quantize.run_worker`,
``python -m anyquant_exl3.exllamav3_convert job.json``; this worker starts
``python -m exllamav3.conversion.convert_model`` (exllamav3 1.6 CLI: ``-i -o -w -b -hb -cb -cd -cr -cc``),
passes its output to the worker log, turns its `` -- Quantized: <module>`` lines into progress, and
judges success by the output (the converter prints `` !! Error`` and exits 0 on some bad arguments).

Calibration: anyquant's texts (``calibration=...``, the same default mix as GPTQ/AWQ) tokenized with the
model's tokenizer into a packed token file (``input_ids`` ``[rows, cols]`` right-padded, ``lengths``)
that the converter reads with ``--cal_data`` instead of its bundled corpus.

Options: ``head_bits`` (default 6, exllamav3's; 16 keeps the head unquantized), ``codebook``,
``scaled_hessian`` (exllamav3's experimental ``-sh``: the Hessian factored with the input channel scales
folded in, what anyquant's own CPU encoder does), ``devices`` (``-d``, e.g. ``"0,1"``), ``out_scales``.
The converter writes the config, tokenizer and shards itself; anyquant's ``quantize`` then detects the
result, runs the quality gate and moves it into place atomically.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from anyquant.plugin import QuantizeError, QuantizeSpec

from .options import embed_bits

__all__ = ["converter_command", "converted_ok", "job", "layer_progress", "write_calibration"]

MODULE = "exllamav3.conversion.convert_model"
_QUANTIZED = re.compile(r"^\s*-- Quantized: \S*?layers\.(\d+)\b")
_OUT_SCALES = ("auto", "always", "never")


def job(src: Path, out: Path, spec: QuantizeSpec, calibration: Path, num_layers: int) -> dict[str, Any]:
    """The worker's job: paths (absolute) and the converter's settings from ``spec``."""
    head_bits = float(spec.options.get("head_bits", 6))
    out_scales = str(spec.options.get("out_scales", "auto"))
    if out_scales not in _OUT_SCALES:
        raise QuantizeError(f"out_scales={out_scales!r} is not one of {_OUT_SCALES}")
    return {
        "src": str(src.resolve()),
        "out": str(out.resolve()),
        "work": str((out.parent / "exllamav3-work").resolve()),
        "bits": float(spec.bits),
        "head_bits": int(head_bits) if head_bits.is_integer() else head_bits,
        "codebook": str(spec.options.get("codebook", "mul1")).lower(),
        "calibration": str(calibration.resolve()),
        "cal_rows": int(spec.calibration_samples),
        "cal_cols": int(spec.calibration_seq_len),
        "scaled_hessian": bool(spec.options.get("scaled_hessian", False)),
        "devices": str(spec.options.get("devices", "0")),
        "out_scales": out_scales,
        "num_layers": int(num_layers),
        "embed_bits": embed_bits(spec),
    }


def converter_command(job: Mapping[str, Any], python: str = sys.executable) -> list[str]:
    """The converter's command line for a :func:`job` (``job["module"]`` replaces the converter's module)."""
    cmd = [python, "-m", job.get("module", MODULE), "-i", job["src"], "-o", job["out"], "-w", job["work"]]
    cmd += ["-b", f"{job['bits']:g}", "-hb", f"{job['head_bits']:g}", "-cb", job["codebook"]]
    cmd += ["-cd", job["calibration"], "-cr", str(job["cal_rows"]), "-cc", str(job["cal_cols"])]
    cmd += ["-d", job["devices"], "--out_scales", job["out_scales"]]
    if job["scaled_hessian"]:
        cmd.append("-sh")
    if job.get("embed_bits", 16) != 16:
        cmd += ["-eb", str(job["embed_bits"])]
    return cmd


def layer_progress(line: str, num_layers: int) -> float | None:
    """Fraction done after a converter output line (`` -- Quantized: model.layers.N...``), else ``None``."""
    match = _QUANTIZED.match(line)
    if match is None or num_layers < 1:
        return None
    return min(1.0, (int(match.group(1)) + 1) / num_layers)


def converted_ok(out: Path, log_tail: str) -> str | None:
    """``None`` when the converter's output is complete, else why not."""
    if "!! Error" in log_tail:
        return "the converter reported an error: " + log_tail[log_tail.index("!! Error") :].splitlines()[0]
    if not (out / "config.json").is_file() or not any(out.glob("*.safetensors")):
        return f"the converter wrote no config.json / *.safetensors to {out}"
    if "All done" not in log_tail:
        return "the converter stopped before 'All done'"
    return None


def write_calibration(tokenizer: Any, texts: Sequence[str], seq_len: int, path: Path) -> int:
    """Tokenize ``texts`` into the converter's packed token file; returns the rows written.

    ``input_ids`` int64 ``[rows, cols]`` (right-padded with 0), ``lengths`` int64 ``[rows]``: the converter
    crops each row to its own length, so no row runs into the padding.
    """
    import torch
    from safetensors.torch import save_file

    rows = [ids[:seq_len] for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"] if ids]
    if not rows:
        raise QuantizeError("no calibration text gave any token")
    cols = max(len(r) for r in rows)
    packed = torch.zeros((len(rows), cols), dtype=torch.int64)
    for i, r in enumerate(rows):
        packed[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    save_file({"input_ids": packed, "lengths": lengths}, str(path))
    return len(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point: ``python -m anyquant_exl3.exllamav3_convert job.json``."""
    from anyquant_tools import emit_progress, emit_result

    args = list(sys.argv[1:] if argv is None else argv)
    spec = json.loads(Path(args[0]).read_text())
    out = Path(spec["out"])
    tail: deque[str] = deque(maxlen=40)
    emit_progress("starting exllamav3's converter (its CUDA extension may build first)", 0.0)
    with subprocess.Popen(
        converter_command(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stderr.write(line)  # the worker log
            tail.append(line)
            done = layer_progress(line, spec["num_layers"])
            if done is not None:
                emit_progress(line.split("Quantized:", 1)[1].split()[0], done)
    why = converted_ok(out, "".join(tail))
    if proc.returncode != 0 or why is not None:
        sys.stderr.write(f"exllamav3 converter failed (exit {proc.returncode}): {why}\n")
        return 1
    emit_result({"out": str(out)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
