"""anyquant's own AWQ quantizer: pure torch, in process, on the CPU (or any torch device).

The algorithm is AutoAWQ's (``awq/quantize/quantizer.py``; see ``formats/GPTQ_AWQ.md`` section 3.5),
decoder layer by decoder layer:

1. run the layer once in full precision with hooks on its linears, keeping the input of each
   scaling group (the layer's output, also unquantized, is the next layer's input);
2. **scale search** per group, ``input_layernorm -> q/k/v``, ``v -> o`` (when the shapes allow;
   not with grouped-query attention), ``post_attention_layernorm -> gate/up``, ``up -> down``: a
   grid of ``n_grid`` ratios ``a``, ``s = x_mean^a / (w_mean^(1-a) + 1e-4)`` normalised by
   ``sqrt(max(s) min(s))``; each candidate quantizes ``W diag(s)`` and runs the block it feeds (the
   attention, the MLP, or ``down_proj``); the lowest mean squared output error wins, and the
   previous op is divided by ``s`` while the linears' input columns are multiplied by it;
3. **clip search** for every linear but ``q``/``k``: per output row and group, the clipping of
   ``max |w|`` (``1 - i/20`` for ``i < 10``) that best keeps the group's partial products on up to
   512 sampled tokens;
4. round-to-nearest per group, with zero points (``scales = (max - min) / 15``, AutoAWQ's default)
   or without (``max |w| / 7``); the scales are rounded to float16 *before* the codes are chosen,
   so the stored codes, zeros and scales dequantize (``(q - z) * s``) exactly to the weights the
   search evaluated.

Written as AutoAWQ's GEMM layout (``qweight``/``qzeros`` int32 packed along the output columns in
AWQ's nibble order, ``scales`` float16), loadable by anyquant, GPTQModel, transformers and vLLM.

Supported models: transformers decoders with Llama-style layers (``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``: Llama, Mistral,
Qwen2/3, SmolLM ...). Anything else: :class:`~anyquant.errors.QuantizeError` naming what is
missing; use ``quantizer_backend="gptqmodel"`` there.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anyquant.plugin import TOKENIZER_FILES, QuantizeError
from anyquant_tools import calibration_batch

from .dequant import pack_awq_gemm_cols

__all__ = ["AWQOptions", "awq_quantize_model", "pseudo_quantize", "quantize_checkpoint"]

log = logging.getLogger(__name__)

Progress = Callable[[str, float], None]

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")
_NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")


@dataclass(frozen=True)
class AWQOptions:
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    n_grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    #: tokens the clip search samples per linear (AutoAWQ: 512)
    clip_tokens: int = 512
    #: samples per forward during the search (memory: batch x seq_len x hidden activations)
    batch: int = 8


# --------------------------------------------------------------------------- quantization math


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    g = k if group_size == -1 else group_size
    return w.reshape(n * (k // g), g)


def quantize_params(
    w: torch.Tensor, group_size: int, bits: int = 4, zero_point: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``q`` ``[N, K]`` (int), zeros ``z`` ``[N, G]`` (int) and float16 scales ``s`` ``[N, G]``
    of ``w`` ``[N, K]``, round-to-nearest per group; ``(q - z) * s`` is the weight.

    ``zero_point=True`` (AutoAWQ's default): ``s = (max - min) / 15``, ``z = round(-min / s)``.
    ``zero_point=False``: ``s = max|w| / 7``, codes ``round(w / s)`` in ``[-8, 7]`` stored with
    ``z = 8`` (how GPTQModel writes symmetric AWQ).
    """
    n, k = w.shape
    max_int = 2**bits - 1
    wg = _groups(w.float(), group_size)
    tiny = torch.finfo(torch.float16).tiny
    if zero_point:
        wmax, wmin = wg.amax(1, keepdim=True), wg.amin(1, keepdim=True)
        scales = ((wmax - wmin).clamp(min=1e-5) / max_int).half().float().clamp(min=tiny)  # stored in float16
        zeros = (-torch.round(wmin / scales)).clamp(0, max_int)
    else:
        half = 2 ** (bits - 1)
        scales = (wg.abs().amax(1, keepdim=True).clamp(min=1e-5) / (half - 1)).half().float().clamp(min=tiny)
        zeros = torch.full_like(scales, float(half))
    q = (torch.round(wg / scales) + zeros).clamp(0, max_int)
    groups = wg.shape[0] // n
    return (
        q.reshape(n, k).to(torch.int32),
        zeros.reshape(n, groups).to(torch.int32),
        scales.reshape(n, groups).half(),
    )


def pseudo_quantize(w: torch.Tensor, group_size: int, bits: int = 4, zero_point: bool = True) -> torch.Tensor:
    """``w`` quantized and dequantized (float32), as the checkpoint will hold it."""
    n, k = w.shape
    q, z, s = quantize_params(w, group_size, bits, zero_point)
    g = k if group_size == -1 else group_size
    deq = (q.reshape(-1, g) - z.reshape(-1, 1)).float() * s.reshape(-1, 1).float()
    return deq.reshape(n, k)


# --------------------------------------------------------------------------- the search


def _get(module: nn.Module, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _check_layer(layer: nn.Module, index: int) -> None:
    missing = [p for p in (*_LINEARS, *_MLP, *_NORMS) if not _has(layer, p)]
    if missing:
        raise QuantizeError(
            f"anyquant's AWQ quantizer supports Llama-style decoder layers; layer {index} "
            f"({type(layer).__name__}) has no {', '.join(missing)}. Use quantizer_backend='gptqmodel'."
        )
    for p in (*_LINEARS, *_MLP):
        if type(_get(layer, p)) is not nn.Linear:
            raise QuantizeError(f"layer {index}: {p} is a {type(_get(layer, p)).__name__}, not an nn.Linear")
    for p in _NORMS:
        if getattr(_get(layer, p), "weight", None) is None:
            raise QuantizeError(f"layer {index}: {p} has no weight to fold the AWQ scales into")


def _has(module: nn.Module, path: str) -> bool:
    try:
        _get(module, path)
    except AttributeError:
        return False
    return True


class _Stop(Exception):
    pass


def _first_layer_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The hidden states entering decoder layer 0 and the keyword arguments the model passes
    every layer (mask, rotary embeddings, positions), caught with a pre-hook."""
    layers: Any = _get(model, "model.layers")
    caught: dict[str, Any] = {}

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        caught["h"] = args[0] if args else kwargs.pop("hidden_states")
        caught["kwargs"] = {k: v for k, v in kwargs.items() if k not in ("hidden_states",)}
        raise _Stop

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    kwargs = dict(caught["kwargs"])
    kwargs["use_cache"] = False
    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    return caught["h"], kwargs


def _batched(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([fn(x[i : i + batch]) for i in range(0, x.shape[0], batch)], 0)


def _attention_kwargs(kwargs: dict[str, Any], rows: slice) -> dict[str, Any]:
    """The layer kwargs for a slice of the samples (the mask may carry a batch dimension)."""
    out = dict(kwargs)
    mask = out.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[0] > 1:
        out["attention_mask"] = mask[rows]
    return out


def _search_scale(
    x: torch.Tensor,
    linears: Sequence[nn.Linear],
    block: Callable[[torch.Tensor], torch.Tensor],
    opts: AWQOptions,
) -> torch.Tensor:
    """The best per-input-channel scale for ``linears`` (which share the input ``x``)."""
    k = x.shape[-1]
    x_mean = torch.zeros(k, dtype=torch.float32)
    flat = x.reshape(-1, k)
    for i in range(0, flat.shape[0], 4096):
        x_mean += flat[i : i + 4096].abs().float().sum(0)
    x_mean /= flat.shape[0]
    weight = torch.cat([lin.weight.detach() for lin in linears], 0).float()
    wg = _groups(weight.abs(), opts.group_size)
    w_mean = (wg / wg.amax(1, keepdim=True).clamp(min=1e-12)).reshape(weight.shape).mean(0)
    originals = [lin.weight.detach().clone() for lin in linears]
    with torch.no_grad():
        reference = block(x)
        best, best_scales = math.inf, torch.ones(k)
        for i in range(opts.n_grid):
            ratio = i / opts.n_grid
            if opts.duo_scaling:
                s = x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)
            else:
                s = x_mean.pow(ratio)
            s = s.clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            s[~torch.isfinite(s)] = 1.0
            for lin, w in zip(linears, originals, strict=True):
                scaled = pseudo_quantize(w.float() * s, opts.group_size, opts.bits, opts.zero_point) / s
                lin.weight.copy_(scaled.to(w.dtype))
            loss = float((reference - block(x)).float().pow(2).mean())
            if loss < best:
                best, best_scales = loss, s.clone()
        for lin, w in zip(linears, originals, strict=True):
            lin.weight.copy_(w)
    if not math.isfinite(best):
        raise QuantizeError("AWQ scale search found no finite loss (NaN or inf activations)")
    return best_scales


def _apply_scale(prev: nn.Module, linears: Sequence[nn.Linear], scales: torch.Tensor) -> None:
    """Divide the previous op's output by ``scales`` and multiply the linears' inputs by them."""
    with torch.no_grad():
        if isinstance(prev, nn.Linear):
            prev.weight.div_(scales.view(-1, 1).to(prev.weight.dtype))
            if prev.bias is not None:
                prev.bias.div_(scales.to(prev.bias.dtype))
        else:
            weight: torch.Tensor = getattr(prev, "weight")  # noqa: B009 - a norm's weight, typed
            weight.div_(scales.to(weight.dtype))
            bias = getattr(prev, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.div_(scales.to(bias.dtype))
        for lin in linears:
            lin.weight.mul_(scales.view(1, -1).to(lin.weight.dtype))


def _search_clip(x: torch.Tensor, lin: nn.Linear, opts: AWQOptions) -> torch.Tensor:
    """Per output row and group, the best ``max |w|`` (AutoAWQ's ``_compute_best_clip``)."""
    w = lin.weight.detach().float()
    n, k = w.shape
    g = k if opts.group_size == -1 else opts.group_size
    flat = x.reshape(-1, k).float()
    step = max(1, flat.shape[0] // opts.clip_tokens)
    xs = flat[::step][: opts.clip_tokens].reshape(-1, k // g, g)  # [T, G, g]
    best_max = torch.empty(n, k // g)
    for start in range(0, n, 256):
        wb = w[start : start + 256].reshape(-1, k // g, g)  # [n_b, G, g]
        org_max = wb.abs().amax(-1, keepdim=True)  # [n_b, G, 1]
        reference = torch.einsum("tgi,ngi->ngt", xs, wb)
        best_err = torch.full(org_max.shape, math.inf)
        best = org_max.clone()
        for i in range(int(0.5 * 20)):
            max_val = org_max * (1 - i / 20)
            clipped = wb.clamp(-max_val, max_val)
            q = pseudo_quantize(clipped.reshape(-1, k), opts.group_size, opts.bits, opts.zero_point).reshape(wb.shape)
            err = (torch.einsum("tgi,ngi->ngt", xs, q) - reference).pow(2).mean(-1, keepdim=True)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, max_val, best)
        best_max[start : start + 256] = best.squeeze(-1)
    return best_max


def _apply_clip(lin: nn.Linear, max_val: torch.Tensor, group_size: int) -> None:
    with torch.no_grad():
        w = lin.weight
        n, k = w.shape
        g = k if group_size == -1 else group_size
        m = max_val.unsqueeze(-1).to(w.dtype)
        w.copy_(w.reshape(n, k // g, g).clamp(-m, m).reshape(n, k))


def awq_quantize_model(
    model: nn.Module,
    samples: torch.Tensor,
    opts: AWQOptions,
    progress: Progress | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run AWQ over ``model`` (a transformers causal LM in float32, eval mode) with the calibration
    token ids ``samples`` ``[n, seq_len]``. Folds the scales into the model's norms and linears,
    applies the clipping, and returns ``{linear name: (codes [N, K], zeros [N, G], scales [N, G])}``.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise QuantizeError(f"{type(model).__name__} has no model.layers: not a decoder anyquant's AWQ knows")
    for i, layer in enumerate(layers):
        _check_layer(layer, i)
    with torch.no_grad():
        h, kwargs = _first_layer_inputs(model, samples)
    out: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    batch = max(1, opts.batch)
    for index, layer in enumerate(layers):
        if progress is not None:
            progress(f"AWQ layer {index + 1}/{len(layers)}", index / len(layers))
        inputs: dict[str, list[torch.Tensor]] = {p: [] for p in (*_LINEARS, *_MLP)}
        hooks = [
            _get(layer, p).register_forward_pre_hook(lambda _m, args, keep=inputs[p]: keep.append(args[0].detach()))
            for p in inputs
        ]
        with torch.no_grad():
            nxt = torch.cat(
                [
                    _hidden(layer(h[i : i + batch], **_attention_kwargs(kwargs, slice(i, i + batch))))
                    for i in range(0, h.shape[0], batch)
                ],
                0,
            )
        for hook in hooks:
            hook.remove()
        x = {p: torch.cat(v, 0) for p, v in inputs.items()}
        attn, mlp = layer.self_attn, layer.mlp

        def attention(t: torch.Tensor, attn: nn.Module = attn) -> torch.Tensor:
            only = _attn_only(kwargs)
            parts = [
                attn(hidden_states=t[i : i + batch], **_attention_kwargs(only, slice(i, i + batch)))[0]
                for i in range(0, t.shape[0], batch)
            ]
            return torch.cat(parts, 0)

        def feed_forward(t: torch.Tensor, mlp: nn.Module = mlp) -> torch.Tensor:
            return _batched(mlp, t, batch)

        groups: list[tuple[nn.Module, list[str], Callable[[torch.Tensor], torch.Tensor]]] = [
            (layer.input_layernorm, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], attention),
            (layer.post_attention_layernorm, ["mlp.gate_proj", "mlp.up_proj"], feed_forward),
            (mlp.up_proj, ["mlp.down_proj"], mlp.down_proj),
        ]
        v, o = attn.v_proj, attn.o_proj
        if v.out_features == o.in_features:
            groups.insert(1, (v, ["self_attn.o_proj"], o))
        for prev, names, block in groups:
            linears = [_get(layer, n) for n in names]
            scales = _search_scale(x[names[0]], linears, block, opts)
            _apply_scale(prev, linears, scales)
            for n in names:
                x[n] = x[n] / scales.to(x[n].dtype)
        for name in (*_LINEARS, *_MLP):
            lin = _get(layer, name)
            if opts.clip and name not in _NO_CLIP:
                _apply_clip(lin, _search_clip(x[name], lin, opts), opts.group_size)
            out[f"model.layers.{index}.{name}"] = quantize_params(
                lin.weight.detach(), opts.group_size, opts.bits, opts.zero_point
            )
        h = nxt
    if progress is not None:
        progress("AWQ done", 1.0)
    return out


def _hidden(out: Any) -> torch.Tensor:
    """A decoder layer's hidden states (transformers 5 returns them; older layers a tuple)."""
    hidden: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return hidden


def _attn_only(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments an attention module takes from the layer's."""
    return {k: v for k, v in kwargs.items() if k in ("position_embeddings", "attention_mask", "position_ids")}


# --------------------------------------------------------------------------- checkpoint


def _pack(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors from ``[N, K]`` codes and ``[N, G]`` zeros and scales."""
    return {
        "qweight": pack_awq_gemm_cols(codes.t().contiguous()),
        "qzeros": pack_awq_gemm_cols(zeros.t().contiguous()),
        "scales": scales.t().contiguous(),
    }


def quantize_checkpoint(
    src: Path,
    dst: Path,
    texts: Sequence[str],
    *,
    opts: AWQOptions,
    seq_len: int,
    progress: Progress | None = None,
) -> Path:
    """Quantize the dense checkpoint ``src`` into ``dst`` (created) with AWQ; returns ``dst``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if opts.bits != 4:
        raise QuantizeError(f"AWQ GEMM stores 4-bit weights only, got bits={opts.bits}")
    config = AutoConfig.from_pretrained(src, trust_remote_code=False)
    if config.model_type not in _LLAMA_LIKE:
        raise QuantizeError(
            f"anyquant's AWQ quantizer supports {sorted(_LLAMA_LIKE)}; {src} is {config.model_type!r}. "
            "Use quantizer_backend='gptqmodel'."
        )
    if progress is not None:
        progress("loading the dense model", 0.0)
    samples = calibration_batch(AutoTokenizer.from_pretrained(src), texts, seq_len)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()  # type: ignore[no-untyped-call]
    k_ok = all(
        lin.in_features % opts.group_size == 0
        for layer in model.model.layers
        for lin in (_get(layer, p) for p in (*_LINEARS, *_MLP))
    )
    if opts.group_size != -1 and not k_ok:
        raise QuantizeError(f"group_size={opts.group_size} does not divide every linear's in_features")

    def sub(stage: str, frac: float) -> None:
        if progress is not None:
            progress(stage, 0.02 + 0.88 * frac)

    quantized = awq_quantize_model(model, samples, opts, sub)
    if progress is not None:
        progress("writing the AWQ checkpoint", 0.9)
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module in quantized:
            if name.endswith(".weight"):
                for suffix, t in _pack(*quantized[module]).items():
                    tensors[f"{module}.{suffix}"] = t
            else:
                tensors[name] = value.half()
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        else:
            tensors[name] = value.to(torch.float16).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "float16"
    cfg["quantization_config"] = {
        "quant_method": "awq",
        "bits": opts.bits,
        "group_size": opts.group_size,
        "zero_point": opts.zero_point,
        "version": "gemm",
        "modules_to_not_convert": None,
        "quantizer": "anyquant",
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:  # tokenizer, chat template, generation config: as they are
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst


_LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3", "granite", "olmo2"})
