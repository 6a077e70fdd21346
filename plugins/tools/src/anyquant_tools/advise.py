"""``anyquant advise``: what to run where, given a model and the hardware.

:func:`advise` is a decision tree over the memory that :mod:`anyquant_tools.estimate` computes (see its docstring):
which format, engine and command fit the GPU (or CPU), with the reasons. Standard library only.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .estimate import (
    GB,
    MARGIN_FRACTION,
    OVERHEAD_BYTES,
    Estimate,
    GiB,
    ModelShape,
    SizingError,
    Weights,
    check_count,
    check_gb,
    estimate,
    estimate_for,
    format_gb,
    margin_bytes,
    model_shape,
    weights_from_config,
    weights_of,
)

__all__ = ["GPUS", "Advice", "GpuSpec", "advise", "find_gpu"]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------- hardware


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: memory (GiB, as sold), architecture, compute capability, memory bandwidth."""

    name: str
    vram_gb: float | None
    arch: str
    compute_capability: tuple[int, int] | None
    bandwidth_gbs: float
    kind: str = "cuda"  # "cuda", "rocm" (AMD: vLLM, no EXL3/Marlin kernels), "apple" or "cpu"
    aliases: tuple[str, ...] = ()

    @property
    def ampere_or_newer(self) -> bool:
        return self.kind == "cuda" and self.compute_capability is not None and self.compute_capability >= (8, 0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("aliases")
        return d


GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("RTX 3090", 24, "Ampere", (8, 6), 936, aliases=("rtx3090", "3090")),
    GpuSpec("RTX 4090", 24, "Ada Lovelace", (8, 9), 1008, aliases=("rtx4090", "4090")),
    GpuSpec("RTX 5090", 32, "Blackwell", (12, 0), 1792, aliases=("rtx5090", "5090")),
    GpuSpec("A100 80GB", 80, "Ampere", (8, 0), 2039, aliases=("a100", "a10080gb", "a10080")),
    GpuSpec("A100 40GB", 40, "Ampere", (8, 0), 1555, aliases=("a100", "a10040gb", "a10040")),
    GpuSpec("H100", 80, "Hopper", (9, 0), 3350, aliases=("h100", "h10080gb", "h100sxm")),
    GpuSpec("H200", 141, "Hopper", (9, 0), 4800, aliases=("h200", "h200141gb")),
    GpuSpec("L4", 24, "Ada Lovelace", (8, 9), 300, aliases=("l4",)),
    GpuSpec("L40S", 48, "Ada Lovelace", (8, 9), 864, aliases=("l40s",)),
    GpuSpec("L40", 48, "Ada Lovelace", (8, 9), 864, aliases=("l40",)),
    GpuSpec("RTX 6000 Ada", 48, "Ada Lovelace", (8, 9), 960, aliases=("rtx6000ada", "6000ada")),
    GpuSpec("RTX A6000", 48, "Ampere", (8, 6), 768, aliases=("rtxa6000", "a6000")),
    GpuSpec("RTX A5000", 24, "Ampere", (8, 6), 768, aliases=("rtxa5000", "a5000")),
    GpuSpec("RTX A4000", 16, "Ampere", (8, 6), 448, aliases=("rtxa4000", "a4000")),
    GpuSpec("A40", 48, "Ampere", (8, 6), 696, aliases=("a40",)),
    GpuSpec("A10", 24, "Ampere", (8, 6), 600, aliases=("a10", "a10g")),
    GpuSpec("RTX 4080", 16, "Ada Lovelace", (8, 9), 717, aliases=("rtx4080", "4080", "rtx4080super", "4080super")),
    GpuSpec("RTX 4070 Ti", 12, "Ada Lovelace", (8, 9), 504, aliases=("rtx4070ti", "4070ti")),
    GpuSpec("RTX 3080", 10, "Ampere", (8, 6), 760, aliases=("rtx3080", "3080")),
    GpuSpec("MI300X", 192, "CDNA 3", None, 5300, "rocm", ("mi300x", "amdmi300x", "instinctmi300x")),
    GpuSpec("MI250X", 128, "CDNA 2", None, 3277, "rocm", ("mi250x", "amdmi250x", "instinctmi250x")),
    GpuSpec("T4", 16, "Turing", (7, 5), 320, aliases=("t4",)),
    GpuSpec("V100 16GB", 16, "Volta", (7, 0), 900, aliases=("v100", "v10016gb", "v10016")),
    GpuSpec("V100 32GB", 32, "Volta", (7, 0), 900, aliases=("v100", "v10032gb", "v10032")),
    GpuSpec("RTX 2080 Ti", 11, "Turing", (7, 5), 616, aliases=("rtx2080ti", "2080ti")),
    GpuSpec("Apple M-series", None, "Apple silicon", None, 200, "apple", ("apple", "applemseries", "mseries", "mac")),
    GpuSpec("CPU", None, "CPU", None, 60, "cpu", ("cpu", "none", "ram")),
)
#: the memory bandwidth assumed for a GPU that is not in :data:`GPUS` (named with ``--vram``)
UNKNOWN_GPU_BANDWIDTH_GBS = 900.0
#: unified-memory bandwidth (GB/s) of Apple chips by tier (base/Pro/Max/Ultra, M1..M4)
APPLE_BANDWIDTH = {"": 100, "pro": 200, "max": 400, "ultra": 800}


def _norm(name: str) -> str:
    s = name.lower()
    for word in ("nvidia", "geforce", "tesla", "pcie", "sxm5", "sxm4", "amd", "instinct", "radeon"):
        s = s.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", s)


def find_gpu(name: str, vram_gb: float | None = None) -> GpuSpec:
    """Look ``name`` up in :data:`GPUS` ("RTX 4090", "nvidia a100 40gb", "Apple M3 Max", "cpu").

    Where a name has several memory sizes (A100, V100), ``vram_gb`` picks the closest. A name the table does not
    know, given with ``vram_gb``, is a label: a CUDA GPU of Ampere or newer with that memory is assumed.
    """
    key = _norm(name)
    apple = re.fullmatch(r"(apple)?m([1-9])(pro|max|ultra)?", key)
    if apple:
        base = next(g for g in GPUS if g.kind == "apple")
        tier = apple.group(3) or ""
        return replace(
            base,
            name=f"Apple M{apple.group(2)}{' ' + tier.title() if tier else ''}",
            bandwidth_gbs=APPLE_BANDWIDTH[tier],
        )
    matches = [g for g in GPUS if key in g.aliases or key == _norm(g.name)]
    if not matches and vram_gb is not None:  # with --vram the name is a label: a CUDA GPU of Ampere or newer
        return GpuSpec(name, vram_gb, "unknown (assumed Ampere or newer)", (8, 0), UNKNOWN_GPU_BANDWIDTH_GBS)
    if not matches:
        known = ", ".join(g.name for g in GPUS)
        raise SizingError(
            f"unknown GPU {name!r}; known: {known} (Apple: 'Apple M3 Max' etc.); or give its memory with --vram"
        )
    if vram_gb is not None and len(matches) > 1:
        matches.sort(key=lambda g: abs((g.vram_gb or 0) - vram_gb))
    return matches[0]


# ---------------------------------------------------------------------- advice


@dataclass
class Advice:
    """What to run: format, bits, engine, KV cache type, parallelism; with reasons and commands."""

    gpu: GpuSpec
    vram_gb: float
    gpus: int
    users: int
    context: int
    format: str
    engine: str
    bits: float | None
    quant_type: str | None
    kv_dtype: str
    tensor_parallel: int
    fits: bool
    estimate: Estimate
    expected_decode_tok_s: float | None
    device_bytes: int | None = None  # what must sit in GPU / unified memory (None: estimate.total_bytes)
    reasons: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    alternatives: list[str] = field(default_factory=list)
    offload: dict[str, Any] | None = None

    @property
    def memory_bytes(self) -> int:
        return self.device_bytes if self.device_bytes is not None else self.estimate.total_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory_bytes"] = self.memory_bytes
        d["gpu"] = self.gpu.to_dict()
        d["estimate"] = self.estimate.to_dict()
        return d

    def summary(self) -> str:
        what = f"{self.format.upper()}" + (f" {self.quant_type}" if self.quant_type else "")
        what += f" at {self.bits:g} bpw" if self.bits is not None else ""
        head = f"{'RECOMMEND' if self.fits else 'DOES NOT FIT'}: {what} on {self.engine}, KV cache {self.kv_dtype}" + (
            f", tensor parallel {self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        )
        lines = [
            head,
            f"  hardware: {self.gpus} x {self.gpu.name} ({self.vram_gb:g} GB), {self.users} user(s), context {self.context}",
        ]
        lines.append(f"  memory: {format_gb(self.memory_bytes).strip()} on the device(s), estimated")
        if self.expected_decode_tok_s:
            rate = self.expected_decode_tok_s
            lines.append(f"  decode: about {rate:.{0 if rate >= 10 else 1}f} tokens/s per user at best (memory-bound)")
        lines += ["why:"] + [f"  - {r}" for r in self.reasons]
        lines += ["commands:"] + [f"  $ {c}" for c in self.commands]
        if self.alternatives:
            lines += ["alternatives:"] + [f"  - {a}" for a in self.alternatives]
        shape_notes = [n for n in self.estimate.notes if n.startswith(("MoE", "MLA", "sliding", "context", "no inter"))]
        if shape_notes:
            lines += ["notes:"] + [f"  - {n}" for n in shape_notes]
        return "\n".join(lines)


#: EXL3 bits per weight to try, best first
EXL3_BPW = (8.0, 6.0, 5.0, 4.5, 4.0, 3.5, 3.0, 2.5, 2.25, 2.0)
EXL3_HEAD_BITS = 6.0
#: KL divergence to bf16 of EXL3 on Llama-3.1-8B-Instruct (exllamav3 doc/exl3.md plot labels)
EXL3_KLD = {2.0: 0.312, 2.25: 0.215, 2.5: 0.151, 3.0: 0.053, 3.5: 0.030, 4.0: 0.013, 5.0: 0.003, 6.0: 0.001, 8.0: 0.0}
#: GGUF quant types, best first, with approximate average bits per weight of llama.cpp's mixes
GGUF_TYPES = (
    ("Q8_0", 8.5),
    ("Q6_K", 6.56),
    ("Q5_K_M", 5.69),
    ("Q4_K_M", 4.89),
    ("IQ4_XS", 4.25),
    ("Q3_K_M", 3.91),
    ("IQ3_XXS", 3.06),
    ("IQ2_M", 2.7),
    ("IQ2_XS", 2.31),
)
#: GPTQ/AWQ 4-bit, group 128: 4 bits + a 16-bit scale and a 4-bit zero per 128 weights
W4_G128_BPW = 4.16
#: concurrent users from which vLLM (continuous batching, paged KV) is the better server
MANY_USERS = 4
VLLM_GPU_UTIL = 0.90
APPLE_USABLE = 0.75  # macOS lets the GPU wire about 2/3-3/4 of unified memory by default
CPU_RESERVED_BYTES = 2 * GiB
RAM_BANDWIDTH_GBS = 60.0  # dual-channel DDR5, for offload estimates
CALIBRATION_MIX = "c4:0.5,code:0.25,wiki:0.25"


@dataclass(frozen=True)
class _Ctx:
    """Everything the branches of the decision tree need."""

    gpu: GpuSpec
    vram_bytes: int  # per device
    vram_gb: float
    gpus: int
    users: int
    context: int
    shape: ModelShape
    model: str | Path | Mapping[str, Any]
    model_label: str
    checkpoint_format: str | None
    ram_bytes: int | None


def _est(ctx: _Ctx, bits: float, kv: str, head_bits: float, batch: int, fmt: str | None = None) -> Estimate:
    """A config-based estimate for this model at ``bits`` (the checkpoint's own bytes are not what we'd run)."""
    weights = replace(weights_from_config(ctx.shape, bits, head_bits, fmt), format=None)
    return estimate_for(weights, context=ctx.context, batch=batch, kv_dtype=kv, devices=ctx.gpus, model=ctx.model_label)


def _gguf_est(ctx: _Ctx, bpw: float, kv: str, devices: int = 1, batch: int = 1) -> Estimate:
    """GGUF quantizes every tensor (embeddings included): weights = parameters x bpw / 8."""
    note = f"all {ctx.shape.parameters / 1e9:.2f}B parameters at ~{bpw:g} bits/weight (llama.cpp mix)"
    shape = ctx.shape
    weights = Weights(
        shape, "config+bits", None, bpw, int(shape.parameters * bpw / 8), int(shape.embed_params * bpw / 8), (note,)
    )
    return estimate_for(weights, context=ctx.context, batch=batch, kv_dtype=kv, devices=devices, model=ctx.model_label)


def _read_per_token(ctx: _Ctx, e: Estimate, exclude: int = 0) -> float:
    """Weight bytes one decode step reads: all of them, less the MoE experts a token does not use."""
    bits = e.bits or 16.0
    unused = (ctx.shape.linear_params - (ctx.shape.active_linear_params or ctx.shape.linear_params)) * bits / 8
    return max(e.weight_bytes - exclude - unused, 1.0)


def _resident(e: Estimate, exclude_embeddings: bool) -> int:
    return e.total_bytes - (e.embedding_bytes if exclude_embeddings else 0)


def _tok_s(weight_bytes: float, bandwidth_gbs: float, devices: int = 1) -> float:
    return bandwidth_gbs * GB * devices / max(weight_bytes, 1)


def _model_args(ctx: _Ctx) -> str:
    """The model directory to put in commands (a config.json's folder; MODEL_DIR for a dict)."""
    if isinstance(ctx.model, Mapping):
        return "MODEL_DIR"
    path = Path(ctx.model)
    return str(path.parent) if path.suffix == ".json" else str(path)


def _kld_note(bpw: float) -> str:
    if bpw >= 4.0:
        return ""
    k = EXL3_KLD.get(bpw)
    return (
        f"; quality cost below 4.0 bpw: KL divergence to bf16 {k:.3f} at {bpw:g} bpw vs 0.013 at 4.0 "
        "(exllamav3's Llama-3.1-8B measurements)"
        if k is not None
        else ""
    )


def _advice(ctx: _Ctx, **fields: Any) -> Advice:
    """An :class:`Advice` for the situation ``ctx`` describes (GPU, VRAM, GPUs, users, context);
    ``fields`` give the rest and may override those (a single device for GGUF)."""
    situation = {"gpu": ctx.gpu, "vram_gb": ctx.vram_gb, "gpus": ctx.gpus, "users": ctx.users, "context": ctx.context}
    return Advice(**{**situation, **fields})


def _gguf_advice(
    ctx: _Ctx, e: Estimate, quant_type: str | None, *, engine: str, fits: bool = True, devices: int = 1, **fields: Any
) -> Advice:
    """A GGUF advice on llama.cpp, fp16 KV cache, no tensor parallel: ``bits`` from the estimate and, when it fits,
    the memory-bound decode speed over ``devices`` unless ``fields`` say otherwise."""
    fields.setdefault("bits", e.bits)
    if "expected_decode_tok_s" not in fields:
        fields["expected_decode_tok_s"] = (
            _tok_s(_read_per_token(ctx, e), ctx.gpu.bandwidth_gbs, devices) if fits else None
        )
    return _advice(
        ctx,
        format="gguf",
        engine=engine,
        quant_type=quant_type,
        kv_dtype="fp16",
        tensor_parallel=1,
        fits=fits,
        estimate=e,
        **fields,
    )


def _no_cuda(ctx: _Ctx) -> str:
    return f"{ctx.gpu.name}: no CUDA, so no EXL3/GPTQ/AWQ kernels; GGUF runs on llama.cpp " + (
        "with Metal" if ctx.gpu.kind == "apple" else "on the CPU"
    )


def _advise_exl3(ctx: _Ctx) -> Advice | None:
    """Ampere or newer, few users: EXL3 at the largest bpw that fits (fp16 KV first, then q8, q4)."""
    usable = ctx.vram_bytes * ctx.gpus
    best: tuple[float, str, Estimate] | None = None
    for kv in ("fp16", "q8", "q4"):
        for bpw in EXL3_BPW:
            e = _est(ctx, bpw, kv, EXL3_HEAD_BITS, ctx.users, fmt="exl3")
            if _resident(e, True) <= usable:
                if best is None or bpw > best[0]:
                    best = (bpw, kv, e)
                break
    if best is None:
        return None
    bpw, kv, e = best
    out = f"{_model_args(ctx)}-exl3-{bpw:g}bpw"
    reasons = [
        f"{ctx.gpu.name} is {ctx.gpu.arch} (sm_{''.join(map(str, ctx.gpu.compute_capability or ()))}): exllamav3's EXL3 "
        "kernels run (they need Ampere, sm_80, or newer)",
        f"{ctx.users} user(s): a single-user engine is right; EXL3 has the best quality per bit "
        "(Llama-3.1-70B perplexity 3.85 at 4.0 bpw vs AWQ 4-bit 4.19)",
        f"{bpw:g} bpw is the largest that fits: {format_gb(_resident(e, True)).strip()} of "
        f"{ctx.gpus} x {ctx.vram_gb:g} GB (weights {format_gb(e.weight_bytes - e.embedding_bytes).strip()} with a 6-bit head; "
        f"embeddings stay in system RAM; KV {format_gb(e.kv_bytes).strip()} for {ctx.context} tokens x {ctx.users})"
        + _kld_note(bpw),
    ]
    if kv != "fp16":
        reasons.append(
            f"a {kv} KV cache (exllamav3 CacheLayer_quant) buys the higher bpw; fp16 cache would force lower"
        )
    if ctx.checkpoint_format == "exl3":
        out = _model_args(ctx)
    serve = f"anyquant serve {_q(out)} --engine exllamav3 --max-model-len {ctx.context} --max-batch {ctx.users}"
    commands = _from_source(ctx, out, "exl3", bpw, [serve], reasons)
    if kv != "fp16":
        reasons.append(
            f"exllamav3's quantized cache (CacheLayer_quant, {kv[1:]} bits, {_pages(ctx.context * ctx.users)} tokens) is "
            "what fits; anyquant serve --engine exllamav3 allocates an fp16 cache, so lower --max-model-len there"
        )
    if ctx.gpus > 1:
        reasons.append(
            f"{ctx.gpus} GPUs: exllamav3 tensor parallel splits weights and cache across them "
            "(anyquant serve --engine exllamav3 uses every visible GPU)"
        )
    alternatives = []
    if bpw < 3.0:
        off = _offload_plan(ctx)
        if off is not None:
            alternatives.append(
                f"GGUF {off.quant_type} with CPU offload keeps quality but decodes at ~{off.expected_decode_tok_s:.1f} tok/s"
            )
    if ctx.users > 1:
        alternatives.append(f"from {MANY_USERS} concurrent users on, serve AWQ/GPTQ with vLLM instead")
    return _advice(
        ctx,
        format="exl3",
        engine="exllamav3",
        bits=bpw,
        quant_type=None,
        kv_dtype=kv,
        tensor_parallel=ctx.gpus,
        fits=True,
        estimate=e,
        expected_decode_tok_s=_tok_s(_read_per_token(ctx, e, e.embedding_bytes), ctx.gpu.bandwidth_gbs, ctx.gpus),
        device_bytes=_resident(e, True),
        reasons=reasons,
        commands=commands,
        alternatives=alternatives,
    )


def _quantize_command(src: str, dst: str, method: str, bits: float) -> str:
    group = " --group-size 128" if method in ("gptq", "awq") else ""
    return f"anyquant quantize {_q(src)} {_q(dst)} --method {method} --bits {bits:g}{group} --calibration {CALIBRATION_MIX}"


def _q(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def _from_source(ctx: _Ctx, out: str, method: str, bits: float, then: list[str], reasons: list[str]) -> list[str]:
    """The commands that make ``out`` (``method`` at ``bits``) from the model and then run ``then``: every one
    runs as printed. ``anyquant quantize`` reads an unquantized checkpoint: from a quantized one (a GGUF file, a
    GPTQ folder) the steps go into ``reasons``, from the model it was made from, and no command is printed."""
    if ctx.checkpoint_format == method:
        return list(then)  # the checkpoint is already what is served
    if ctx.checkpoint_format in (None, "dense"):
        return [_quantize_command(_model_args(ctx), out, method, bits), *then]
    steps = [_quantize_command("ORIGINAL_MODEL", out, method, bits), *then]
    reasons.append(
        f"the checkpoint is {str(ctx.checkpoint_format).upper()}, and anyquant quantize reads an unquantized model: "
        "from the model it was made from (ORIGINAL_MODEL), run: "
        + "; then ".join(f"`{c}`" for c in steps)
        + "; meanwhile the checkpoint as it is runs on anyquant's own server (the command below)"
    )
    return [f"anyquant serve {_q(_model_args(ctx))}"]


def _pages(tokens: int) -> int:
    return int(math.ceil(tokens / 256) * 256)


def _vllm_quantization(ctx: _Ctx, method: str) -> str:
    marlin = ctx.gpu.ampere_or_newer
    return f"{method}_marlin" if marlin else method


def _advise_vllm(ctx: _Ctx) -> Advice:
    """Many concurrent users: 4-bit AWQ/GPTQ served by vLLM, tensor parallel as needed."""
    cc = ctx.gpu.compute_capability or (0, 0)
    existing = ctx.checkpoint_format if ctx.checkpoint_format in ("gptq", "awq") else None
    method = existing or ("awq" if ctx.gpu.ampere_or_newer else "gptq")
    if method == "awq" and cc < (7, 5):
        method = "gptq"
    per_seq_fp16 = _est(ctx, W4_G128_BPW, "fp16", 16, 1).kv_bytes
    choice: tuple[int, str, int, Estimate] | None = None
    for tp in (t for t in (1, 2, 4, 8) if t <= ctx.gpus and ctx.shape.heads % t == 0):
        for kv in ("fp16", "fp8"):
            e = _est(ctx, W4_G128_BPW, kv, 16, 1)
            space = tp * ctx.vram_bytes * VLLM_GPU_UTIL - e.weight_bytes * (1 + MARGIN_FRACTION) - tp * OVERHEAD_BYTES
            seqs = int(space // e.kv_bytes) if e.kv_bytes else 0
            if seqs >= 1 and (choice is None or (choice[2] < ctx.users and seqs > choice[2])):
                choice = (tp, kv, seqs, e)
            if seqs >= ctx.users:
                break
        if choice is not None and choice[2] >= ctx.users:
            break
    q = _vllm_quantization(ctx, method)
    if choice is None:
        e = _est(ctx, W4_G128_BPW, "fp16", 16, 1)
        return _advice(
            ctx,
            format=method,
            engine="vllm",
            bits=W4_G128_BPW,
            quant_type="4-bit g128",
            kv_dtype="fp16",
            tensor_parallel=ctx.gpus,
            fits=False,
            estimate=e,
            expected_decode_tok_s=None,
            reasons=[
                f"4-bit weights ({format_gb(e.weight_bytes).strip()}) plus one {ctx.context}-token sequence do not fit in "
                f"{ctx.gpus} x {ctx.vram_gb:g} GB at {VLLM_GPU_UTIL:.0%} utilisation"
            ],
            alternatives=["more GPUs (tensor parallel)", "a shorter --max-model-len", "a smaller model"],
        )
    tp, kv, seqs, e = choice
    rocm = ctx.gpu.kind == "rocm"
    reasons = [
        f"{ctx.gpu.name} is AMD (ROCm): vLLM serves it; exllamav3's kernels are CUDA only"
        if rocm and ctx.users < MANY_USERS
        else f"{ctx.users} concurrent users: vLLM's continuous batching and paged KV cache serve them; "
        "single-user engines (exllamav3, llama.cpp) would queue them",
        f"vLLM loads {method.upper()} 4-bit ({'zero point' if method == 'awq' else 'symmetric'}, group 128) directly"
        + (" — the checkpoint already is" if existing else "")
        + f"; --quantization {q}"
        + (
            " (Marlin kernels, Ampere+)"
            if q.endswith("_marlin")
            else " (the Marlin kernels are CUDA only)"
            if rocm
            else f" (Marlin needs sm_80+; {ctx.gpu.name} is sm_{cc[0]}{cc[1]})"
        ),
        f"weights {format_gb(e.weight_bytes).strip()}; each {ctx.context}-token sequence needs {format_gb(e.kv_bytes).strip()} of "
        f"{kv} KV: room for {seqs} full-length sequences at once with tensor parallel {tp}",
    ]
    if seqs < ctx.users:
        reasons.append(
            f"fewer than {ctx.users} full-length sequences fit: vLLM queues the rest (shorter chats fit more)"
        )
    if kv == "fp8":
        reasons.append(
            f"an fp8 KV cache halves its size ({per_seq_fp16 / GB:.2f} -> {e.kv_bytes / GB:.2f} GB a sequence)"
        )
    if not ctx.gpu.ampere_or_newer and not rocm:
        reasons.append(f"{ctx.gpu.arch} has no bf16: run in float16")
    from .engines import vllm_plan

    served = _model_args(ctx) if existing else f"{_model_args(ctx)}-{method}-4bit"
    plan = vllm_plan(
        served,
        method,
        dtype="float16",
        max_model_len=ctx.context,
        tensor_parallel_size=tp,
        max_num_seqs=ctx.users,
        gpu_memory_utilization=VLLM_GPU_UTIL,
        kv_cache_dtype="fp8" if kv == "fp8" else None,
        ampere_or_newer=ctx.gpu.ampere_or_newer,
    )
    assert ("--quantization", q) in plan.flags or not ctx.gpu.ampere_or_newer
    commands = _from_source(ctx, served, method, 4, [plan.command()], reasons)
    return _advice(
        ctx,
        format=method,
        engine="vllm",
        bits=W4_G128_BPW,
        quant_type="4-bit g128 " + ("zero point" if method == "awq" else "sym"),
        kv_dtype=kv,
        tensor_parallel=tp,
        fits=True,
        estimate=e,
        # the weights plus the KV cache of the sequences served at once (vLLM reserves up to its utilisation)
        device_bytes=int(
            e.weight_bytes * (1 + MARGIN_FRACTION) + tp * OVERHEAD_BYTES + min(seqs, ctx.users) * e.kv_bytes
        ),
        expected_decode_tok_s=_tok_s(_read_per_token(ctx, e), ctx.gpu.bandwidth_gbs, tp),
        reasons=reasons,
        commands=commands,
        alternatives=[f"{'GPTQ' if method == 'awq' else 'AWQ'} 4-bit works the same way"],
    )


def _largest_gguf(ctx: _Ctx, usable: int, kv: str = "fp16") -> tuple[str, float, Estimate] | None:
    for name, bpw in GGUF_TYPES:
        e = _gguf_est(ctx, bpw, kv, batch=ctx.users)
        if e.total_bytes <= usable:
            return name, bpw, e
    return None


def _gguf_commands(ctx: _Ctx, qtype: str, ngl: int | None) -> list[str]:
    """llama.cpp's steps to a ``qtype`` GGUF and its server: from an unquantized model (its converter), from a
    GGUF (requantized); a checkpoint of another quantized format runs as it is on anyquant's server."""
    m = _model_args(ctx)
    offload = f" -ngl {ngl}" if ngl is not None else ""
    serve = [f"llama-server -m model-{qtype}.gguf {_llama_slots(ctx)}{offload}", f"anyquant serve model-{qtype}.gguf"]
    if ctx.checkpoint_format == "gguf":
        return [f"llama-quantize --allow-requantize {_q(m)} model-{qtype}.gguf {qtype}", *serve]
    if ctx.checkpoint_format not in (None, "dense"):  # llama.cpp cannot convert it; anyquant runs it as it is
        return [f"anyquant serve {_q(m)}"]
    return [
        f"python convert_hf_to_gguf.py {_q(m)} --outtype f16 --outfile model-f16.gguf",
        f"llama-quantize model-f16.gguf model-{qtype}.gguf {qtype}",
        *serve,
    ]


def _llama_slots(ctx: _Ctx) -> str:
    """llama-server's context flags: ``-c`` is shared by the ``-np`` parallel slots."""
    return f"-c {ctx.context * ctx.users} -np {ctx.users}" if ctx.users > 1 else f"-c {ctx.context}"


def _advise_local(ctx: _Ctx) -> Advice:
    """Apple silicon or CPU: GGUF (llama.cpp: Metal or CPU), the largest type that fits."""
    if ctx.gpu.kind == "apple":
        usable = int(ctx.vram_bytes * APPLE_USABLE)
        where = f"{APPLE_USABLE:.0%} of {ctx.vram_gb:g} GB unified memory (macOS's default GPU limit)"
    else:
        usable = ctx.vram_bytes - CPU_RESERVED_BYTES
        where = f"{ctx.vram_gb:g} GB RAM less {CPU_RESERVED_BYTES / GiB:g} GiB for the system"
    engine = "llama.cpp (Metal)" if ctx.gpu.kind == "apple" else "llama.cpp (CPU)"
    if ctx.checkpoint_format == "gguf" and not isinstance(ctx.model, Mapping):
        as_is = _gguf_as_is(ctx, usable, where, engine)
        if as_is is not None:
            return as_is
    found = _largest_gguf(ctx, usable)
    if found is None:
        name, bpw = GGUF_TYPES[-1]
        e = _gguf_est(ctx, bpw, "fp16", batch=ctx.users)
        return _gguf_advice(
            ctx,
            e,
            name,
            engine=engine,
            fits=False,
            gpus=1,
            reasons=[f"even GGUF {name} needs {format_gb(e.total_bytes).strip()}, more than {where}"],
            alternatives=["a smaller model", "a machine with more memory", "a shorter context"],
        )
    name, bpw, e = found
    reasons = [
        _no_cuda(ctx),
        f"{name} (~{bpw:g} bits/weight) is the largest type that fits: {format_gb(e.total_bytes).strip()} of {where}",
        f"decode is memory-bound: about {_tok_s(_read_per_token(ctx, e), ctx.gpu.bandwidth_gbs):.1f} tokens/s at "
        f"~{ctx.gpu.bandwidth_gbs:g} GB/s",
    ]
    return _gguf_advice(
        ctx,
        e,
        name,
        engine=engine,
        gpus=1,
        reasons=reasons,
        commands=_gguf_commands(ctx, name, 99 if ctx.gpu.kind == "apple" else None),
    )


def _gguf_as_is(ctx: _Ctx, usable: int, where: str, engine: str) -> Advice | None:
    """The checkpoint is a GGUF file already: run it as it is when it fits."""
    assert not isinstance(ctx.model, Mapping)
    e = estimate(ctx.model, context=ctx.context, batch=ctx.users)
    if e.total_bytes > usable:
        return None
    reasons = [
        _no_cuda(ctx),
        f"the checkpoint is GGUF already ({e.bits:g} bits/weight) and fits: {format_gb(e.total_bytes).strip()} of {where}",
    ]
    return _gguf_advice(
        ctx,
        e,
        None,
        engine=engine,
        gpus=1,
        reasons=reasons,
        commands=[
            f"llama-server -m {_q(str(ctx.model))} {_llama_slots(ctx)}",
            f"anyquant serve {_q(str(ctx.model))}",
        ],
    )


def _offload_plan(ctx: _Ctx, qtype: str = "Q4_K_M") -> Advice | None:
    """GGUF with some layers on the CPU: what fits on the GPU, and what it costs in speed."""
    bpw = dict(GGUF_TYPES)[qtype]
    e = _gguf_est(ctx, bpw, "fp16", ctx.gpus, ctx.users)
    layer_bytes = ctx.shape.linear_params * bpw / 8 / ctx.shape.layers
    head_bytes = (ctx.shape.head_params or ctx.shape.embed_params) * bpw / 8
    room = (ctx.vram_bytes * ctx.gpus - ctx.gpus * OVERHEAD_BYTES) / (1 + MARGIN_FRACTION) - e.kv_bytes - head_bytes
    gpu_layers = max(0, min(ctx.shape.layers, int(room // layer_bytes)))
    cpu_bytes = (ctx.shape.layers - gpu_layers) * layer_bytes
    gpu_bytes = gpu_layers * layer_bytes + head_bytes
    ram_needed = cpu_bytes + e.embedding_bytes + CPU_RESERVED_BYTES
    if ctx.ram_bytes is not None and ram_needed > ctx.ram_bytes:
        return None
    active = (ctx.shape.active_linear_params or ctx.shape.linear_params) / ctx.shape.linear_params  # MoE: read share
    tok_s = 1 / (
        (gpu_layers * layer_bytes * active + head_bytes) / (ctx.gpu.bandwidth_gbs * GB * ctx.gpus)
        + cpu_bytes * active / (RAM_BANDWIDTH_GBS * GB)
    )
    full = _tok_s(_read_per_token(ctx, e), ctx.gpu.bandwidth_gbs, ctx.gpus)
    device_bytes = int(gpu_bytes + e.kv_bytes + margin_bytes(e.kv_bytes + int(gpu_bytes), ctx.gpus))
    if device_bytes > ctx.vram_bytes * ctx.gpus:  # not even the head and the KV cache fit: no plan
        return None
    reasons = [
        f"{gpu_layers} of {ctx.shape.layers} layers fit on the GPU; {ctx.shape.layers - gpu_layers} layers "
        f"({format_gb(cpu_bytes).strip()}) run from system RAM (needs {format_gb(ram_needed).strip()} of RAM)",
        f"expected cost: decode about {tok_s:.1f} tokens/s (memory-bound: {ctx.gpu.bandwidth_gbs:g} GB/s GPU, "
        f"~{RAM_BANDWIDTH_GBS:g} GB/s RAM assumed) instead of ~{full:.0f} tokens/s if it all fit in VRAM",
    ]
    return _gguf_advice(
        ctx,
        e,
        qtype,
        engine="llama.cpp (CUDA + CPU offload)",
        expected_decode_tok_s=tok_s,
        reasons=reasons,
        device_bytes=device_bytes,
        commands=_gguf_commands(ctx, qtype, gpu_layers),
        offload={
            "gpu_layers": gpu_layers,
            "cpu_layers": ctx.shape.layers - gpu_layers,
            "cpu_bytes": int(cpu_bytes),
            "ram_needed_bytes": int(ram_needed),
            "ram_bandwidth_gbs": RAM_BANDWIDTH_GBS,
        },
    )


def _too_big(ctx: _Ctx, why: str) -> Advice:
    off = _offload_plan(ctx)
    if off is None:
        e = _gguf_est(ctx, dict(GGUF_TYPES)["Q4_K_M"], "fp16", batch=ctx.users)
        return _gguf_advice(
            ctx,
            e,
            "Q4_K_M",
            engine="llama.cpp",
            fits=False,
            bits=None,
            reasons=[
                why,
                "and no offload plan fits either: the part left on the CPU exceeds the given RAM, or the head and "
                f"the KV cache alone ({format_gb(e.kv_bytes).strip()} for {ctx.context} tokens x {ctx.users}) exceed the VRAM",
            ],
            alternatives=["more GPUs", "more RAM", "a smaller model"],
        )
    off.reasons.insert(0, why)
    off.alternatives.append("a second GPU: more layers (or all) on GPU; with Ampere+, EXL3 tensor parallel")
    return off


def _advise_pre_ampere(ctx: _Ctx) -> Advice:
    """Turing/Volta: no EXL3 kernels; GPTQ 4-bit if it fits, else GGUF (fully on GPU, or offloaded)."""
    cc = ctx.gpu.compute_capability or (0, 0)
    why_not_exl3 = (
        f"{ctx.gpu.name} is {ctx.gpu.arch} (sm_{cc[0]}{cc[1]}): exllamav3's EXL3 kernels need Ampere (sm_80)+ "
        "(exllamav3#44), so GPTQ or GGUF"
    )
    e = _est(ctx, W4_G128_BPW, "fp16", 16, ctx.users)
    usable = ctx.vram_bytes * ctx.gpus
    gguf = _largest_gguf(ctx, usable)
    if e.total_bytes <= usable:
        m = _model_args(ctx)
        out = m if ctx.checkpoint_format == "gptq" else f"{m}-gptq-4bit"
        notes: list[str] = []
        commands = _from_source(ctx, out, "gptq", 4, [f"anyquant serve {_q(out)}"], notes)
        alternatives = (
            [f"GGUF {gguf[0]} on llama.cpp (CUDA) also fits ({format_gb(gguf[2].total_bytes).strip()})"] if gguf else []
        )
        return _advice(
            ctx,
            format="gptq",
            engine="gptqmodel / vLLM (--quantization gptq)",
            bits=W4_G128_BPW,
            quant_type="4-bit g128 sym",
            kv_dtype="fp16",
            tensor_parallel=ctx.gpus,
            fits=True,
            estimate=e,
            expected_decode_tok_s=_tok_s(_read_per_token(ctx, e), ctx.gpu.bandwidth_gbs, ctx.gpus),
            reasons=[
                why_not_exl3,
                f"GPTQ 4-bit g128 fits: {format_gb(e.total_bytes).strip()} of {ctx.gpus} x {ctx.vram_gb:g} GB; "
                "symmetric 4-bit g128 without act-order is the most portable GPTQ (vLLM, transformers, gptqmodel)",
                f"{ctx.gpu.arch} has no bf16: run in float16",
                *notes,
            ],
            commands=commands,
            alternatives=alternatives,
        )
    if gguf is not None:
        name, bpw, ge = gguf
        return _gguf_advice(
            ctx,
            ge,
            name,
            engine="llama.cpp (CUDA)",
            devices=ctx.gpus,
            reasons=[
                why_not_exl3,
                f"GPTQ 4-bit needs {format_gb(e.total_bytes).strip()}: too big; GGUF {name} "
                f"(~{bpw:g} bits/weight) fits fully on the GPU ({format_gb(ge.total_bytes).strip()})",
            ],
            commands=_gguf_commands(ctx, name, 99),
        )
    return _too_big(ctx, why_not_exl3 + f"; even GGUF {GGUF_TYPES[-1][0]} does not fit in VRAM")


def _resolve_model(model: str | Path | Mapping[str, Any]) -> tuple[ModelShape, str, str | None]:
    w = weights_of(model, 4.0, 16.0) if not isinstance(model, Mapping) else None
    if w is not None:
        fmt = w.format if w.source == "headers" else None
        return w.shape, w.shape.name, fmt
    assert isinstance(model, Mapping)
    shape = model_shape(model, str(model.get("_name_or_path", "model")))
    return shape, shape.name, None


def advise(
    gpu: str,
    vram_gb: float | None = None,
    users: int = 1,
    model: str | Path | Mapping[str, Any] | None = None,
    gpus: int = 1,
    *,
    context: int = 8192,
    ram_gb: float | None = None,
) -> Advice:
    """What to run where, in this order:

    1. Apple silicon or CPU -> GGUF (llama.cpp), the largest type that fits.
    2. Many concurrent users (>= 4) -> AWQ/GPTQ 4-bit served by vLLM, with the right
       ``--quantization`` and tensor parallel size.
    3. Pre-Ampere CUDA (Turing, Volta) -> GPTQ 4-bit if it fits, else GGUF.
    4. Ampere or newer, few users -> EXL3 at the largest bpw that fits (quantized KV if it helps).
    5. Too big for VRAM -> a lower bpw (with its quality cost), or GGUF with CPU offload (with its
       speed cost).

    ``vram_gb`` is per GPU (default: the table's); for Apple/CPU it is unified memory / RAM.
    """
    if model is None:
        raise SizingError("advise needs a model: a checkpoint path, a config.json path or a config dict")
    for name, value in (("users", users), ("gpus", gpus), ("context", context)):
        check_count(name, value)
    check_gb("vram_gb", vram_gb)
    check_gb("ram_gb", ram_gb)
    if not isinstance(gpu, str):
        raise SizingError(f"gpu must be a name such as 'RTX 4090' or 'CPU', got {gpu!r}")
    spec = find_gpu(gpu, vram_gb)
    vram = vram_gb if vram_gb is not None else spec.vram_gb
    if vram is None:
        raise SizingError(f"{spec.name}: pass --vram (the {'unified memory' if spec.kind == 'apple' else 'RAM'} in GB)")
    shape, label, fmt = _resolve_model(model)
    ctx = _Ctx(
        gpu=spec,
        vram_bytes=int(vram * GiB),
        vram_gb=vram,
        gpus=gpus if spec.kind in ("cuda", "rocm") else 1,
        users=users,
        context=context,
        shape=shape,
        model=model,
        model_label=label,
        checkpoint_format=fmt,
        ram_bytes=int(ram_gb * GiB) if ram_gb is not None else None,
    )
    advice = _decide(ctx)
    if spec.name not in {g.name for g in GPUS} and spec.kind == "cuda":
        advice.reasons.insert(
            0,
            f"{spec.name!r} is not in anyquant's GPU table: taken as a CUDA GPU of Ampere or newer with the "
            f"{vram:g} GB given, ~{spec.bandwidth_gbs:g} GB/s assumed",
        )
    return advice


def _decide(ctx: _Ctx) -> Advice:
    spec, users, gpus, vram = ctx.gpu, ctx.users, ctx.gpus, ctx.vram_gb
    if spec.kind in ("apple", "cpu"):
        return _advise_local(ctx)
    if users >= MANY_USERS or spec.kind == "rocm":  # ROCm: vLLM (no EXL3 kernels there)
        return _advise_vllm(ctx)
    if not spec.ampere_or_newer:
        return _advise_pre_ampere(ctx)
    found = _advise_exl3(ctx)
    if found is not None:
        return found
    return _too_big(ctx, f"even EXL3 at {EXL3_BPW[-1]:g} bpw with a q4 cache does not fit in {gpus} x {vram:g} GB")
