"""``anyquant estimate``: memory for weights + KV cache (:mod:`anyquant_tools.advise` builds on it).

Weights: exact bytes from a checkpoint's headers (safetensors or GGUF); for a model not yet
quantized, from ``config.json`` shapes and a target ``bits`` (average bits per weight of the
decoder linears, overheads such as scales included; embeddings at 16 bits, the head at
``head_bits``). KV cache: ``2 (K and V) x layers x kv_heads x head_dim x bits/8`` bytes per token
(MLA: ``layers x (kv_lora_rank + qk_rope_head_dim)``), times context and batch. Quantized caches
store a 16-bit scale per 32 values (exllamav3's ``CacheLayer_quant``, llama.cpp ``q8_0``/``q4_0``):
``q4`` is 4.5 bits a value. A margin covers the CUDA context and activations.

Standard library only.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from anyquant.errors import AnyquantError
from anyquant.report import bits_per_weight
from anyquant.shape import ModelShape, SizingError, model_shape

__all__ = [
    "GB",
    "MARGIN_FRACTION",
    "OVERHEAD_BYTES",
    "Estimate",
    "GiB",
    "ModelShape",
    "SizingError",
    "Weights",
    "bits_per_weight",
    "check_count",
    "check_gb",
    "estimate",
    "estimate_for",
    "format_gb",
    "kv_bits",
    "margin_bytes",
    "model_shape",
    "weights_from_config",
    "weights_of",
]

log = logging.getLogger(__name__)

GiB = 1024**3
GB = 1000**3

#: bits per stored KV value: quantized caches carry a 16-bit scale per 32 values
KV_BITS: dict[str, float] = {
    "fp32": 32,
    "fp16": 16,
    "bf16": 16,
    "fp8": 8,
    "q8": 8.5,
    "q6": 6.5,
    "q5": 5.5,
    "q4": 4.5,
    "q3": 3.5,
    "q2": 2.5,
}
KV_ALIASES = {
    "float16": "fp16",
    "f16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "q8_0": "q8",
    "q4_0": "q4",
    "q5_0": "q5",
}
#: fixed per-device overhead (CUDA context, allocator slack, activations of a prefill chunk)
OVERHEAD_BYTES = GiB // 2
#: proportional margin on weights + KV
MARGIN_FRACTION = 0.05


def _gguf_config(header: Any) -> dict[str, Any]:
    """A transformers-style config dict from GGUF metadata (``<arch>.block_count`` ...)."""
    md = header.metadata
    arch = header.architecture or "llama"

    def key(k: str) -> Any:
        return md.get(f"{arch}.{k}")

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    cfg: dict[str, Any] = {
        "model_type": arch,
        "num_hidden_layers": key("block_count"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv") or heads,
        "head_dim": key("attention.key_length"),
        "intermediate_size": key("feed_forward_length"),
        "vocab_size": key("vocab_size") or header.array_lengths.get("tokenizer.ggml.tokens"),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in header.tensors),
    }
    if key("expert_count"):
        cfg["num_local_experts"] = key("expert_count")
        cfg["moe_intermediate_size"] = key("expert_feed_forward_length")
    if key("attention.kv_lora_rank"):
        cfg["kv_lora_rank"] = key("attention.kv_lora_rank")
        cfg["qk_rope_head_dim"] = key("rope.dimension_count")
    return {k: v for k, v in cfg.items() if v is not None}


def gguf_parts(probe: Any) -> list[Any]:
    """The GGUF headers of the model ``probe`` holds: its one file's, or, for a model split by gguf-split, every part's
    (the parts the GGUF plugin's detection names, each read with the same bounded parser)."""
    from anyquant.api import default_registry
    from anyquant.headers import read_gguf_header

    first = probe.gguf[0]
    count = first.metadata.get("split.count")
    if not isinstance(count, int) or isinstance(count, bool) or count <= 1:
        return [first]
    parts = default_registry().detect(probe).details.get("parts") or []
    return [first if name == first.file else read_gguf_header(probe.root / name, name) for name in parts] or [first]


def _gguf_tensor_bytes(header: Any) -> int:
    from anyquant.headers import GGUF_TYPE_SIZES

    total = 0
    for t in header.tensors:
        _, block, size = GGUF_TYPE_SIZES.get(t.type_id, ("?", 0, 0))
        if not block:
            raise SizingError(f"{header.file}: tensor {t.name} has GGUF type {t.type_id}, of unknown size")
        total += math.prod(t.shape) // block * size
    return total


# ---------------------------------------------------------------------- estimate


@dataclass
class Estimate:
    """Memory for weights + KV cache + margin. Bytes are exact integers; ``to_dict`` adds GB/GiB."""

    model: str
    source: str  # "headers", "headers+bits", "config+bits"
    format: str | None
    bits: float | None
    parameters: int
    weight_bytes: int
    embedding_bytes: int  # part of weight_bytes (exllamav3 and llama.cpp keep it in system RAM)
    kv_dtype: str
    kv_bits: float
    kv_bytes_per_token: int
    context: int
    batch: int
    kv_bytes: int
    margin_bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.margin_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        for k in ("weight_bytes", "kv_bytes", "margin_bytes", "total_bytes"):
            d[k.replace("_bytes", "_gb")] = round(d[k] / GB, 3)
            d[k.replace("_bytes", "_gib")] = round(d[k] / GiB, 3)
        return d

    def summary(self) -> str:
        bits = f", {self.bits:g} bits/weight" if self.bits is not None else ""
        lines = [
            f"{self.model}: {self.parameters / 1e9:.2f}B parameters ({self.format or 'unknown format'}{bits})",
            f"  weights   {format_gb(self.weight_bytes)}  [{self.source}]",
            f"  KV cache  {format_gb(self.kv_bytes)}  ({self.kv_bytes_per_token / 1024:.1f} KiB/token: {self.layers} layers x "
            f"{self.kv_heads} kv heads x {self.head_dim} head dim, {self.kv_dtype}; {self.context} tokens x batch {self.batch})",
            f"  margin    {format_gb(self.margin_bytes)}  ({OVERHEAD_BYTES / GiB:g} GiB + {MARGIN_FRACTION:.0%})",
            f"  total     {format_gb(self.total_bytes)}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def format_gb(n: float) -> str:
    return f"{n / GB:7.2f} GB ({n / GiB:.2f} GiB)"


def kv_bits(kv_dtype: str) -> tuple[str, float]:
    name = KV_ALIASES.get(kv_dtype.lower(), kv_dtype.lower())
    if name not in KV_BITS:
        raise SizingError(f"unknown kv_dtype {kv_dtype!r}; choose one of {', '.join(KV_BITS)}")
    return name, KV_BITS[name]


def margin_bytes(payload: int, devices: int = 1) -> int:
    return int(devices * OVERHEAD_BYTES + MARGIN_FRACTION * payload)


@dataclass(frozen=True)
class Weights:
    """What a model's weights take: the sizes an :class:`Estimate` starts from (``estimate_for`` adds the rest)."""

    shape: ModelShape
    source: str
    format: str | None
    bits: float | None
    weight_bytes: int
    embedding_bytes: int
    notes: tuple[str, ...] = ()


def weights_from_config(shape: ModelShape, bits: float | None, head_bits: float, fmt: str | None = None) -> Weights:
    if bits is None:
        raise SizingError(f"{shape.name}: no weights to measure (config only): pass bits= (e.g. 4.0)")
    _check_bits("bits", bits)
    _check_bits("head_bits", head_bits)
    embed = shape.embed_params * 2
    notes = [f"decoder linears at {bits:g} bits/weight, embeddings and norms at 16, head at {head_bits:g}"]
    head = shape.head_params
    if shape.tied and head_bits != 16:  # a quantized head cannot be the embedding table: stored apart (exllamav3)
        head = shape.vocab * shape.hidden
        notes.append(f"the tied head quantized to {head_bits:g} bits is stored as its own tensor")
    linear = shape.linear_params
    if fmt == "exl3" and shape.padded_linear_params:
        linear = shape.padded_linear_params
        if linear != shape.linear_params:
            notes.append(
                f"EXL3 pads linear dimensions to multiples of 128: {linear / shape.linear_params - 1:+.1%} stored"
            )
    total = linear * bits / 8 + embed + head * head_bits / 8 + shape.other_params * 2
    return Weights(shape, "config+bits", fmt, bits, int(total), embed, tuple(notes))


def _check_bits(name: str, bits: Any) -> None:
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not (0 < bits <= 32):
        raise SizingError(f"{name} must be a number in (0, 32], got {bits!r}")


def check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SizingError(f"{name} must be a positive integer, got {value!r}")


def check_gb(name: str, value: Any) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value < 1e6
    ):
        raise SizingError(f"{name} must be a positive number of GB, got {value!r}")


def _is_decoder_linear(name: str, ndim: int) -> bool:
    return ndim == 2 and name.endswith(".weight") and bool(re.search(r"\.(layers|h|blocks|block)\.\d+\.", name))


#: the token embedding's tensors, by name
_EMBEDDING_NAME = re.compile(r"embed_tokens|wte|word_embeddings|tok_embeddings")


def _from_dense_headers(probe: Any, shape: ModelShape, bits: float, head_bits: float) -> Weights:
    linear = embed = head = other = 0
    for t in probe.tensors.values():
        n = math.prod(t.shape)
        if _is_decoder_linear(t.name, len(t.shape)):
            linear += n
        elif _EMBEDDING_NAME.search(t.name):
            embed += n
        elif re.search(r"lm_head|(^|\.)output\.weight", t.name):
            head += n
        else:
            other += n
    total = linear * bits / 8 + (embed + other) * 2 + head * head_bits / 8
    note = (
        f"parameter counts from the dense checkpoint's headers; decoder linears at {bits:g} bits/weight, "
        f"embeddings and norms at 16, head at {head_bits:g}"
    )
    return Weights(replace(shape, linear_params=linear), "headers+bits", "dense", bits, int(total), embed * 2, (note,))


def _embedding_bytes(probe: Any) -> int:
    """The token embedding's bytes: every tensor of the embedding module (a ring-coded EXL3 table is a
    ``.trellis`` (maybe in row shards) plus ``.signs``)."""
    return sum(int(t.nbytes) for t in probe.tensors.values() if _EMBEDDING_NAME.search(t.name))


def _measured_bits(probe: Any) -> float | None:
    """:func:`bits_per_weight` of the checkpoint behind ``probe``, from its plugin's module table (headers
    only): the same figure as ``anyquant inspect``'s."""
    from anyquant.api import report_of

    try:
        return bits_per_weight(report_of(probe).modules)
    except AnyquantError as exc:  # no plugin claims it: the bytes are exact all the same, the bits unknown
        log.info("%s: bits per weight unknown: %s", probe.root, exc)
        return None


def _checkpoint_weights(path: Path, bits: float | None, head_bits: float) -> Weights:
    from anyquant.probe import Probe, display_name

    probe = Probe.open(path)
    if probe.gguf and not probe.safetensors:
        parts = gguf_parts(probe)
        g = replace(
            parts[0], tensors=tuple(t for h in parts for t in h.tensors)
        )  # a split model's tensors: every part's
        shape = model_shape(_gguf_config(g), name=display_name(path))
        size = _gguf_tensor_bytes(g)
        embd = next((t for t in g.tensors if t.name == "token_embd.weight"), None)
        embed_bytes = _gguf_tensor_bytes(replace(g, tensors=(embd,))) if embd is not None else 0
        notes = ("bits ignored: the GGUF file is already quantized",) if bits is not None else ()
        return Weights(shape, "headers", "gguf", _measured_bits(probe), size, embed_bytes, notes)
    if probe.config is None:
        raise SizingError(f"{path}: no config.json and no GGUF metadata: cannot tell layers and KV heads")
    from anyquant.probe import thaw

    shape = model_shape(thaw(probe.config), name=display_name(path))
    fmt = probe.quant_method
    if not probe.tensors:
        return weights_from_config(shape, bits, head_bits, fmt)
    if fmt is None and bits is not None:
        return _from_dense_headers(probe, shape, bits, head_bits)
    size = probe.total_tensor_bytes
    notes = (f"bits ignored: the checkpoint is already {fmt}",) if bits is not None and fmt else ()
    return Weights(shape, "headers", fmt or "dense", _measured_bits(probe), size, _embedding_bytes(probe), notes)


def weights_of(
    path_or_config: str | Path | Mapping[str, Any], bits: float | None, head_bits: float, fmt: str | None = None
) -> Weights:
    if isinstance(path_or_config, Mapping):
        return weights_from_config(
            model_shape(path_or_config, str(path_or_config.get("_name_or_path", "config"))), bits, head_bits, fmt
        )
    from anyquant.probe import resolve_checkpoint

    path = resolve_checkpoint(path_or_config)  # a model id: its snapshot in the local Hugging Face cache
    if path.is_file() and path.suffix == ".json":
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SizingError(f"{path}: not a readable JSON config ({exc})") from None
        if not isinstance(cfg, dict):
            raise SizingError(f"{path}: expected a JSON object")
        return weights_from_config(model_shape(cfg, name=path.parent.name or path.name), bits, head_bits, fmt)
    if not path.exists():
        raise SizingError(f"{path}: no such checkpoint or config file")
    return _checkpoint_weights(path, bits, head_bits)


def estimate(
    path_or_config: str | Path | Mapping[str, Any],
    *,
    bits: float | None = None,
    context: int = 8192,
    batch: int = 1,
    kv_dtype: str = "fp16",
    head_bits: float = 16.0,
    format: str | None = None,
    revision: str | None = None,
) -> Estimate:
    """Memory to run a model: weights + KV cache for ``context`` tokens x ``batch`` + a margin.

    ``path_or_config``: a checkpoint directory or ``.gguf``/``.safetensors`` file (exact bytes from
    the headers), a ``config.json`` path or dict (needs ``bits``). ``bits`` on a dense checkpoint
    estimates it quantized. ``kv_dtype``: ``fp16``/``bf16``/``fp32``/``fp8`` or ``q2``..``q8``.
    ``head_bits``: the LM head's bits for config estimates (16 for GPTQ/AWQ; exllamav3 defaults to 6; a tied
    head below 16 bits is stored as its own tensor). ``format="exl3"`` counts EXL3's padding of linear
    dimensions to multiples of 128 in config estimates. ``revision``: a model id's branch, tag or commit in
    the local Hugging Face cache (as ``owner/name@revision``).
    """
    if revision is not None and not isinstance(path_or_config, Mapping):
        from anyquant.probe import with_revision

        path_or_config = with_revision(path_or_config, revision)  # type: ignore[assignment]
    check_count("context", context)
    check_count("batch", batch)
    if bits is not None:
        _check_bits("bits", bits)
    _check_bits("head_bits", head_bits)
    if not isinstance(kv_dtype, str):
        raise SizingError(f"kv_dtype must be a string such as 'fp16' or 'q8', got {kv_dtype!r}")
    if not isinstance(path_or_config, (str, Path, Mapping)):
        raise SizingError(f"expected a checkpoint path, a config.json path or a config dict, got {path_or_config!r}")
    if format is not None and not isinstance(format, str):
        raise SizingError(f"format must be a format id such as 'exl3', got {format!r}")
    w = weights_of(path_or_config, bits, head_bits, format.lower() if format else None)
    return estimate_for(w, context=context, batch=batch, kv_dtype=kv_dtype)


def estimate_for(
    w: Weights, *, context: int, batch: int = 1, kv_dtype: str = "fp16", devices: int = 1, model: str | None = None
) -> Estimate:
    """The :class:`Estimate` of weights ``w``: a KV cache of ``context`` tokens x ``batch`` in ``kv_dtype`` and the
    margin for ``devices`` devices; ``model`` labels it (default: the model's name)."""
    kv_name, kvb = kv_bits(kv_dtype)
    per_token = math.ceil(w.shape.kv_values_per_token * kvb / 8)
    kv = per_token * context * batch
    return Estimate(
        model=w.shape.name if model is None else model,
        source=w.source,
        format=w.format,
        bits=w.bits,
        parameters=w.shape.parameters,
        weight_bytes=w.weight_bytes,
        embedding_bytes=w.embedding_bytes,
        kv_dtype=kv_name,
        kv_bits=kvb,
        kv_bytes_per_token=per_token,
        context=context,
        batch=batch,
        kv_bytes=kv,
        margin_bytes=margin_bytes(w.weight_bytes + kv, devices),
        layers=w.shape.layers,
        kv_heads=w.shape.kv_heads,
        head_dim=w.shape.head_dim,
        notes=[*w.notes, *w.shape.notes, *_context_note(w.shape, context)],
    )


def _context_note(shape: ModelShape, context: int) -> list[str]:
    if shape.max_context is not None and context > shape.max_context:
        return [f"context {context} is beyond the model's max_position_embeddings ({shape.max_context})"]
    return []
