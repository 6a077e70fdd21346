"""GPU checks of anyquant's EXL3 plugin against exllamav3 (run once, 2026-12-04: extension build unfinished).

Run it through ``bench/gpu_exl3.sh`` (which sets up the environment: wheels, PYTHONPATH, the extension build
directory). Steps, each a row of the summary table:

1. build: ``import exllamav3`` in a subprocess (its first import JIT-compiles the CUDA extension; the build
   is cached under ``TORCH_EXTENSIONS_DIR`` and resumes where it stopped). Meanwhile, on the side:
2. models: small random Llama checkpoints (``anyquant.testing.tiny``), and anyquant's own EXL3 encoder run on
   the GPU (``encode_device="cuda"``) on the tiny one;
3. convert: exllamav3's converter (``python -m exllamav3.conversion.convert_model -i -o -w -b -hb -cb -cr -cc``)
   on the tiny model with each codebook (mul1, mcg, 3inst; full mode adds 2.5 bpw mul1 for half-integer K),
   with mul1 and a ring-coded token embedding (``-eb 4``), and on a larger "bench" model, all in parallel;
4. reconstruct: per quantized linear, anyquant's CPU decoder against exllamav3's ``LinearEXL3``:
   ``get_inner_weight_tensor()`` (``ext.reconstruct``: Ŵ, must be bit-exact) and ``get_weight_tensor()``
   (W, within fp16 rounding: <= 1 ulp at the tensor's scale from anyquant's ``steps="library"`` decode, which
   rounds after each step as exllamav3 does, and <= 2 from the exact fp32 W); the ``-eb 4`` checkpoint's
   ring-coded embedding: anyquant's ``decode_rows`` vs exllamav3's ``dequant_rows`` (CPU, bit-exact) and its
   CUDA ``ngram_dequant`` (<= 1 ulp), and its logits through anyquant's reference vs the exllamav3 backend;
5. logits: exllamav3's checkpoint through anyquant's reference (CPU, fp32) vs anyquant's exllamav3 backend;
   anyquant's encoded checkpoint loaded by exllamav3 itself (``Config``/``Model``/``load``/``forward``) vs
   anyquant's reference;
6. API: the exllamav3 backend's generate / stream / stop strings / generate_batch / seeds, greedy tokens equal
   to a bare exllamav3 job, ``tensor_parallel`` (typed error on 1 GPU, logits on 2+);
   (3b: the converter once more through ``anyquant.quantize(..., quantizer_backend="exllamav3")``, on
   anyquant's calibration texts, and its output decoded like the others)
7. speed: decode tokens/s through ``LoadedModel.generate`` vs exllamav3's own ``Generator.generate`` on the same
   loaded model (the goal: anyquant's overhead under 3%).

Exit status: 0 when every check passed (a missed speed goal is reported as MISS, a failure only with
``--strict-speed``), 1 when a check failed, 2 when the extension build did not finish in time (run again on the
same machine: the build resumes), 3 without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NO_GPU = 3
BUILD_UNFINISHED = 2
EOS = 258  # anyquant.testing.tiny: <|im_end|>
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, "

TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY.update({"num_key_value_heads": 2})
BENCH = {
    "quick": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
    },
    "full": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
    },
}


# ------------------------------------------------------------------------------------------------ report


@dataclass
class Row:
    step: str
    status: str  # PASS FAIL SKIP INFO GOAL MISS
    detail: str
    seconds: float


class Report:
    def __init__(self, deadline: float | None) -> None:
        self.rows: list[Row] = []
        self.t0 = time.perf_counter()
        self.deadline = deadline

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - self.elapsed()

    def add(self, step: str, status: str, detail: str, seconds: float = 0.0) -> None:
        self.rows.append(Row(step, status, detail, round(seconds, 2)))
        print(f"[{status:4}] {step}: {detail} ({seconds:.1f}s, t={self.elapsed():.0f}s)", flush=True)

    def fits(self, name: str, need: float) -> bool:
        """Whether ``need`` seconds are left before the deadline; if not, a SKIP row for ``name``. A ``with``
        block cannot skip its own body, so callers write ``if rep.fits(name, need): with rep.step(name): ...``."""
        if self.left() >= need:
            return True
        self.add(name, "SKIP", f"out of time ({self.left():.0f}s left, ~{need:.0f}s needed)")
        return False

    @contextmanager
    def step(self, name: str) -> Iterator[Callable[[str, str], None]]:
        """Run a block as one or more rows; an exception is a FAIL row (with the traceback printed)."""
        t = time.perf_counter()
        added: list[bool] = []
        rows_before = len(self.rows)

        def emit(status: str, detail: str) -> None:
            added.append(True)
            self.add(name, status, detail, time.perf_counter() - t)

        try:
            yield emit
        except Exception as exc:
            traceback.print_exc()
            emit("FAIL", f"{type(exc).__name__}: {str(exc)[:300]}")
        else:
            if not added and len(self.rows) == rows_before:
                emit("PASS", "ok")

    def failed(self, strict_speed: bool) -> bool:
        bad = {"FAIL"} | ({"MISS"} if strict_speed else set())
        return any(r.status in bad for r in self.rows)

    def table(self) -> str:
        w = max([len(r.step) for r in self.rows] + [4])
        lines = [f"{'step':<{w}}  status  {'time':>7}  detail", f"{'-' * w}  ------  -------  ------"]
        lines += [f"{r.step:<{w}}  {r.status:<6}  {r.seconds:6.1f}s  {r.detail}" for r in self.rows]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ processes


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    fh = log.open("wb")
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)


def wait(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Exit status, or None after killing the whole process group (ninja/nvcc included) at the timeout."""
    try:
        return proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        return None


def build_progress() -> str:
    """How far torch's JIT build of exllamav3's extension got: object files present of those build.ninja lists."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    for ninja in sorted(root.glob("**/exllamav3_ext*/build.ninja")):
        outs = [
            line.split(":", 1)[0].split()[1] for line in ninja.read_text().splitlines() if line.startswith("build ")
        ]
        objs = [o for o in outs if o.endswith(".o")]
        done = sum((ninja.parent / o).is_file() for o in objs)
        return f"{done} of {len(objs)} objects compiled in {ninja.parent}"
    return f"no build.ninja under {root}"


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------------ numerics


def tensor_ulps(ref: Any, got: Any) -> float:
    """max |got - ref| in fp16 ulps at the tensor's scale (the fp16 spacing at max |ref|).

    The measure for W: exllamav3's ``get_weight_tensor`` rounds to fp16 after every step, so an entry far
    below the tensor's largest can be off by many of its own ulps while the whole stays within one or two
    ulps at the tensor's scale (anyquant's ``steps="library"`` vs exact fp32: < 1 on CPU)."""
    import torch

    ref, got = ref.float(), got.float()
    top = float(ref.abs().max())
    if top == 0.0:
        return 0.0 if torch.equal(ref, got) else float("inf")
    return float((got - ref).abs().max()) / 2.0 ** (torch.floor(torch.log2(torch.tensor(top))).item() - 10)


def compare_logits(ref: Any, got: Any) -> tuple[float, float, float]:
    """(max |Δ| / max |ref|, mean |Δ|, top-1 agreement) over every position."""
    ref, got = ref.float().cpu(), got.float().cpu()
    assert ref.shape == got.shape, f"shapes differ: {tuple(ref.shape)} vs {tuple(got.shape)}"
    delta = (ref - got).abs()
    rel = float(delta.max() / ref.abs().max().clamp_min(1e-9))
    top1 = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    return rel, float(delta.mean()), top1


# ------------------------------------------------------------------------------------------------ steps


def make_dense(path: Path, seed: int, overrides: dict[str, Any], *, zero_eos_row: bool) -> Path:
    """A random fp16 Llama; ``zero_eos_row`` zeroes the head row of EOS so greedy decoding never stops early."""
    from safetensors.torch import load_file, save_file

    from anyquant.testing.tiny import make_tiny_dense

    if path.exists():
        shutil.rmtree(path)
    make_tiny_dense(path, seed=seed, dtype="float16", **overrides)
    if zero_eos_row:
        files = sorted(path.glob("*.safetensors"))
        for f in files:
            state = load_file(f)
            if "lm_head.weight" in state:
                state["lm_head.weight"][EOS] = 0
                save_file({k: v.contiguous() for k, v in state.items()}, f, metadata={"format": "pt"})
        assert any("lm_head.weight" in load_file(f) for f in files), "no lm_head.weight to zero"
    return path


#: ``anyquant.quantize`` keywords of every EXL3 encode here: 4 bpw, mul1, head unquantized, no quality gate
ENCODE = {"method": "exl3", "bits": 4, "codebook": "mul1", "quality": False, "overwrite": True}


def encode(dense: Path, out: Path, reg: Any, **options: Any) -> Path:
    """anyquant's own EXL3 encoder through ``anyquant.quantize`` (:data:`ENCODE`); ``options`` override. Without
    the explicit backend, ``"auto"`` would pick exllamav3's converter on this machine."""
    import anyquant

    return anyquant.quantize(dense, out, registry=reg, **{**ENCODE, "quantizer_backend": "anyquant", **options})


def convert_cmd(
    dense: Path, out: Path, work: Path, bits: float, codebook: str, cal: tuple[int, int], embed_bits: int = 16
) -> list[str]:
    for d in (out, work):
        if d.exists():
            shutil.rmtree(d)
    extra = ["-eb", str(embed_bits)] if embed_bits != 16 else []
    return [
        sys.executable,
        "-m",
        "exllamav3.conversion.convert_model",
        "-i",
        str(dense),
        "-o",
        str(out),
        "-w",
        str(work),
        "-b",
        str(bits),
        "-hb",
        "6",
        "-cb",
        codebook,
        "-cr",
        str(cal[0]),
        "-cc",
        str(cal[1]),
        *extra,
    ]


#: GPTQModel's EXL3 quantizer on the tiny model (4 bpw, mcg, 6-bit head), calibrated on anyquant's offline
#: calibration texts; prints "All done" as exllamav3's converter does, for :func:`converted_ok`
GPTQMODEL_EXL3 = """
import sys
import torch
from anyquant_tools.calibration import corpus_documents
from gptqmodel import GPTQModel
from gptqmodel.quantization.config import EXL3Config
src, dst, rows, cols = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
texts = [d[: cols * 4] for d in corpus_documents("wiki")[:rows]]
model = GPTQModel.load(src, EXL3Config(bits=4.0, head_bits=6.0, codebook="mcg"), dtype=torch.float16)
model.quantize(texts, batch_size=1)
model.save(dst)
print("All done")
"""


def gptqmodel_env() -> dict[str, str] | None:
    """The environment of a GPTQModel child: its bundle's site folder (gpu_exl3.sh installs it apart from
    exllamav3's, ``ANYQUANT_GPTQMODEL_SITE``) ahead on the path; None when GPTQModel is not there."""
    import importlib.util

    site = os.environ.get("ANYQUANT_GPTQMODEL_SITE")
    if site:
        return {**os.environ, "PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}"}
    return dict(os.environ) if importlib.util.find_spec("gptqmodel") is not None else None


def converted_ok(out: Path, log: Path) -> bool:
    # the converter prints " !! Error: ..." and exits 0 on bad arguments: judge by its output
    return (out / "config.json").is_file() and any(out.glob("*.safetensors")) and "All done" in tail(log, 5)


def exl3_layers(path: Path) -> dict[str, dict[str, Any]]:
    """Every quantized linear's tensors (CPU) and codebook, from the safetensors files."""
    from safetensors import safe_open

    layers: dict[str, dict[str, Any]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            keys = set(fh.keys())
            for key in sorted(k for k in keys if k.endswith(".trellis")):
                prefix = key.removesuffix(".trellis")
                t = {
                    s: fh.get_tensor(f"{prefix}.{s}")
                    for s in ("trellis", "suh", "svh", "mcg", "mul1")
                    if f"{prefix}.{s}" in keys
                }
                if t["trellis"].dim() != 3:
                    continue
                t["codebook"] = "mcg" if "mcg" in t else "mul1" if "mul1" in t else "3inst"
                layers[prefix] = t
    return layers


def check_reconstruction(path: Path, label: str, rep: Report) -> None:
    """anyquant's CPU decoder vs exllamav3's LinearEXL3 (exllamav3/modules/quant/exl3.py)."""
    import torch
    from exllamav3.modules.quant.exl3 import LinearEXL3

    from anyquant_exl3.dequant import decode_exl3, decode_what

    layers = exl3_layers(path)
    if not layers:
        raise AssertionError(f"{path}: no 3-D trellis tensors")
    what_exact = w_exact = 0
    w_ulp = w32_ulp = w_same = 0.0
    ks: dict[str, int] = {}
    for name, t in layers.items():
        trellis = t["trellis"]
        k_pad, n_pad = trellis.shape[0] * 16, trellis.shape[1] * 16
        k = trellis.shape[-1] / 16
        ks[f"{k:g}"] = ks.get(f"{k:g}", 0) + 1
        cb = t["codebook"]
        ours_what = decode_what(trellis, codebook=cb)
        ours_w = decode_exl3(trellis, t["suh"], t["svh"], codebook=cb, steps="library", layout="exl3")
        ours_w32 = decode_exl3(trellis, t["suh"], t["svh"], codebook=cb, dtype=torch.float32, layout="exl3")
        lin = LinearEXL3(
            None,
            k_pad,
            n_pad,
            suh=t["suh"].cuda(),
            svh=t["svh"].cuda(),
            trellis=trellis.cuda(),
            mcg=t.get("mcg"),
            mul1=t.get("mul1"),
            key=name,
        )
        their_what = lin.get_inner_weight_tensor().cpu()
        their_w = lin.get_weight_tensor().cpu()
        assert their_what.dtype == torch.float16 and tuple(their_what.shape) == (k_pad, n_pad), their_what.shape
        assert their_w.dtype == torch.float16 and tuple(their_w.shape) == (k_pad, n_pad), their_w.shape
        if torch.equal(ours_what, their_what):
            what_exact += 1
        else:
            bad = int((ours_what != their_what).sum())
            print(f"  {label} {name}: Ŵ differs in {bad} of {ours_what.numel()} entries", flush=True)
        w_ulp = max(w_ulp, tensor_ulps(ours_w, their_w))
        w32_ulp = max(w32_ulp, tensor_ulps(ours_w32, their_w))
        w_exact += int(torch.equal(ours_w, their_w))
        w_same += float((ours_w == their_w).float().mean())
    n = len(layers)
    kdesc = ",".join(f"K={k}x{c}" for k, c in sorted(ks.items()))
    rep.add(
        f"reconstruct {label} Ŵ",
        "PASS" if what_exact == n else "FAIL",
        f"bit-exact in {what_exact}/{n} layers ({kdesc})",
    )
    rep.add(
        f"reconstruct {label} W",
        "PASS" if w_ulp <= 1.0 and w32_ulp <= 2.0 else "FAIL",
        f"get_weight_tensor vs anyquant steps='library': max {w_ulp:.2f} ulp at tensor scale, "
        f"{100 * w_same / n:.2f}% of entries identical, {w_exact}/{n} layers identical; "
        f"vs exact fp32 W: max {w32_ulp:.2f} ulp",
    )


def ring_tables(path: Path) -> dict[str, dict[str, Any]]:
    """Every ring-coded table (2-D ``.trellis`` + ``.signs``; row shards joined), from the safetensors files."""
    import torch
    from safetensors import safe_open

    pieces: dict[str, dict[str, Any]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key.endswith(".trellis") and len(fh.get_slice(key).get_shape()) == 2:
                    base, _, shard = key.removesuffix(".trellis").partition(".shard_")
                    pieces.setdefault(base, {})[int(shard or 0)] = fh.get_tensor(key)
                elif key.endswith(".signs"):
                    pieces.setdefault(key.removesuffix(".signs"), {})["signs"] = fh.get_tensor(key)
    tables = {}
    for base, parts in pieces.items():
        if "signs" in parts and 0 in parts:
            trellis = torch.cat([parts[i] for i in sorted(k for k in parts if isinstance(k, int))])
            tables[base] = {"trellis": trellis, "signs": parts["signs"]}
    return tables


def check_ring_tables(path: Path, label: str, rep: Report, hidden: int) -> None:
    """anyquant's CPU decode of ring-coded embeddings vs exllamav3's CUDA ``ngram_dequant`` and its CPU ``dequant_rows``."""
    import torch
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.modules.quant.exl3_lib.ngram_codec import dequant_rows, mul1_codebook

    from anyquant_exl3.plugin import ring_bits
    from anyquant_exl3.ring import decode_rows

    tables = ring_tables(path)
    if not tables:
        rep.add(f"ring tables {label}", "FAIL", "no 2-D .trellis + .signs table in the converter's output")
        return
    for key, t in tables.items():
        trellis, signs = t["trellis"], t["signs"]
        groups = signs.shape[0]
        k = ring_bits(trellis.shape[1], groups)
        ours = decode_rows(trellis, signs, k, hidden)
        rings = trellis.view(-1, trellis.shape[1] // groups)
        cpu = dequant_rows(rings, k, mul1_codebook("cpu"), signs=signs.repeat(trellis.shape[0], 1)).half()
        cpu = cpu.view(trellis.shape[0], -1)[:, :hidden]
        out = torch.empty((rings.shape[0], 256), dtype=torch.half, device="cuda")
        ext.ngram_dequant(rings.cuda(), k, None, signs.cuda(), out, True)
        cuda = out.cpu().view(trellis.shape[0], -1)[:, :hidden]
        same_cpu, same_cuda = torch.equal(ours, cpu), float((ours == cuda).float().mean())
        rep.add(
            f"ring table {label} {key}",
            "PASS" if same_cpu and tensor_ulps(cuda, ours) <= 1.0 else "FAIL",
            f"K={k}, {trellis.shape[0]} rows: vs exllamav3 dequant_rows (CPU) {'bit-exact' if same_cpu else 'DIFFERENT'}; "
            f"vs ngram_dequant (CUDA) {100 * same_cuda:.2f}% identical, max {tensor_ulps(cuda, ours):.2f} ulp",
        )


def prompt_ids() -> list[int]:
    from anyquant.testing.tiny import make_tokenizer

    return list(make_tokenizer()(PROMPT * 2)["input_ids"])


def reference_logits(path: Path, reg: Any) -> Any:
    import torch

    import anyquant

    model = anyquant.load(path, backend="reference", device="cpu", dtype="float32", registry=reg)
    with torch.inference_mode():
        return model.module(torch.tensor([prompt_ids()])).logits.float()


def exllamav3_direct_logits(path: Path) -> Any:
    """exllamav3 alone: Config.from_directory -> Model.from_config -> load -> forward (no cache)."""
    import torch
    from exllamav3 import Config, Model

    config = Config.from_directory(str(path))
    model = Model.from_config(config)
    model.load(device=torch.device("cuda", 0), progressbar=False)
    try:
        logits = model.forward(torch.tensor([prompt_ids()]), {"attn_mode": "flash_attn_nc"})
        return logits[..., : config.vocab_size].float().cpu()
    finally:
        model.unload()


def backend_vs_reference(path: Path, reg: Any, emit: Callable[[str, str], None], ref: Any = None) -> Any:
    """An exllamav3 checkpoint's logits: anyquant's reference (CPU; ``ref`` when already computed) vs the exllamav3
    backend; returns the reference's."""
    import torch

    import anyquant

    if ref is None:
        ref = reference_logits(path, reg)
    model = anyquant.load(path, backend="exllamav3", registry=reg)
    try:
        got = model.module(torch.tensor([prompt_ids()])).logits
    finally:
        model.module.unload()  # the GPU memory, also when the forward raised
    rel, mean, top1 = compare_logits(ref, got)
    emit("PASS" if rel < 2e-2 else "FAIL", f"max rel {rel:.1e}, mean |d| {mean:.1e}, top-1 {top1:.3f}")
    return ref


def direct_greedy_ids(loaded: Any, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from a bare exllamav3 Job on the backend's own generator (no anyquant code in the loop)."""
    import torch
    from exllamav3 import ArgmaxSampler, Job

    gen = loaded.generator.xl_generator
    job = Job(
        input_ids=torch.tensor([ids]),
        max_new_tokens=n,
        sampler=ArgmaxSampler(),
        stop_conditions=sorted(loaded.generator.eos_ids),
    )
    gen.enqueue(job)
    out: list[int] = []
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.get("stage") == "streaming":
                for key in ("token_ids",):
                    if r.get(key) is not None:
                        out += r[key].reshape(-1).tolist()
                if r.get("eos") and isinstance(r.get("held"), dict) and r["held"].get("token_ids") is not None:
                    out += r["held"]["token_ids"].reshape(-1).tolist()
    return out


def ascii_window(text: str, start: int = 3) -> str:
    """Two printable, non-blank ASCII characters from ``text`` (at ``start`` or later), else one such
    character (a random tiny model's text is mostly not ASCII), else ``""``."""
    for width in (2, 1):
        for i in range(start, len(text) - width + 1):
            piece = text[i : i + width]
            if piece.isascii() and piece.isprintable() and piece.strip() == piece:
                return piece
    return ""


def check_api(path: Path, reg: Any, rep: Report) -> None:
    import torch

    import anyquant
    from anyquant_exl3.loader import EXL3Loader

    with rep.step("api: backend listed") as emit:
        info = EXL3Loader().backends()[0]
        emit("PASS" if info.available else "FAIL", f"{info.name} available={info.available} {info.reason}")
    model = anyquant.load(path, registry=reg)  # backend="auto"
    rep.add("api: auto picks exllamav3", "PASS" if model.backend == "exllamav3" else "FAIL", repr(model))
    ids = prompt_ids()
    x = torch.tensor([ids], device=model.device)
    text = ""
    with rep.step("api: greedy = bare exllamav3 job") as emit:
        ours = model.generator.generate_ids(ids, model.params(max_new_tokens=32))
        theirs = direct_greedy_ids(model, ids, 32)
        emit("PASS" if ours == theirs else "FAIL", f"{len(ours)} tokens, equal={ours == theirs}")
    with rep.step("api: stream = generate") as emit:
        text = model.generate(PROMPT, max_new_tokens=32)
        pieces = list(model.stream(PROMPT, max_new_tokens=32))
        emit("PASS" if "".join(pieces) == text and text else "FAIL", f"{len(pieces)} pieces, {len(text)} chars")
    with rep.step("api: stop string") as emit:
        stop = ascii_window(text)
        if not stop:
            emit("SKIP", f"no printable ASCII character in the greedy text to stop on: {text!r}")
        else:
            cut = model.generate(PROMPT, max_new_tokens=32, stop=[stop])
            want = text[: text.find(stop)]
            emit("PASS" if cut == want else "FAIL", f"stop={stop!r}: {cut!r} (want {want!r})")
    with rep.step("api: seeded sampling") as emit:
        kw = {"max_new_tokens": 24, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1}
        a = model.generate(PROMPT, seed=123, **kw)
        b = model.generate(PROMPT, seed=123, **kw)
        c = model.generate(PROMPT, seed=7, **kw)
        emit("INFO", f"same seed equal={a == b} (exllamav3: determinism not guaranteed), other seed differs={a != c}")
    with rep.step("api: generate_batch") as emit:
        prompts = [PROMPT, "Hello", PROMPT[:20]]
        batch = model.generate_batch(prompts, max_new_tokens=16)
        single = [model.generate(p, max_new_tokens=16) for p in prompts]
        ok = len(batch) == 3 and all(isinstance(s, str) and s for s in batch)
        emit(
            "PASS" if ok else "FAIL",
            f"3 rows; equal to one-by-one greedy: {sum(b == s for b, s in zip(batch, single, strict=True))}/3",
        )
    with rep.step("api: chat prompt") as emit:
        if not getattr(model.tokenizer, "chat_template", None):
            emit("SKIP", "the converted checkpoint's tokenizer has no chat template")
        else:
            out = model.generate([{"role": "user", "content": "hi"}], max_new_tokens=8)
            emit("PASS" if isinstance(out, str) else "FAIL", f"{out!r}")
    with rep.step("api: module perplexity path") as emit:
        logits = model.module(x).logits
        ok = logits.shape == (1, len(ids), 259) and bool(torch.isfinite(logits).all())
        emit("PASS" if ok else "FAIL", f"logits {tuple(logits.shape)} {logits.dtype} on {logits.device}")
    with rep.step("api: tensor_parallel") as emit:
        n = torch.cuda.device_count()
        if n < 2:
            try:
                anyquant.load(path, tensor_parallel=True, registry=reg)
                emit("FAIL", "tensor_parallel=True on 1 GPU did not raise")
            except anyquant.UnsupportedBackendError as exc:
                emit("PASS", f"1 GPU: UnsupportedBackendError ({str(exc)[:80]}...)")
        else:
            tp = anyquant.load(path, tensor_parallel=True, registry=reg)
            rel, _, top1 = compare_logits(model.module(x).logits, tp.module(x).logits)
            emit(
                "PASS" if rel < 2e-2 else "FAIL", f"{n} GPUs: logits vs single GPU max rel {rel:.1e}, top-1 {top1:.2f}"
            )
            tp.module.unload()
    model.module.unload()


def check_speed(path: Path, reg: Any, rep: Report, *, tokens: int, repeat: int) -> None:
    import torch
    from exllamav3 import ArgmaxSampler

    import anyquant

    model = anyquant.load(path, backend="exllamav3", registry=reg)
    gen = model.generator.xl_generator
    eos = sorted(model.generator.eos_ids)
    produced = len(model.generator.generate_ids(prompt_ids(), model.params(max_new_tokens=tokens)))

    def ours() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(PROMPT, max_new_tokens=tokens)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    direct_tokens = [0]

    def theirs() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        _, last = gen.generate(
            prompt=PROMPT,
            max_new_tokens=tokens,
            sampler=ArgmaxSampler(),
            stop_conditions=eos,
            completion_only=True,
            return_last_results=True,
        )
        torch.cuda.synchronize()
        direct_tokens[0] = int(last["new_tokens"]) if isinstance(last, dict) else -1
        return time.perf_counter() - t

    ours(), theirs()  # warm-up (Triton autotuning, CUDA graphs, page cache)
    t_ours, t_theirs = [], []
    for _ in range(repeat):
        t_theirs.append(theirs())
        t_ours.append(ours())
    a, b = statistics.median(t_ours), statistics.median(t_theirs)
    overhead = a / b - 1.0
    detail = (
        f"{tokens} new tokens (anyquant produced {produced}, exllamav3 {direct_tokens[0]}): "
        f"exllamav3 {tokens / b:.0f} tok/s, anyquant {tokens / a:.0f} tok/s, overhead {100 * overhead:+.2f}% "
        f"(median of {repeat}; goal < 3%)"
    )
    rep.add("speed: decode overhead", "GOAL" if overhead < 0.03 else "MISS", detail, sum(t_ours) + sum(t_theirs))
    if produced != tokens or direct_tokens[0] != tokens:
        rep.add("speed: token counts", "INFO", "a run stopped early: the tokens/s above count the requested tokens")
    model.module.unload()


# ------------------------------------------------------------------------------------------------ main


def has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller bench model, fewer runs, no half-integer K")
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "gpu-exl3", help="scratch folder")
    ap.add_argument("--deadline", type=float, default=None, help="seconds: skip the steps that would run past it")
    ap.add_argument("--build-timeout", type=float, default=540.0, help="seconds for the extension build")
    ap.add_argument("--convert-timeout", type=float, default=240.0, help="seconds for the exllamav3 conversions")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("--strict-speed", action="store_true", help="a missed overhead goal fails the run")
    ap.add_argument("--bench-model", type=Path, default=None, help="dense HF folder for the speed run instead")
    args = ap.parse_args(argv)

    import torch

    if not has_cuda():
        print("no CUDA GPU: skipped")
        return NO_GPU
    rep = Report(args.deadline)
    torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 Hadamards in get_weight_tensor
    props = torch.cuda.get_device_properties(0)
    rep.add(
        "environment",
        "INFO",
        f"{props.name} sm_{props.major}{props.minor} x{torch.cuda.device_count()}, torch {torch.__version__}, "
        f"python {sys.version.split()[0]}, TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')}",
    )
    # what torch's JIT build of exllamav3's extension needs besides nvcc (CUDA_HOME is set by gpu_exl3.sh)
    import sysconfig

    py_h = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    ninja = shutil.which("ninja")
    rep.add(
        "build tools",
        "INFO" if (py_h and cxx and ninja) or os.environ.get("ANYQUANT_EXL3_EXT") == "prebuilt" else "FAIL",
        f"Python.h {'found' if py_h else 'MISSING'}, C++ compiler {cxx or 'MISSING'}, ninja {ninja or 'MISSING'}, "
        f"CUDA_HOME={os.environ.get('CUDA_HOME')}",
    )
    mode = "quick" if args.quick else "full"
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)

    # 1. the extension build runs in the background while the CPU-side models are made
    build_log = work / "build.log"
    build = start(
        [sys.executable, "-c", "import time; t = time.time(); import exllamav3; print('import s', time.time() - t)"],
        build_log,
    )
    t_build = time.perf_counter()

    import anyquant
    import anyquant_exl3.plugin

    reg = anyquant.Registry(entry_points=False, plugins=[("anyquant-exl3", anyquant_exl3.plugin)])

    # 2. models (CPU), and anyquant's encoder on the GPU
    tiny = bench = aq_exl3 = None
    with rep.step("models: dense tiny + bench") as emit:
        tiny = make_dense(work / "tiny-dense", 0, TINY, zero_eos_row=False)
        bench = args.bench_model or make_dense(work / "bench-dense", 1, BENCH[mode], zero_eos_row=True)
        emit("PASS", f"tiny {TINY}, bench {bench.name}")
    aq_ref = None
    if tiny is not None:
        with rep.step("anyquant encode (GPU) tiny, 4 bpw mul1") as emit:
            aq_exl3 = work / "tiny-anyquant-exl3"
            try:
                encode(tiny, aq_exl3, reg, encode_device="cuda")
                emit("PASS", f"encode_device=cuda -> {aq_exl3.name}")
            except Exception as exc:  # the GPU encoder is new: fall back to a 1-layer model on the CPU
                traceback.print_exc()
                emit("FAIL", f"encode_device=cuda: {type(exc).__name__}: {str(exc)[:200]}")
                small = {**TINY, "num_hidden_layers": 1, "hidden_size": 128, "intermediate_size": 256}
                encode(make_dense(work / "tiny1-dense", 0, small, zero_eos_row=False), aq_exl3, reg)
                emit("INFO", "fell back to anyquant's CPU encoder on a 1-layer model")
        with rep.step("anyquant reference logits (CPU) of the encoded model") as emit:
            aq_ref = reference_logits(aq_exl3, reg)
            emit("PASS", f"logits {tuple(aq_ref.shape)}")

    # 3. wait for the build
    rc = wait(build, min(args.build_timeout - (time.perf_counter() - t_build), rep.left() - 30))
    built = rc == 0
    rep.add(
        f"exllamav3 import ({os.environ.get('ANYQUANT_EXL3_EXT', 'jit')} extension)",
        "PASS" if built else "FAIL",
        tail(build_log, 1)
        if built
        else (f"timed out ({build_progress()}): run again, the build resumes" if rc is None else tail(build_log, 3)),
        time.perf_counter() - t_build,
    )
    if not built:
        print(tail(build_log, 40))
        return finish(rep, args, mode, BUILD_UNFINISHED if rc is None else 1)

    # 4. exllamav3's converter, all jobs in parallel
    cal = (16, 256)
    jobs: dict[str, tuple[Path, Path, subprocess.Popen[bytes]]] = {}
    plan = [("tiny-mul1", tiny, 4.0, "mul1"), ("tiny-mcg", tiny, 4.0, "mcg"), ("tiny-3inst", tiny, 3.0, "3inst")]
    if mode == "full":
        plan.append(("tiny-mul1-2.5", tiny, 2.5, "mul1"))
    plan.append(("bench-mul1", bench, 4.0, "mul1"))
    plan.append(("tiny-mul1-eb4", tiny, 4.0, "mul1"))  # a ring-coded token embedding (--embed_bits 4)
    t_conv = time.perf_counter()
    for label, dense, bits, cb in plan:
        if dense is None:
            continue
        out, log = work / f"{label}-exl3", work / f"{label}.log"
        eb = 4 if label.endswith("-eb4") else 16
        cmd = convert_cmd(dense, out, work / f"{label}-work", bits, cb, cal, embed_bits=eb)
        jobs[label] = (out, log, start(cmd, log))
    # GPTQModel's own EXL3 quantizer (CUDA only): a second peer's checkpoint, reconstructed like the others
    gm_env = gptqmodel_env()
    if tiny is None or gm_env is None:
        rep.add("convert tiny-gptqmodel-mcg", "SKIP", "GPTQModel is not installed (bundle: gpu_gptq.sh --prepare)")
    else:
        out, log = work / "tiny-gptqmodel-mcg-exl3", work / "tiny-gptqmodel-mcg.log"
        if out.exists():
            shutil.rmtree(out)
        cmd = [sys.executable, "-c", GPTQMODEL_EXL3, str(tiny), str(out), str(cal[0]), str(cal[1])]
        jobs["tiny-gptqmodel-mcg"] = (out, log, start(cmd, log, env=gm_env))
    converted: dict[str, Path] = {}
    for label, (out, log, proc) in jobs.items():
        rc = wait(proc, min(args.convert_timeout - (time.perf_counter() - t_conv), max(rep.left() - 60, 1)))
        if rc == 0 and converted_ok(out, log):
            converted[label] = out
            peer = "GPTQModel" if "gptqmodel" in label else "exllamav3"
            rep.add(f"convert {label}", "PASS", f"{peer} -> {out.name}", time.perf_counter() - t_conv)
        else:
            print(tail(log, 30))
            why = "timed out" if rc is None else f"exit {rc}: {tail(log, 1)[:200]}"
            rep.add(f"convert {label}", "FAIL", why, time.perf_counter() - t_conv)

    # 4b. the same converter behind anyquant.quantize (quantizer_backend="exllamav3", anyquant's calibration)
    name = "anyquant.quantize(quantizer_backend='exllamav3') tiny"
    if tiny is not None and rep.fits(name, 60):
        with rep.step(name) as emit:
            via = work / "tiny-quantize-exllamav3"
            if via.exists():
                shutil.rmtree(via)
            # in a child process with a time limit: the converter's worker has none of its own
            code = (
                "import json, sys, anyquant, anyquant_exl3.plugin as p\n"
                "reg = anyquant.Registry(entry_points=False, plugins=[('anyquant-exl3', p)])\n"
                "anyquant.quantize(sys.argv[1], sys.argv[2], registry=reg, **json.loads(sys.argv[3]))\n"
            )
            kw = {**ENCODE, "quantizer_backend": "exllamav3", "calibration_samples": 16, "calibration_seq_len": 256}
            cmd = [sys.executable, "-c", code, str(tiny), str(via), json.dumps(kw)]
            log = work / "tiny-quantize-exllamav3.log"
            rc = wait(start(cmd, log), min(180.0, rep.left() - 30))
            if rc != 0:
                print(tail(log, 30))
                raise RuntimeError("timed out" if rc is None else f"exit {rc}: {tail(log, 1)[:200]}")
            d = anyquant.detect(via, registry=reg)
            qc = json.loads((via / "config.json").read_text()).get("quantization_config", {})
            ok = d.format == "exl3" and str(qc.get("quant_method")) == "exl3"
            emit("PASS" if ok else "FAIL", f"{d.format}/{d.variant}, K {d.details.get('k_histogram')}")
            converted["tiny-via-quantize"] = via

    # 5. reconstruction: anyquant's CPU decode vs exllamav3's
    for label, out in converted.items():
        if label.startswith("tiny") and rep.fits(f"reconstruct {label}", 10):
            with rep.step(f"reconstruct {label}") as emit:
                d = anyquant.detect(out, registry=reg)
                emit("INFO", f"detected {d.format}/{d.variant}, K {d.details.get('k_histogram')}")
                check_reconstruction(out, label, rep)
                if label.endswith("-eb4"):
                    check_ring_tables(out, label, rep, int(TINY["hidden_size"]))
    if aq_exl3 is not None and aq_exl3.is_dir() and rep.fits("reconstruct anyquant-encoded", 10):
        with rep.step("reconstruct anyquant-encoded"):
            check_reconstruction(aq_exl3, "anyquant-encoded", rep)

    # 6. logits both ways
    ref = None
    if "tiny-mul1" in converted and rep.fits("logits: anyquant reference (CPU) of exllamav3's tiny-mul1", 30):
        with rep.step("logits: anyquant reference (CPU) of exllamav3's tiny-mul1") as emit:
            ref = reference_logits(converted["tiny-mul1"], reg)
            emit("PASS", f"logits {tuple(ref.shape)}")
    name = "logits: exllamav3 ckpt, anyquant reference vs exllamav3 backend"
    if ref is not None and rep.fits(name, 20):
        with rep.step(name) as emit:
            backend_vs_reference(converted["tiny-mul1"], reg, emit, ref=ref)
    name = "logits: anyquant dequantized on CUDA (fp32) vs reference on CPU"
    if ref is not None and rep.fits(name, 10):
        with rep.step(name) as emit:
            kw = {"backend": "dequantized", "device": "cuda", "dtype": "float32", "registry": reg}
            model = anyquant.load(converted["tiny-mul1"], **kw)
            with torch.inference_mode():
                got = model.module(torch.tensor([prompt_ids()], device="cuda")).logits
            rel, mean, top1 = compare_logits(ref, got)
            emit("PASS" if rel < 1e-3 else "FAIL", f"max rel {rel:.1e}, mean |d| {mean:.1e}, top-1 {top1:.3f}")
            del model
    name = "logits: anyquant ckpt, exllamav3 itself vs anyquant reference"
    if aq_exl3 is not None and aq_exl3.is_dir() and aq_ref is not None and rep.fits(name, 20):
        with rep.step(name) as emit:
            got = exllamav3_direct_logits(aq_exl3)
            rel, mean, top1 = compare_logits(aq_ref, got)
            emit("PASS" if rel < 2e-2 else "FAIL", f"max rel {rel:.1e}, mean |d| {mean:.1e}, top-1 {top1:.3f}")

    name = "logits: ring-coded embedding, anyquant reference vs exllamav3 backend"
    if "tiny-mul1-eb4" in converted and rep.fits(name, 20):
        with rep.step(name) as emit:
            backend_vs_reference(converted["tiny-mul1-eb4"], reg, emit)

    # 7. the generation API through the exllamav3 backend
    if "tiny-mul1" in converted and rep.fits("api", 30):
        with rep.step("api"):
            check_api(converted["tiny-mul1"], reg, rep)

    # 8. speed
    if "bench-mul1" in converted:
        tokens, repeat = (128, 3) if mode == "quick" else (256, 5)
        if rep.fits("speed", 40):
            with rep.step("speed"):
                check_speed(converted["bench-mul1"], reg, rep, tokens=tokens, repeat=repeat)

    return finish(rep, args, mode, 1 if rep.failed(args.strict_speed) else 0)


def finish(rep: Report, args: argparse.Namespace, mode: str, rc: int) -> int:
    """The summary table, the JSON rows (``--json``: on every path, the early exits included), the exit status."""
    print()
    print(f"== anyquant EXL3 GPU checks ({mode}, {rep.elapsed():.0f}s) ==")
    print(rep.table())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"exit": rc, "rows": [asdict(r) for r in rep.rows]}, indent=1))
    print("RESULT:", "PASS" if rc == 0 else ("BUILD UNFINISHED" if rc == BUILD_UNFINISHED else "FAIL"))
    return rc


def cross_build(out: Path, dest: Path) -> int:
    """exllamav3's extension built without a GPU (``bench/gpu_exl3.sh --cross-build`` sets up the toolchain):
    the sources and flags of exllamav3's own JIT build (``exllamav3/ext.py``), the library copied to ``dest``."""
    import importlib.util

    import torch
    import torch.utils.cpp_extension as ce

    pkg = Path(torch.__file__).parents[1] / "exllamav3"
    spec = importlib.util.spec_from_file_location("exl3_cuda_flags", pkg / "util" / "cuda_flags.py")
    assert spec is not None and spec.loader is not None
    flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags)
    src = pkg / "exllamav3_ext"
    t0 = time.perf_counter()
    try:
        ce.load(
            name="exllamav3_ext",
            sources=flags.extension_sources(str(src)),
            extra_include_paths=[str(src)],
            extra_cuda_cflags=flags.cuda_cflags(cuda_home=ce.CUDA_HOME, debug=False, hip=False),
            extra_cflags=["-Ofast"],
            build_directory=str(out),
        )
    except Exception as exc:  # without a GPU the import after the link can fail; the library is what counts
        print(f"load: {type(exc).__name__}: {str(exc)[-500:]}")
    lib = out / "exllamav3_ext.so"
    if not lib.is_file():
        print("no exllamav3_ext.so: the build failed (see above)")
        return 1
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(lib, dest / lib.name)
    version = next(pkg.parent.glob("exllamav3-*.dist-info"), pkg).name
    (dest / "BUILD-INFO").write_text(
        f"{version}, torch {torch.__version__} (CUDA {torch.version.cuda}), python {sys.version.split()[0]}, "
        f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')}, built without a GPU\n"
    )
    print(f"{dest / lib.name}: {lib.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cross-build"]:
        sys.exit(cross_build(Path(sys.argv[2]), Path(sys.argv[3])))
    sys.exit(main())
