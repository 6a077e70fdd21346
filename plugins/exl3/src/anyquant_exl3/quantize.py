"""EXL3 quantization: exllamav3's converter on CUDA, anyquant's own Hessian-aware encoder anywhere.

``quantizer_backend``: ``"exllamav3"`` runs exllamav3's own converter in a worker subprocess on
anyquant's calibration texts (:mod:`anyquant_exl3.exllamav3_convert`; needs exllamav3 and an Ampere+
GPU, a :class:`QuantizeError` otherwise); ``"anyquant"`` runs anyquant's encoder; ``"auto"`` (the
default) picks exllamav3's converter where its CUDA backend can run and anyquant's elsewhere.

anyquant's encoder: every decoder linear is encoded with :func:`anyquant_exl3.encode.encode_exl3`
(random signs + Hadamard regularisation, tail-biting Viterbi over the 16-bit trellis per 16x16 tile).
With ``ldlq=True`` (the default) the calibration texts run once through the dense model, every
linear's input Hessian ``E[x xᵀ]`` is collected (:mod:`anyquant_exl3.hessian`) and the tiles are
encoded with LDLQ error feedback, which minimises the layer's output error rather than its weight
error; ``ldlq=False`` skips the calibration (no transformers model is built). Fractional ``bits``
give mixed K per tensor, allocated as exllamav3's converter does (:func:`allocate_bits`: whole
groups raised by priority within the budget ``bits x weights``). The head stays 16-bit
(``head_bits=16``; exllamav3's converter quantizes it, 6 bits by default). ``embed_bits`` (1..8; default 16,
unquantized, as in exllamav3) stores the token embedding ring-coded, as exllamav3 1.6's ``--embed_bits`` does
(:func:`anyquant_exl3.ring.encode_table`; a source whose head is tied to the embedding gets its own 16-bit
``lm_head.weight``, the untouched table, so the head stays exact). The encoder runs about
5-12k weights/s per core: tiny and small models only. Option ``encode_device="cuda"`` runs the same
torch code on a GPU in batches of ``batch_tiles`` tiles (default: up to 256 within 2 GiB,
:func:`gpu_batch_tiles`; prepared, not yet run on a GPU).
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from anyquant.plugin import ParameterError, Probe, QuantizeError, QuantizeSpec

from .options import embed_bits

if TYPE_CHECKING:
    import torch

__all__ = [
    "ANYQUANT_ONLY_OPTIONS",
    "BACKEND_OPTIONS",
    "EXLLAMAV3_ONLY_OPTIONS",
    "QUANTIZER_BACKENDS",
    "EXL3Quantizer",
    "allocate_bits",
    "embed_bits",
    "quantizer_backend",
]

log = logging.getLogger(__name__)

VALID_K = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
CODEBOOKS = ("3inst", "mcg", "mul1")
#: Viterbi tiles per batch on a GPU: few, large kernel launches, within GPU_VITERBI_BYTES of step priors and
#: costs (4 MiB per tile at K=4, 32 MiB at K=1).
GPU_BATCH_TILES = 256
GPU_VITERBI_BYTES = 2 << 30


def gpu_batch_tiles(k_bits: float) -> int:
    """Default Viterbi batch on a GPU for bitrate ``k_bits``."""
    from .trellis import step_bits

    per_tile = 4 * sum((1 << 16) >> d for d in step_bits(k_bits)) + 8 * (1 << 16)
    return max(1, min(GPU_BATCH_TILES, GPU_VITERBI_BYTES // per_tile))


#: exllamav3's quantization groups of a Llama-style layer (``modules/attn.py``, ``modules/mlp.py``): linears of
#: one group always share K; attention groups rank before MLP groups (``q_priority`` 2 vs 1).
_QGROUPS = {
    "self_attn.q_proj": ("self_attn.qkv", 2),
    "self_attn.k_proj": ("self_attn.qkv", 2),
    "self_attn.v_proj": ("self_attn.qkv", 2),
    "self_attn.o_proj": ("self_attn.o", 2),
    "mlp.gate_proj": ("mlp.gu", 1),
    "mlp.up_proj": ("mlp.gu", 1),
    "mlp.down_proj": ("mlp.d", 1),
}
_LAYER = re.compile(r"^(.*?)\.(\d+)\.(.+)$")


def _rate_floor(bits: float, half_steps: bool) -> float:
    r = math.floor(bits * 2) / 2 if half_steps and bits < 4 else math.floor(bits)
    return float(max(1, min(8, r)))


def _rate_next(k: float, half_steps: bool) -> float:
    return float(min(8, k + (0.5 if half_steps and k < 4 else 1)))


def allocate_bits(names: list[str], sizes: list[int], bits: float, codebook: str = "mul1") -> list[float]:
    """K per tensor for an average of at most ``bits``, the way exllamav3's converter allocates
    (``conversion/allocation.py``, ``create_q_strategy`` without ``--hq``).

    Every tensor starts at ``bits`` rounded down to a rate the kernels have (half steps 1.5/2.5/3.5 with the
    mul1 codebook only); then, pass after pass, whole quantization groups (a layer's q/k/v, its o, its
    gate/up, its down) are raised one rate step while the budget ``int(bits x weights)`` allows: attention
    groups first, then MLP groups; within a priority the layers nearest either end of the stack first
    (they weigh most in the end-to-end error), then the lower layer. Tensors outside a Llama-style layer
    form their own group with the lowest priority.
    """
    half = codebook == "mul1"
    base = _rate_floor(bits, half)
    ks = [base] * len(names)
    budget = int(bits * sum(sizes))
    used = base * sum(sizes)
    groups: dict[str, list[int]] = {}
    meta: dict[str, tuple[int, str | None, int, int]] = {}
    for i, name in enumerate(names):
        match = _LAYER.match(name)
        stack, layer, local = (match.group(1), int(match.group(2)), match.group(3)) if match else (None, -1, name)
        group, priority = _QGROUPS.get(local, (local, 0))
        key = f"{stack}.{layer}.{group}" if match else name
        if key not in groups:
            groups[key] = []
            meta[key] = (priority, stack, layer, len(meta))
        groups[key].append(i)
    last: dict[str | None, int] = {}
    for _, stack, layer, _ in meta.values():
        last[stack] = max(last.get(stack, -1), layer)

    def order(key: str) -> tuple[int, int, int, int]:
        priority, stack, layer, idx = meta[key]
        dist = 0 if stack is None else min(layer, last[stack] - layer)
        return (-priority, dist, layer, idx)

    ranked = sorted(groups, key=order)
    while used < budget:
        raised = False
        for key in ranked:
            members = groups[key]
            cost = sum((_rate_next(ks[i], half) - ks[i]) * sizes[i] for i in members)
            if cost > 0 and used + cost <= budget:
                for i in members:
                    ks[i] = _rate_next(ks[i], half)
                used += cost
                raised = True
        if not raised:
            break
    return ks


def _encode_device(spec: QuantizeSpec) -> torch.device:
    """Where the encoder runs: option ``encode_device`` (default ``"cpu"``; ``"cuda"`` is far faster)."""
    import torch

    name = str(spec.options.get("encode_device", "cpu"))
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise QuantizeError(f"encode_device {name!r} is not a torch device: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QuantizeError(f"encode_device {name!r}: no CUDA GPU is visible here")
    return device


#: MoE routers (``mlp.gate``, Mixtral's ``block_sparse_moe.gate``, Qwen2-MoE's ``shared_expert_gate``): kept in
#: 16-bit float as exllamav3 keeps them, and transformers' router is no linear that a quantized module could replace
ROUTERS = frozenset({"gate", "router", "shared_expert_gate"})


def _linear_weights(probe: Probe) -> list[str]:
    return [
        name.removesuffix(".weight")
        for name, t in probe.tensors.items()
        if name.endswith(".weight")
        and len(t.shape) == 2
        and ".layers." in name
        and name.removesuffix(".weight").rpartition(".")[2] not in ROUTERS
    ]


@dataclass(frozen=True)
class _Target:
    """One linear to encode: its name in the output, the source weight it comes from, and which rows."""

    name: str
    source: str
    rows: tuple[int, int] | None  # None: the whole source weight
    numel: int


def _targets(probe: Probe) -> list[_Target]:
    """The linears to encode, with fused projections split as exllamav3 writes them (format doc §2.8:
    Phi-3's ``qkv_proj`` as ``q_proj``/``k_proj``/``v_proj``, ``gate_up_proj`` as ``gate_proj``/``up_proj``)."""
    from anyquant_runtime.parts import FUSED_PARTS, fused_sizes

    out = []
    for name in _linear_weights(probe):
        rows, cols = probe.tensors[f"{name}.weight"].shape
        parent, _, leaf = name.rpartition(".")
        members = FUSED_PARTS.get(leaf)
        if not members:
            out.append(_Target(name, name, None, rows * cols))
            continue
        start = 0
        for member, size in zip(members, fused_sizes(leaf, rows, probe.config or {}), strict=True):
            out.append(_Target(f"{parent}.{member}", name, (start, start + size), size * cols))
            start += size
        if start != rows:
            raise QuantizeError(f"{name}: the split sizes from config.json do not add up to its {rows} rows")
    return out


def _embedding_weight(probe: Probe) -> str | None:
    """The token embedding's tensor (Llama-family naming: ``...embed_tokens.weight``), or ``None``."""
    found = [n for n, t in probe.tensors.items() if n.endswith("embed_tokens.weight") and len(t.shape) == 2]
    return found[0] if len(found) == 1 else None


def _hessians(
    src: Path, names: list[str], spec: QuantizeSpec, progress: Callable[[float], None]
) -> dict[str, torch.Tensor] | None:
    """Input Hessians of ``names`` from the calibration texts run through the dense model (``None``: ldlq off)."""
    if not spec.options.get("ldlq", True):
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anyquant_tools import calibration_batch, calibration_texts

    from .hessian import capture_hessians

    samples = calibration_batch(AutoTokenizer.from_pretrained(src), calibration_texts(spec), spec.calibration_seq_len)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, trust_remote_code=False)
    model.eval()  # type: ignore[no-untyped-call]
    try:
        return capture_hessians(model, samples, names, progress=progress)
    finally:
        del model


#: options only one of the two quantizers reads: with ``quantizer_backend="auto"`` they choose it, and naming
#: the other one with them is an error (never silently ignored)
ANYQUANT_ONLY_OPTIONS = ("batch_tiles", "encode_device", "ldlq")
EXLLAMAV3_ONLY_OPTIONS = ("devices", "out_scales", "scaled_hessian")


#: the options of each quantizer that the other does not read (:func:`anyquant_tools.quantize.route_backend`)
BACKEND_OPTIONS: Mapping[str, frozenset[str]] = MappingProxyType(
    {"anyquant": frozenset(ANYQUANT_ONLY_OPTIONS), "exllamav3": frozenset(EXLLAMAV3_ONLY_OPTIONS)}
)
#: what ``quantizer_backend`` accepts (:func:`anyquant_tools.quantize.route_backend` checks it)
QUANTIZER_BACKENDS = ("auto", *BACKEND_OPTIONS)


def quantizer_backend(spec: QuantizeSpec) -> str:
    """``quantizer_backend`` resolved: ``"auto"`` is exllamav3's converter where its CUDA backend can run, else
    anyquant's own encoder, unless options only one of them reads were given (``encode_device``, ``ldlq``,
    ``batch_tiles``: anyquant's; ``devices``, ``out_scales``, ``scaled_hessian``: exllamav3's), which choose it.
    Options of the quantizer not chosen are a :class:`QuantizeError`, and so is exllamav3's converter where
    it cannot run. Never imports exllamav3 (that JIT-builds its extension)."""
    from anyquant_tools import route_backend

    from .exllamav3_kernels import backend_info

    chosen = route_backend(
        spec.options, BACKEND_OPTIONS, lambda: "exllamav3" if backend_info().available else "anyquant"
    )
    if chosen == "exllamav3":
        info = backend_info()
        if not info.available:
            theirs = [k for k in EXLLAMAV3_ONLY_OPTIONS if k in spec.options]
            explicit = spec.options.get("quantizer_backend") == "exllamav3"
            why = "quantizer_backend='exllamav3'" if explicit else f"options {theirs} (exllamav3's converter)"
            raise QuantizeError(f"{why} cannot run here: {info.reason}")
    return chosen


class EXL3Quantizer:
    method = "exl3"
    #: the ``quantize(..., **options)`` keywords this quantizer reads (any other is a QuantizeError)
    quantize_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "quantizer_backend": "'auto' (default: exllamav3's converter on CUDA, anyquant's encoder elsewhere; "
            "options only one of them reads choose it), 'exllamav3' or 'anyquant'",
            "codebook": "'mul1' (default), 'mcg' or '3inst'",
            "head_bits": "the LM head: 16 (anyquant's encoder; unquantized) or 1..8 (exllamav3's converter, default 6)",
            "embed_bits": "the token embedding: 16 (default, unquantized) or 1..8 (ring-coded)",
            "ldlq": "anyquant's encoder: Hessian-aware LDLQ from the calibration data (default True)",
            "encode_device": "anyquant's encoder: 'cpu' (default) or a torch device",
            "batch_tiles": "anyquant's encoder: 16x16 tiles per Viterbi batch",
            "out_scales": "exllamav3's converter: its out_scales mode (default 'auto')",
            "scaled_hessian": "exllamav3's converter: its scaled-Hessian option (default False)",
            "devices": "exllamav3's converter: the GPUs to use (default '0')",
        }
    )

    @staticmethod
    def check_flags(given: Mapping[str, Any]) -> None:
        """``anyquant quantize --method exl3``: ``--group-size`` is refused, not ignored."""
        if "group_size" in given:
            raise ParameterError("--group-size: exl3 has no groups (its scales are per channel); drop the flag")

    def validate(self, probe: Probe, spec: QuantizeSpec) -> None:
        if not 1 <= spec.bits <= 8:
            raise QuantizeError(f"EXL3 bits must be within 1..8, got {spec.bits}")
        if spec.desc_act or spec.sym is not None:
            given = "desc_act=True" if spec.desc_act else f"sym={spec.sym}"
            raise QuantizeError(
                f"{given}: EXL3 has no act-order and no zero points (trellis codes, per-channel suh/svh scales); "
                "drop it"
            )
        codebook = str(spec.options.get("codebook", "mul1")).lower()
        if codebook not in CODEBOOKS:
            raise QuantizeError(f"EXL3 codebook {codebook!r} is not one of {CODEBOOKS}")
        if not _linear_weights(probe):
            raise QuantizeError("no decoder-layer linear weights found to quantize")
        if embed_bits(spec) != 16 and _embedding_weight(probe) is None:
            raise QuantizeError("embed_bits: no single '...embed_tokens.weight' tensor to quantize in this checkpoint")
        if quantizer_backend(spec) == "exllamav3":
            head_bits = float(spec.options.get("head_bits", 6))
            if not (head_bits == 16 or 1 <= head_bits <= 8):
                raise QuantizeError(f"head_bits must be within 1..8 or 16, got {head_bits:g}")
            return
        head_bits = spec.options.get("head_bits", 16)
        if head_bits != 16:
            raise QuantizeError(
                "anyquant's CPU encoder keeps the head unquantized: head_bits=16 only for now "
                "(exllamav3's converter, quantizer_backend='exllamav3' on CUDA, quantizes it)"
            )
        _encode_device(spec)

    def quantize(
        self, src: Path, dst: Path, spec: QuantizeSpec, progress: Callable[[str, float], None] | None = None
    ) -> Path:
        if quantizer_backend(spec) == "exllamav3":
            return self._convert(src, dst, spec, progress)
        from safetensors import safe_open
        from safetensors.torch import save_file

        from .encode import HessianError, encode_exl3

        report = progress or (lambda stage, frac: None)
        probe = Probe.open(src)
        targets = _targets(probe)
        names = [t.name for t in targets]
        sizes = [t.numel for t in targets]
        codebook = str(spec.options.get("codebook", "mul1")).lower()
        ks = allocate_bits(names, sizes, float(spec.bits), codebook)
        seed = int(spec.options.get("seed", 0))
        device = _encode_device(spec)
        batch_tiles = spec.options.get("batch_tiles")
        out = dst / "model"
        out.mkdir(parents=True, exist_ok=True)
        sources = list(dict.fromkeys(t.source for t in targets))
        hessians = _hessians(src, sources, spec, lambda f: report("collecting input Hessians", 0.05 * f))
        tensors: dict[str, torch.Tensor] = {}
        quantized = set(sources)
        handles: dict[str, Any] = {
            h.file: safe_open(str(probe.root / h.file), framework="pt") for h in probe.safetensors
        }
        done, total = 0, sum(sizes)
        fallbacks = []
        parts_left = {s: sum(t.source == s for t in targets) for s in sources}
        source_weight: tuple[str, torch.Tensor] | None = None  # read once for all the parts of a split linear
        for i, (target, k) in enumerate(zip(targets, ks, strict=True)):
            name = target.name
            if source_weight is None or source_weight[0] != target.source:
                info = probe.tensors[f"{target.source}.weight"]
                source_weight = (target.source, handles[info.file].get_tensor(info.name))
            weight = source_weight[1]
            if target.rows is not None:
                weight = weight[target.rows[0] : target.rows[1]]
            weight = weight.float().to(device)
            report(f"encoding {name} (K={k:g})", 0.05 + 0.8 * done / total)
            batch = batch_tiles if batch_tiles is not None or device.type == "cpu" else gpu_batch_tiles(k)
            parts_left[target.source] -= 1
            hessian = None
            if hessians is not None:  # split parts share their input's; dropped after the last of them
                last = parts_left[target.source] == 0
                hessian = hessians.pop(target.source, None) if last else hessians.get(target.source)
            try:
                enc = encode_exl3(weight, k, codebook=codebook, seed=seed + i, batch_tiles=batch, hessian=hessian)
            except HessianError as exc:
                log.warning("%s: %s; encoded without the Hessian", name, exc)
                fallbacks.append(name)
                enc = encode_exl3(weight, k, codebook=codebook, seed=seed + i, batch_tiles=batch)
            tensors.update({f"{name}.{key}": value.cpu().contiguous() for key, value in enc.items()})
            done += sizes[i]
        embedding, ebits = _embedding_weight(probe), embed_bits(spec)
        if ebits != 16 and embedding is not None:
            from .ring import encode_table

            report(f"encoding {embedding} (K={ebits}, ring-coded)", 0.86)
            info = probe.tensors[embedding]
            table = handles[info.file].get_tensor(embedding)
            ring, err = encode_table(table, ebits, seed=seed, batch_tiles=batch_tiles)
            key = embedding.removesuffix(".weight")
            tensors.update({f"{key}.{part}": value for part, value in ring.items()})
            log.info("%s: ring-coded at K=%d, relative error %.4f", embedding, ebits, err)
            if "lm_head.weight" not in probe.tensors and bool((probe.config or {}).get("tie_word_embeddings")):
                tensors["lm_head.weight"] = table.contiguous()  # the tied head keeps the exact table
        for tname, info in probe.tensors.items():
            if tname.removesuffix(".weight") in quantized and tname.endswith(".weight"):
                continue
            if ebits != 16 and tname == embedding:
                continue
            value = handles[info.file].get_tensor(tname).contiguous()
            bias_of = tname.removesuffix(".bias")
            if not (tname.endswith(".bias") and bias_of in quantized):
                tensors[tname] = value
                continue
            for t in targets:  # a quantized linear's bias, fp16 as exllamav3 stores it (split with its weight)
                if t.source == bias_of:
                    part = value if t.rows is None else value[t.rows[0] : t.rows[1]]
                    tensors[f"{t.name}.bias"] = part.half().contiguous()
        report("writing", 0.88)
        save_file(tensors, str(out / "model.safetensors"))
        if hessians is None:
            method = "anyquant CPU encoder (no Hessian)"
        else:
            method = f"anyquant CPU encoder (LDLQ, {spec.calibration_samples} x {spec.calibration_seq_len} tokens)"
            if fallbacks:
                method += f"; {len(fallbacks)} linears without a Hessian"
        self._write_config(probe, out, ks, sizes, codebook, method, ebits)
        return out

    def _convert(self, src: Path, dst: Path, spec: QuantizeSpec, progress: Callable[[str, float], None] | None) -> Path:
        """exllamav3's converter in a worker subprocess, on anyquant's calibration texts."""
        from transformers import AutoTokenizer

        from anyquant_tools import calibration_texts, run_worker

        from . import exllamav3_convert as conv

        scratch = dst / ".scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        calibration = scratch / "calibration.safetensors"
        rows = conv.write_calibration(
            AutoTokenizer.from_pretrained(src), calibration_texts(spec), spec.calibration_seq_len, calibration
        )
        probe = Probe.open(src)
        layers = int((probe.config or {}).get("num_hidden_layers", 0))
        out = dst / "model"
        job = conv.job(src, out, spec, calibration, layers)
        job["cal_rows"] = min(job["cal_rows"], rows)
        run_worker("anyquant_exl3.exllamav3_convert", job, scratch=scratch, progress=progress)
        return out

    def _write_config(
        self, probe: Probe, out: Path, ks: list[float], sizes: list[int], codebook: str, method: str, ebits: int = 16
    ) -> None:
        from anyquant.plugin import __version__, thaw

        cfg: dict[str, Any] = thaw(probe.config) if probe.config is not None else {}
        avg = sum(k * n for k, n in zip(ks, sizes, strict=True)) / sum(sizes)
        qc = {
            "quant_method": "exl3",
            "version": f"anyquant-{__version__}",
            "bits": round(avg, 2),
            "head_bits": 16,
            "codebook": codebook,
            "out_scales": "always",
            "quantizer": method,
        }
        if ebits != 16:
            qc["embed_bits"] = ebits
            cfg["tie_word_embeddings"] = False  # the head has its own tensor now (as exllamav3 1.6 writes)
        if cfg.get("quantization_config"):
            qc["original_quantization_config"] = cfg["quantization_config"]
        cfg["quantization_config"] = qc
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        (out / "quantization_config.json").write_text(json.dumps(qc, indent=2))
        for name in probe.tokenizer_files:
            shutil.copy2(probe.root / name, out / name)
