"""EXL3 on CPU: the pure-torch reference decoder, the CPU encoder, and EXL3 vs GPTQ at about 4 bpw.

Three tables (a fourth on request), all measured in this process, best of N (the machine's cores are shared):

1. **Decode**: weights/s of the reference decoder on a 4096x4096 K=4 layer (random trellis, mul1
   codebook), with one torch thread and with the default thread count. Rows: ``decode_exl3``
   alone (trellis -> fp16 ``[out, in]``); ``EXL3Linear(mode="dequantized")`` construction (the
   ``dequantized`` backend's load: decode + fp32 cache); one-token forwards of
   ``EXL3Linear(mode="reference")`` (the ``reference`` backend: decode + GEMV on every call) and of
   the dequantized layer (a dense GEMV, for comparison).
2. **Encode**: weights/s of ``encode_exl3`` (K=4, mul1, default global scale, no Hessian) on a
   random ``--enc-size`` square layer, on one thread (``--enc-threads 1,2`` adds two: intra-op
   threads barely help the Viterbi loop and collapse on a busy machine).
3. **Quality**: SmolLM2-135M-Instruct (the packaged GGUF exported to a dense HF folder, cached
   under ``.cache/bench/``). The encoder runs a few thousand weights/s per core, so only a subset of
   the decoder's linear layers is replaced (``--layers`` x ``--proj``; the rest stays dense):
   - EXL3 K=4 (4.0 bpw before padding and ``suh``/``svh``), encoded here by ``encode_exl3`` and
     decoded by ``EXL3Linear`` (``--exl3 plain``);
   - GPTQ 4-bit g64 sym, the same layers taken from the GPTQModel checkpoint of ``bench/gptq.py``
     (32 x 256 calibration tokens; built and cached on first use, about 4 minutes), dequantized
     by the gptq plugin's ``GPTQLinear``;
   - the same EXL3 K=4 encoded with LDLQ (``--exl3 ldlq``), the input Hessians collected from the
     calibration GPTQ used (the same mix, 32 x 256 tokens) on the dense model;
   - round-to-nearest 4-bit g64 sym (GPTQ's format and grid, no calibration), the uncalibrated
     baseline of the plain EXL3 row.
   Perplexity on ``--ppl-tokens`` held-out wiki tokens (512-token windows, fp32, ``--threads``), the relative
   weight error ``||W - W_hat|| / ||W||`` of each encoded layer, and the exact stored bits per
   weight of the subset (every stored tensor's bytes over the unpadded weight count).

4. **Model** (``--parts model``, not in the default set): the ``cpu-fast``, ``dequantized`` and ``reference``
   backends on SmolLM2-135M's shape as EXL3 K=4 with random trellises (timings and memory: load, RSS,
   prefill and decode tokens/s), each in a fresh process, against the dense model in float32.
5. **Weights** (``--parts weights``, not in the default set): ``cpu-fast``'s two forms of a decoded linear
   (``cpu_fast_weights="bfloat16"``, prepacked for oneDNN; ``"q8_0"``, Q8_0 blocks on the compiled kernel) against
   the exact ``dequantized`` backend, in one process: on the random-trellis model of part 4, the logits' error
   (max abs over the max |logit|, the fitted gain ``|g - 1|``), greedy agreement, the bytes held, and decode
   ms/token and 512-token prefill tokens/s with the two forms alternating (median of ``--repeat``); and on a trained
   model's weights as EXL3 would decode them (a proxy: SmolLM2-135M's weights plus K=4-level noise, 7 % of each
   row's rms, rounded to float16, each linear built by core's engine from the plugin's layouts), the same errors
   and perplexity on 2,048 held-out wiki tokens in 64-token windows (the decode kernels' rows).
6. **Embed** (``--parts embed``, not in the default set): the token embedding ring-coded as exllamav3 1.6's
   ``--embed_bits`` stores it (``--embed-k``), on the rows the perplexity text uses: bytes per row, relative
   error, encode weights/s, decode time, perplexity.

SmolLM2 is 576 wide: EXL3 pads every dim to a multiple of 128 (576 -> 640, 192 -> 256) and
encodes, stores and decodes the padding, and GPTQ cannot use group 128 (576 = 4.5 x 128).

    python bench/exl3.py [--layers 15] [--proj all] [--ppl-tokens 4096] [--repeat 3]
                         [--enc-size 256] [--enc-threads 1] [--threads 1] [--parts decode,encode,quality]
                         [--exl3 plain,ldlq] [--k 4] [--embed-k 3,4,5] [--parts model,weights,embed]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _measure import (
    CACHE,
    CALIBRATION,
    checkpoint_bytes,
    corpus_text,
    dense_model,
    machine,
    markdown_table,
    quantize_seconds,
    quantized_model,
    run_rows,
)

if TYPE_CHECKING:
    import torch

PROJECTIONS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
K_BITS = 4
CODEBOOK = "mul1"
GPTQ_BITS, GPTQ_GROUP = 4, 64
WINDOW = 512


def _best_s(fn: Callable[[], Any], repeat: int, warmup: bool = True) -> float:
    """Best wall time of ``repeat`` calls (after one untimed call when ``warmup``)."""
    if warmup:
        fn()
    best = math.inf
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _thread_counts() -> list[int]:
    """One thread, then torch's default count when that is more."""
    import torch

    default = torch.get_num_threads()
    return [1] if default == 1 else [1, default]


# ---------------------------------------------------------------------------------------------- decode


def decode_table(size: int, repeat: int) -> str:
    """Weights/s of the reference decoder on a random ``size`` x ``size`` K=4 layer."""
    import torch

    from anyquant_exl3.dequant import decode_exl3
    from anyquant_exl3.qlinear import EXL3Linear

    gen = torch.Generator().manual_seed(0)
    trellis = torch.randint(-(2**15), 2**15, (size // 16, size // 16, 16 * K_BITS), dtype=torch.int16, generator=gen)
    suh = (torch.randn(size, generator=gen) * 0.02).half()
    svh = torch.randn(size, generator=gen).abs().half()
    x = torch.randn(1, size, generator=gen)
    numel = size * size

    def layer(mode: str) -> EXL3Linear:
        return EXL3Linear(trellis, suh, svh, None, codebook=CODEBOOK, in_features=size, out_features=size, mode=mode)

    reference, dequantized = layer("reference"), layer("dequantized")
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("`decode_exl3` -> fp16 [out, in]", lambda: decode_exl3(trellis, suh, svh, codebook=CODEBOOK)),
        ('`EXL3Linear(mode="dequantized")` build (load: decode + fp32 cache)', lambda: layer("dequantized")),
        ('`EXL3Linear(mode="reference")` forward, 1 token (decode + GEMV)', lambda: reference(x)),
        ('`EXL3Linear(mode="dequantized")` forward, 1 token (dense fp32 GEMV)', lambda: dequantized(x)),
    ]
    lines = [
        f"Decode: {size}x{size} K={K_BITS} ({CODEBOOK}, random trellis), best of {repeat}",
        "",
        "| path | threads | best ms | weights/s |",
        "|---|---|---|---|",
    ]
    saved = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for name, fn in cases:
                for threads in _thread_counts():
                    torch.set_num_threads(threads)
                    n = repeat * 10 if "dense fp32 GEMV" in name else repeat
                    s = _best_s(fn, n)
                    lines.append(f"| {name} | {threads} | {s * 1e3:.2f} | {numel / s / 1e6:.1f} M |")
    finally:
        torch.set_num_threads(saved)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- encode


def encode_table(size: int, repeat: int, thread_counts: list[int]) -> str:
    """Weights/s of ``encode_exl3`` on a random ``size`` x ``size`` layer (K=4)."""
    import torch

    from anyquant_exl3.encode import encode_exl3

    weight = torch.randn(size, size, generator=torch.Generator().manual_seed(1)) * 0.02
    lines = [
        f"Encode: `encode_exl3` K={K_BITS} ({CODEBOOK}, default global scale, no Hessian), random {size}x{size} "
        f"layer ({size * size // 256} tiles), best of {repeat}",
        "",
        "| threads | best s | weights/s | tiles/s |",
        "|---|---|---|---|",
    ]
    for threads in thread_counts:
        s = _best_s(partial(encode_exl3, weight, K_BITS, codebook=CODEBOOK, num_threads=threads), repeat, False)
        lines.append(f"| {threads} | {s:.2f} | {size * size / s:,.0f} | {size * size / 256 / s:.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- quality


@dataclass
class Variant:
    """One way of replacing the subset: its weights, stored bytes and how long it took."""

    name: str
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    stored_bytes: int = 0
    #: the bytes without EXL3's padding to multiples of 128 (what a 128-aligned model pays)
    unpadded_bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    #: column title in the per-layer table
    short: str = ""


def rtn_gptq_grid(weight: torch.Tensor, bits: int = GPTQ_BITS, group: int = GPTQ_GROUP) -> torch.Tensor:
    """Round-to-nearest on GPTQ's symmetric grid (GPTQModel ``Quantizer`` with ``sym=True``, no MSE
    search): per group of ``group`` input columns, scale ``2·max|w| / (2**bits - 1)`` stored in fp16,
    zero point ``2**(bits - 1)``. ``weight`` is ``[out, in]``; returns the dequantized fp32 weight."""
    import torch

    out_f, in_f = weight.shape
    w = weight.float().reshape(out_f, in_f // group, group)
    maxq = 2**bits - 1
    zero = (maxq + 1) / 2
    scale = (2 * w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / maxq).half().float()
    q = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
    return ((q - zero) * scale).reshape(out_f, in_f)


def rtn_bytes(shape: tuple[int, int], bits: int = GPTQ_BITS, group: int = GPTQ_GROUP) -> int:
    """Bytes of the same layer stored as GPTQ would store it (qweight, qzeros, fp16 scales, g_idx)."""
    out_f, in_f = shape
    groups = in_f // group
    return in_f * out_f * bits // 8 + groups * out_f * bits // 8 + groups * out_f * 2 + in_f * 4


def subset_names(layers: list[int], projs: list[str]) -> list[str]:
    return [f"model.layers.{i}.{PROJECTIONS[p]}" for i in layers for p in projs]


def subset_hessians(model: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """The subset's input Hessians from the calibration GPTQ used (``CALIBRATION``), as ``quantize`` collects them."""
    from anyquant.protocols import QuantizeSpec
    from anyquant_exl3.hessian import capture_hessians
    from anyquant_tools.quantize import calibration_batch, calibration_texts

    spec = QuantizeSpec(
        method="exl3",
        calibration=CALIBRATION["calibration"],
        calibration_samples=CALIBRATION["calibration_samples"],
        calibration_seq_len=CALIBRATION["calibration_seq_len"],
    )
    ids = calibration_batch(model.tokenizer, calibration_texts(spec), spec.calibration_seq_len)
    return capture_hessians(model.module, ids, names)


def encode_subset(
    dense: dict[str, torch.Tensor], seed: int, hessians: dict[str, torch.Tensor] | None, k_bits: float = K_BITS
) -> Variant:
    """EXL3 at ``k_bits`` (K=4 by default; half steps with mul1) through the plugin: ``encode_exl3`` (LDLQ when
    given Hessians) then ``EXL3Linear.dequantize`` (one thread)."""
    from anyquant_exl3.encode import encode_exl3
    from anyquant_exl3.qlinear import EXL3Linear

    how = "no Hessian" if hessians is None else f"LDLQ, {CALIBRATION['calibration_samples']} x 256 calibration tokens"
    var = Variant(
        f"EXL3 K={k_bits:g} {CODEBOOK}, anyquant CPU encoder ({how})", short="EXL3" + (" LDLQ" if hessians else "")
    )
    for i, (name, w) in enumerate(dense.items()):
        t0 = time.perf_counter()
        hessian = None if hessians is None else hessians[name]
        enc = encode_exl3(w, k_bits, codebook=CODEBOOK, seed=seed + i, num_threads=1, hessian=hessian)
        var.seconds[name] = time.perf_counter() - t0
        var.stored_bytes += sum(t.numel() * t.element_size() for t in enc.values())
        var.unpadded_bytes += int(w.numel() * k_bits) // 8 + 2 * sum(w.shape) + 4  # trellis, suh + svh, marker
        layer = EXL3Linear(
            enc["trellis"],
            enc["suh"],
            enc["svh"],
            None,
            codebook=CODEBOOK,
            in_features=w.shape[1],
            out_features=w.shape[0],
        )
        var.weights[name] = layer.dequantize().float()
        pad = enc["trellis"].shape[0] * enc["trellis"].shape[1] * 256
        print(
            f"# encoded {name} {tuple(w.shape)} (padded {pad:,} weights) in {var.seconds[name]:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return var


def gptq_subset(path: Path, names: list[str]) -> Variant:
    """The subset's weights from the GPTQModel checkpoint, dequantized by the gptq plugin."""
    import anyquant

    model = anyquant.load(path, backend="reference", dtype="float32")
    probe = anyquant.Probe.open(path)
    var = Variant(f"GPTQ {GPTQ_BITS}-bit g{GPTQ_GROUP} sym (GPTQModel, 32 x 256 calibration tokens)", short="GPTQ")
    for name in names:
        var.weights[name] = model.module.get_submodule(name).dequantize().float()
        var.stored_bytes += sum(
            t.nbytes for key, t in probe.tensors.items() if key.rsplit(".", 1)[0] == name and "bias" not in key
        )
    var.unpadded_bytes = var.stored_bytes
    return var


def rtn_subset(dense: dict[str, torch.Tensor]) -> Variant:
    var = Variant(f"RTN {GPTQ_BITS}-bit g{GPTQ_GROUP} sym (GPTQ's grid, no calibration)", short="RTN")
    for name, w in dense.items():
        var.weights[name] = rtn_gptq_grid(w)
        var.stored_bytes += rtn_bytes((w.shape[0], w.shape[1]))
    var.unpadded_bytes = var.stored_bytes
    return var


def relative_error(dense: dict[str, torch.Tensor], approx: dict[str, torch.Tensor], names: list[str]) -> float:
    """``||W - W_hat|| / ||W||`` over the named layers together (Frobenius)."""
    num = sum(float((dense[n] - approx[n]).square().sum()) for n in names)
    den = sum(float(dense[n].square().sum()) for n in names)
    return math.sqrt(num / den)


def perplexity_with(model: Any, ids: list[int], weights: dict[str, torch.Tensor] | None) -> float:
    """Perplexity with the subset's weights swapped in (restored afterwards)."""
    import anyquant

    saved: dict[str, torch.Tensor] = {}
    try:
        for name, w in (weights or {}).items():
            linear = model.module.get_submodule(name)
            saved[name] = linear.weight.data
            linear.weight.data = w.to(linear.weight.dtype).contiguous()
        return float(anyquant.perplexity(model, ids, window=WINDOW)["perplexity"])
    finally:
        for name, w in saved.items():
            model.module.get_submodule(name).weight.data = w


def quality_tables(
    layers: list[int],
    projs: list[str],
    ppl_tokens: int,
    seed: int,
    threads: int,
    exl3_modes: list[str],
    k_bits: float = K_BITS,
) -> str:
    import torch

    import anyquant

    names = subset_names(layers, projs)
    dense_path, gptq_path = dense_model(), quantized_model("gptq", bits=GPTQ_BITS, group_size=GPTQ_GROUP)
    model = anyquant.load(dense_path, dtype="float32")
    dense = {n: model.module.get_submodule(n).weight.detach().float().clone() for n in names}
    total_linear = sum(
        m.weight.numel() for n, m in model.module.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n
    )
    subset = sum(w.numel() for w in dense.values())

    exl3 = []
    for hessians in ([None] if "plain" in exl3_modes else []) + (
        [subset_hessians(model, names)] if "ldlq" in exl3_modes else []
    ):
        t0 = time.perf_counter()
        exl3.append(encode_subset(dense, seed, hessians, k_bits))  # one thread: encode_exl3(num_threads=1)
        exl3[-1].total_s = time.perf_counter() - t0
    variants = [*exl3, gptq_subset(gptq_path, names), rtn_subset(dense)]

    torch.set_num_threads(threads)
    text = corpus_text("wiki", "evaluation")
    ids = model.tokenizer(text[: 8 * ppl_tokens], add_special_tokens=False)["input_ids"][:ppl_tokens]
    ppl_dense = perplexity_with(model, ids, None)
    ppls = [perplexity_with(model, ids, v.weights) for v in variants]

    padded = sum(-(-w.shape[0] // 128) * 128 * -(-w.shape[1] // 128) * 128 for w in dense.values())
    lines = [
        f"Quality: SmolLM2-135M-Instruct, layers {','.join(map(str, layers))} x {','.join(projs)}: "
        f"{len(names)} linears, {subset:,} weights ({subset / total_linear:.1%} of the decoder's "
        f"{total_linear:,} linear weights; {padded:,} after EXL3's padding), encoded on one thread in "
        + "; ".join(
            f"{v.total_s:.0f} s ({padded / v.total_s:,.0f} padded weights/s) {v.name.split('(')[-1][:-1]}" for v in exl3
        )
        + "; the rest dense. Perplexity on "
        f"{len(ids):,} held-out wiki tokens ({WINDOW}-token windows, fp32, {threads} thread(s)).",
        "",
        "| subset as | stored bpw | bpw without padding | rel. weight error | ppl | vs dense |",
        "|---|---|---|---|---|---|",
        f"| dense (bf16 source, fp32 compute) | 16 | 16 | 0 | {ppl_dense:.4f} | |",
    ]
    for var, ppl in zip(variants, ppls, strict=True):
        err = relative_error(dense, var.weights, names)
        bpw, unpadded = 8 * var.stored_bytes / subset, 8 * var.unpadded_bytes / subset
        lines.append(
            f"| {var.name} | {bpw:.3f} | {unpadded:.3f} | {err:.4f} | {ppl:.4f} | {(ppl - ppl_dense) / ppl_dense:+.2%} |"
        )
    lines += [
        "",
        "Per layer: relative weight error ||W - W_hat|| / ||W|| and EXL3 encode seconds",
        "",
        "| layer | [out, in] | " + " | ".join(v.short for v in variants) + " | EXL3 encode s |",
        "|---|---|" + "---|" * (len(variants) + 1),
    ]
    for name in names:
        errs = " | ".join(f"{relative_error(dense, v.weights, [name]):.4f}" for v in variants)
        short = name.removeprefix("model.layers.")
        secs = " / ".join(f"{v.seconds[name]:.0f}" for v in exl3)
        lines.append(f"| {short} | {list(dense[name].shape)} | {errs} | {secs} |")
    return "\n".join(lines)


def embed_table(ppl_tokens: int, ks: list[int], threads: int, seed: int) -> str:
    """Ring-coded token embedding (exllamav3 1.6 ``--embed_bits``) of SmolLM2, on the rows the text uses.

    Only the rows of the tokens in the perplexity text are encoded (the others are never looked up by it),
    so the perplexity is the one the fully ring-coded input embedding gives on that text; the head keeps
    the exact table (a tied source gets its own 16-bit head, as ``quantize(embed_bits=...)`` writes)."""
    import torch
    from torch import nn

    import anyquant
    from anyquant_exl3.ring import RingTable, encode_table

    model = anyquant.load(dense_model(), dtype="float32")
    torch.set_num_threads(threads)
    text = corpus_text("wiki", "evaluation")
    ids = model.tokenizer(text[: 8 * ppl_tokens], add_special_tokens=False)["input_ids"][:ppl_tokens]
    emb = model.module.get_input_embeddings()
    source = emb.weight.detach().clone()
    vocab, hidden = source.shape
    emb.weight = nn.Parameter(source.clone(), requires_grad=False)  # untied: the head keeps the exact table
    used = torch.tensor(sorted(set(ids)))
    ppl_dense = float(anyquant.perplexity(model, ids, window=WINDOW)["perplexity"])
    groups = -(-hidden // 256)
    lines = [
        f"Ring-coded token embedding, SmolLM2-135M-Instruct ({vocab} x {hidden}, {groups} rings of 256 per row): "
        f"the {len(used)} rows the {len(ids):,} held-out wiki tokens use, encoded by anyquant's CPU encoder "
        f"(one thread); perplexity with those rows decoded (the head keeps the exact table), {WINDOW}-token windows.",
        "",
        "| K | bytes/row (bf16: "
        + f"{2 * hidden})"
        + " | x bf16 | rel. error (used rows) | encode s | padded weights/s "
        "| decode 1 row us | decode 512 rows ms | ppl | vs dense |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in ks:
        t0 = time.perf_counter()
        ring, err = encode_table(source[used], k, seed=seed)
        secs = time.perf_counter() - t0
        table = RingTable(ring["trellis"], ring["signs"], k, hidden)
        decoded = table.decode().float()
        emb.weight.data[used] = decoded
        ppl = float(anyquant.perplexity(model, ids, window=WINDOW)["perplexity"])
        emb.weight.data[used] = source[used]
        one = _best_s(lambda table=table: table.rows(torch.tensor([[3]])), 20) * 1e6
        many = _best_s(lambda table=table: table.rows(torch.arange(512) % len(used)), 3) * 1e3
        row_bytes = ring["trellis"].shape[1] * 2
        lines.append(
            f"| {k} | {row_bytes} | {row_bytes / (2 * hidden):.3f} | {err:.4f} | {secs:.0f} | "
            f"{len(used) * groups * 256 / secs:,.0f} | {one:.0f} | {many:.1f} | {ppl:.4f} | "
            f"{(ppl - ppl_dense) / ppl_dense:+.2%} |"
        )
    lines.insert(4, f"| 16 (dense) | {2 * hidden} | 1 | 0 | | | | | {ppl_dense:.4f} | |")
    return "\n".join(lines)


def random_exl3_model(k: int = 4) -> Path:
    """SmolLM2-135M's shape as an EXL3 checkpoint with *random* trellises (K=``k``, mul1): a valid file that
    loads and runs at the real size (timings and memory only; its outputs are noise). Cached."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    out = CACHE / f"smollm2-135m-exl3-random-k{k}"
    if (out / "model.safetensors").is_file():
        return out
    dense = dense_model()
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, w in load_file(dense / "model.safetensors").items():
        if ".layers." not in name or not name.endswith("_proj.weight"):
            tensors[name] = w.contiguous()
            continue
        prefix, (n, kin) = name.removesuffix(".weight"), w.shape
        kp, np_ = -(-kin // 128) * 128, -(-n // 128) * 128
        tensors[f"{prefix}.trellis"] = torch.randint(-(2**15), 2**15, (kp // 16, np_ // 16, 16 * k), generator=gen).to(
            torch.int16
        )
        signs = lambda size: (torch.randint(0, 2, (size,), generator=gen) * 2 - 1).half()  # noqa: E731
        tensors[f"{prefix}.suh"] = signs(kp)
        tensors[f"{prefix}.svh"] = signs(np_) * float(w.float().pow(2).mean().sqrt())  # the dense weight's scale
        tensors[f"{prefix}.mul1"] = torch.tensor(-2082680531, dtype=torch.int32)
    save_file(tensors, out / "model.safetensors")
    cfg = json.loads((dense / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "exl3", "bits": float(k), "head_bits": 16, "codebook": "mul1"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in dense.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def model_table(threads: int) -> str:
    """anyquant's EXL3 CPU backends on a SmolLM2-sized model (random trellises), each row in a fresh process."""
    path = random_exl3_model()
    common = {"threads": threads, "text": "wiki", "text_part": "evaluation", "prefill_tokens": 512, "ppl_tokens": 0}
    rows = [
        ("anyquant cpu-fast", {"kind": "anyquant", "path": str(path), "backend": "cpu-fast", "decode_tokens": 128}),
        (
            "anyquant dequantized",
            {"kind": "anyquant", "path": str(path), "backend": "dequantized", "decode_tokens": 128},
        ),
        ("anyquant reference", {"kind": "anyquant", "path": str(path), "backend": "reference", "decode_tokens": 4}),
        (
            "dense fp32 (transformers)",
            {"kind": "transformers", "path": str(dense_model()), "dtype": "float32", "decode_tokens": 128},
        ),
    ]
    results = run_rows([(n, {**common, **c, "repeat": 2 if "reference" not in n else 1}) for n, c in rows])
    return (
        f"Model: SmolLM2-135M's shape as EXL3 K=4 mul1 with random trellises ({checkpoint_bytes(path) / 2**20:.0f} MiB; "
        f"timings and memory only), {threads} thread(s); prefill 512 tokens, decode after a 32-token prompt.\n\n"
        + markdown_table(results, checkpoint_bytes(path), "dense fp32 (transformers)")
    )


# ---------------------------------------------------------------------------------------------- weights

#: EXL3 K=4's relative rms weight error (the format doc's relative MSE ~0.005): the proxy's noise
PROXY_NOISE = 0.07
PROXY_PROMPTS = (
    "The capital of France is",
    "In 1905, Albert Einstein published",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. Once upon a time",
)


def _greedy(module: Any, ids: torch.Tensor, steps: int) -> tuple[list[int], float, float]:
    """``steps`` greedy tokens after the prompt ``ids`` (the native runtime's cache), with the wall and CPU
    milliseconds per decode step."""

    from anyquant_runtime.native import NativeCache

    cache = NativeCache(module.config.num_hidden_layers)
    nxt = module(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    tokens = [int(nxt)]
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps - 1):
        nxt = module(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        tokens.append(int(nxt))
    n = max(1, steps - 1)
    return tokens, (time.perf_counter() - wall) / n * 1e3, (time.process_time() - cpu) / n * 1e3


def _agreement(models: dict[str, Any], exact: Any, prompts: list[torch.Tensor], steps: int) -> dict[str, dict]:
    """Per form against ``exact``: the logits' error on the exact model's greedy path (teacher-forced, at most 64
    rows), the fitted gain, the argmax agreement there and the common prefix of free-running greedy tokens."""
    import torch

    out: dict[str, dict[str, Any]] = {
        f: {"rel": 0.0, "dot": 0.0, "norm": 0.0, "agree": 0, "pos": 0, "prefix": []} for f in models
    }
    for ids in prompts:
        ref = _greedy(exact.module, ids, steps)[0]
        seq = torch.cat([ids, torch.tensor([ref[:-1]])], dim=1)[:, :64]
        b = exact.module(seq).logits.double()
        for form, model in models.items():
            r = out[form]
            a = model.module(seq).logits.double()
            r["rel"] = max(r["rel"], float((a - b).abs().max() / b.abs().max()))
            r["dot"], r["norm"] = r["dot"] + float((a * b).sum()), r["norm"] + float((b * b).sum())
            r["agree"] += int((a.argmax(-1) == b.argmax(-1)).sum())
            r["pos"] += seq.shape[1]
            got = _greedy(model.module, ids, steps)[0]
            r["prefix"].append(next((i for i, (x, y) in enumerate(zip(got, ref, strict=True)) if x != y), steps))
    return out


def _held_mib(module: Any) -> float:
    """MiB the decoder layers' quantized linears hold: the fast form (``packed_bytes``) and the source kept beside
    it (the bfloat16 form keeps the trellis for the exact weight)."""
    total = 0
    for name, m in module.named_modules():
        if ".layers." in name and hasattr(m, "packed_bytes"):
            total += m.packed_bytes()
            source = getattr(m, "source", None)
            total += sum(b.nbytes for b in source.buffers()) if hasattr(source, "buffers") else 0
    return total / 2**20


def _proxy_linear(w16: torch.Tensor, weights: str) -> Any:
    """A float16 weight as cpu-fast builds a decoded EXL3 linear: the plugin's layouts, core's engine."""
    from anyquant_exl3.qlinear import decoded_layouts
    from anyquant_runtime.qlinear import QuantLinearBase

    class Decoded16(QuantLinearBase):
        def dequantize(self) -> torch.Tensor:
            return w16

        def packed_layouts(self) -> Any:
            return decoded_layouts(self, weights)

    return Decoded16(w16.shape[1], w16.shape[0]).to_fast_cpu()


def proxy_table(threads: int, ppl_tokens: int = 2048) -> str:
    """The trained-weight proxy: exact float32, bfloat16 and Q8_0 forms of the same float16 weights."""
    import torch
    from torch import nn

    import anyquant

    torch.set_num_threads(threads)
    path = dense_model()
    gen = torch.Generator().manual_seed(0)
    base = anyquant.load(path, dtype="float32")
    decoded: dict[str, torch.Tensor] = {}
    for name, mod in base.module.named_modules():
        if type(mod) is nn.Linear and ".layers." in name:
            w = mod.weight.detach().float()
            rms = w.pow(2).mean(dim=1, keepdim=True).sqrt()
            decoded[name] = (w + PROXY_NOISE * rms * torch.randn(w.shape, generator=gen)).half()
    tok = base.tokenizer
    del base

    def build(form: str) -> Any:
        model = anyquant.load(path, dtype="float32")
        for name, w16 in decoded.items():
            parent, _, attr = name.rpartition(".")
            if form == "exact":
                lin: nn.Module = nn.Linear(w16.shape[1], w16.shape[0], bias=False)
                lin.weight = nn.Parameter(w16.float(), requires_grad=False)
            else:
                lin = _proxy_linear(w16, form)
            setattr(model.module.get_submodule(parent), attr, lin)
        return model

    exact = build("exact")
    models = {form: build(form) for form in ("bfloat16", "q8_0")}
    ids = torch.tensor([tok.encode(corpus_text("wiki", "evaluation"))[: ppl_tokens + 1]])
    with torch.inference_mode():
        agree = _agreement(models, exact, [torch.tensor([tok.encode(p)]) for p in PROXY_PROMPTS], 32)
        nll = dict.fromkeys(["exact", *models], 0.0)
        for s in range(0, ids.shape[1] - 1, 64):
            x, y = ids[:, s : s + 64], ids[0, s + 1 : s + 65]
            x = x[:, : len(y)]
            for form, model in (("exact", exact), *models.items()):
                lp = torch.log_softmax(model.module(x).logits[0].double(), -1)
                nll[form] += float(-lp[torch.arange(len(y)), y].sum())
    ppl = {form: math.exp(v / (ids.shape[1] - 1)) for form, v in nll.items()}
    lines = [
        f"Trained-weight proxy: SmolLM2-135M's linears plus {PROXY_NOISE:.0%}-of-row-rms noise, rounded to float16 "
        f"(as EXL3 decodes); dense head; {threads} thread(s). Exact float32 perplexity {ppl['exact']:.4f} "
        f"({ids.shape[1] - 1} wiki tokens, 64-token windows).",
        "",
        "| form | logits max err / max logit | gain error \\|g-1\\| | teacher-forced argmax agreement | greedy tokens "
        "equal to the exact ones (of 32, per prompt) | perplexity (vs exact) |",
        "|---|---|---|---|---|---|",
    ]
    for form, r in agree.items():
        lines.append(
            f"| {form} | {r['rel']:.2e} | {abs(r['dot'] / r['norm'] - 1):.1e} | {r['agree']}/{r['pos']} | "
            f"{', '.join(map(str, r['prefix']))} | {ppl[form]:.4f} ({(ppl[form] - ppl['exact']) / ppl['exact']:+.2%}) |"
        )
    return "\n".join(lines)


def weights_table(threads: int, repeat: int, steps: int = 48) -> str:
    """The random-trellis model (part 4's) under cpu-fast's two forms against ``dequantized``, in one process."""
    import gc
    import os
    import statistics

    import torch

    import anyquant

    torch.set_num_threads(threads)
    path = random_exl3_model()
    load0 = os.getloadavg()[0]
    exact = anyquant.load(path, backend="dequantized")
    models, load_s = {}, {}
    for form in ("bfloat16", "q8_0"):
        t0 = time.perf_counter()
        models[form] = anyquant.load(path, backend="cpu-fast", cpu_fast_weights=form)
        load_s[form] = time.perf_counter() - t0
    tok = exact.tokenizer
    with torch.inference_mode():
        agree = _agreement(models, exact, [torch.tensor([tok.encode(p)]) for p in PROXY_PROMPTS[:2]], 32)
        del exact
        gc.collect()
        prompt = torch.tensor([tok.encode(PROXY_PROMPTS[3])])
        long = torch.tensor([tok.encode(corpus_text("wiki", "evaluation"))[:512]])
        wall: dict[str, list[float]] = {f: [] for f in models}
        cpu: dict[str, list[float]] = {f: [] for f in models}
        prefill: dict[str, list[float]] = {f: [] for f in models}
        for model in models.values():  # warm-up: the compiled step's first build, oneDNN's first calls
            _greedy(model.module, prompt, 4)
            model.module(long[:, :64])
        for _ in range(repeat):
            for form, model in models.items():
                _, w, c = _greedy(model.module, prompt, steps)
                wall[form].append(w)
                cpu[form].append(c)
                t0 = time.perf_counter()
                model.module(long)
                prefill[form].append(long.shape[1] / (time.perf_counter() - t0))
    load1 = os.getloadavg()[0]
    lines = [
        f"Random-trellis model (part 4's: SmolLM2-135M's shape, EXL3 K=4 mul1; its outputs are noise), {threads} "
        f"thread(s), load average {load0:.1f} -> {load1:.1f}; decode: {steps} greedy steps after a short prompt, "
        f"prefill: {long.shape[1]} tokens; the two forms alternating, median of {repeat}.",
        "",
        "| cpu_fast_weights | linears | MiB held by the linears | load s | logits max err / max logit | "
        "gain error \\|g-1\\| | teacher-forced argmax agreement | greedy tokens equal to dequantized's (of 32) | "
        "decode ms/token (wall) | decode CPU ms/token (all threads) | prefill tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for form, model in models.items():
        r = agree[form]
        lines.append(
            f"| {form} | {model.info['cpu_fast']['linears']} | {_held_mib(model.module):.0f} | {load_s[form]:.1f} | "
            f"{r['rel']:.2e} | {abs(r['dot'] / r['norm'] - 1):.1e} | {r['agree']}/{r['pos']} | "
            f"{', '.join(map(str, r['prefix']))} | {statistics.median(wall[form]):.1f} | "
            f"{statistics.median(cpu[form]):.1f} | {statistics.median(prefill[form]):.0f} |"
        )
    b, q = statistics.median(wall["bfloat16"]), statistics.median(wall["q8_0"])
    lines.append("")
    lines.append(
        f"Q8_0 decode speed-up over bfloat16: {b / q:.2f}x (wall), per-run ratios "
        + ", ".join(f"{x / y:.2f}" for x, y in zip(wall["bfloat16"], wall["q8_0"], strict=True))
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
# ---------------------------------------------------------------------------------------------- main


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="15", help="decoder layers to quantize (comma-separated)")
    ap.add_argument("--proj", default="all", help=f"projections: {','.join(PROJECTIONS)} or 'all'")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3, help="best of N for the decode and encode timings")
    ap.add_argument("--decode-size", type=int, default=4096)
    ap.add_argument("--enc-size", type=int, default=256)
    ap.add_argument(
        "--enc-threads",
        default="1",
        help="thread counts for the encode table (e.g. 1,2; more threads collapse on a busy machine)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the perplexity forwards")
    ap.add_argument("--seed", type=int, default=0, help="EXL3 sign seed (layer i uses seed + i)")
    ap.add_argument("--parts", default="decode,encode,quality")
    ap.add_argument("--k", type=float, default=K_BITS, help="EXL3 K of the quality rows (half steps: 1.5, 2.5, 3.5)")
    ap.add_argument("--exl3", default="plain,ldlq", help="EXL3 rows of the quality table: plain (no Hessian), ldlq")
    ap.add_argument("--embed-k", default="3,4,5", help="K of the ring-coded embedding rows (part 'embed')")
    args = ap.parse_args()
    projs = list(PROJECTIONS) if args.proj == "all" else _csv(args.proj)
    unknown = [p for p in projs if p not in PROJECTIONS]
    if unknown:
        ap.error(f"unknown projections {unknown}; choose from {list(PROJECTIONS)}")
    parts = _csv(args.parts)

    t0 = time.perf_counter()
    gptq = quantized_model("gptq", bits=GPTQ_BITS, group_size=GPTQ_GROUP) if "quality" in parts else None
    import torch

    print(f"# machine: {machine()}; torch threads by default: {torch.get_num_threads()}")
    if gptq is not None:
        print(f"# GPTQ checkpoint {gptq} (quantized once in {quantize_seconds(gptq) or 0:.0f} s, cached)")
    if "decode" in parts:
        print()
        print(decode_table(args.decode_size, args.repeat))
    if "encode" in parts:
        print()
        print(encode_table(args.enc_size, args.repeat, [int(t) for t in _csv(args.enc_threads)]))
    if "quality" in parts:
        print()
        layers = [int(x) for x in _csv(args.layers)]
        print(quality_tables(layers, projs, args.ppl_tokens, args.seed, args.threads, _csv(args.exl3), args.k))
    if "model" in parts:
        print()
        print(model_table(args.threads))
    if "weights" in parts:
        print()
        print(weights_table(args.threads, args.repeat))
        print()
        print(proxy_table(args.threads))
    if "embed" in parts:
        print()
        print(embed_table(args.ppl_tokens, [int(k) for k in _csv(args.embed_k)], args.threads, args.seed))
    print(f"\n# wall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
