"""The compressed-tensors loader: validation and the per-linear factory, on the runtime's
:class:`~anyquant_runtime.int4.loader.PackedFormatLoader`. Its layers offer a fast backend 4-bit packed integers as
int4 groups, 8-bit integers as int8 blocks, NVFP4/MXFP4 as 4-bit tables and FP8 as E4M3 groups; every other layer
stays exact. The loader describes each layer's packed layout from the headers and the engine decides
(:mod:`anyquant_runtime.layouts`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from anyquant.plugin import (
    SAFETENSORS_DTYPE_BITS,
    CheckpointError,
    Detection,
    LoadedModel,
    LoadOptions,
    ModuleInfo,
    Probe,
    UnsupportedFormatError,
    dense_rows,
)
from anyquant_runtime import LoadContext
from anyquant_runtime.int4.loader import Int4State, PackedFormatLoader
from anyquant_runtime.layouts import E4M3Groups, Int4Groups, Int8Blocks, Layout, Table4

from .scheme import CTConfig, ModuleSpec, read_modules
from .sparse import SparseSource, SparseSpec, read_sparse, sparse_view

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["CTLoader"]

log = logging.getLogger(__name__)

#: ``ctx.state`` key of the kv_cache_scheme's scales (read in prepare, installed in finish)
KV_KEY = "ct_kv_cache"


def _config(probe: Probe) -> CTConfig:
    qc = probe.quantization_config
    return CTConfig.parse(qc if probe.quant_method in ("compressed-tensors", "compressed_tensors") else None)


#: the scales' dtypes in the headers, by torch's name (an 8-bit or FP8 weight rounds to its scales' dtype)
_SCALE_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _described(spec: ModuleSpec, probe: Probe) -> list[Layout] | str:
    """``spec``'s packed layout as :meth:`~anyquant_ct.qlinear.CTLinear.packed_layouts` offers it, from the headers
    alone (no tensor read, the tensor fields ``None``), or why it offers none. A packed per-channel layer's width is
    fixed by ``weight_shape``'s values only: the packed words' (an upper bound by less than a word) stands for it."""
    import torch

    a, n, k, have = spec.weights, spec.out_features, spec.in_features, spec.tensors
    if k is None:
        packed = probe.tensors.get(have.get("weight_packed", ""))
        if packed is None:
            return "its width is not in the headers"
        k = packed.shape[-1] * 32 // a.num_bits
    scale = probe.tensors.get(have["weight_scale"])
    round_to = getattr(torch, _SCALE_DTYPES.get(scale.dtype if scale is not None else "", "float32"))
    zero_points, g_idx = "weight_zero_point" in have, "weight_g_idx" in have
    if spec.storage in ("int8", "packed-int") and a.num_bits == 8:
        if zero_points or g_idx or a.strategy not in ("tensor", "channel", "group"):
            return f"8-bit weights with zero points, a g_idx or per-{a.strategy} scales"
        return [Int8Blocks(k, n, (a.group_size or 1) if a.strategy == "group" else k, None, None, round_to)]
    if spec.storage == "fp8":
        if zero_points:
            return "FP8 weights with zero points"
        if a.strategy in ("tensor", "channel"):
            rows, group = (n if a.strategy == "tensor" else 1), k
        elif a.strategy == "group" and a.group_size and not g_idx:
            rows, group = 1, a.group_size
        elif a.strategy == "block" and a.block_structure:
            rows, group = a.block_structure
        else:
            return f"FP8 scales per {a.strategy} with no packed layout"
        return [E4M3Groups(k, n, group, None, None, round_to, rows)]
    acts = spec.input_activations
    if spec.storage in ("nvfp4", "mxfp4"):
        return [Table4(k, n, 32 if spec.storage == "mxfp4" else 16, None, None, None, torch.bfloat16)]
    if spec.storage != "packed-int" or a.num_bits != 4 or acts is not None or a.strategy not in ("group", "channel"):
        return f"{spec.storage} {a.num_bits}-bit weights per {a.strategy} have no packed layout"
    return [Int4Groups(k, n, None, None, None, group_size=a.group_size if a.strategy == "group" else k)]


def _read(probe: Probe) -> tuple[CTConfig, dict[str, SparseSpec], list[ModuleSpec]]:
    """The config, the modules stored sparse, and the quantized modules as they read once decompressed."""
    cfg = _config(probe)
    sparse, _ = read_sparse(probe, cfg.sparsity)
    return cfg, sparse, read_modules(sparse_view(probe, sparse), cfg)[0]


class CTLoader(PackedFormatLoader):
    format = "compressed-tensors"
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = (Int4Groups, Int8Blocks, Table4, E4M3Groups)

    def read_signature(self, probe: Probe) -> list[ModuleSpec]:
        return _read(probe)[2]

    def tensor_source(self, probe: Probe, options: LoadOptions) -> Any:
        """The checkpoint's tensors, and each sparse module's dense ``weight`` decompressed from them when read."""
        source = super().tensor_source(probe, options)
        sparse = _read(probe)[1]
        return SparseSource(source, sparse) if sparse else source

    def fast_layer_count(self, signature: list[ModuleSpec], probe: Probe) -> int:
        """Each layer described as its packed layout (:func:`_described`), counted by the CPU engine."""
        from anyquant_runtime.cpu import layouts_run

        return layouts_run(_described(s, probe) for s in signature)

    def facts(self, probe: Probe, detection: Detection, options: LoadOptions) -> Int4State:
        facts = super().facts(probe, detection, options)
        facts.dense_bytes = sum(s.out_features * (s.in_features or 0) * 4 for s in facts.signature)
        return facts

    def validate(self, probe: Probe, detection: Detection) -> None:
        from anyquant.plugin import FormatConflictError

        d = detection.details
        self.raise_detected_error(detection)
        cfg = _config(probe)  # typed errors for an unknown format or type
        if cfg.transform:
            raise UnsupportedFormatError(
                f"{probe.root}: the config has a transform_config (rotations applied to the weights, e.g. QuIP or "
                "SpinQuant): anyquant does not apply them, and the weights alone would give garbage; serve it with vLLM"
            )
        problems = d.get("problems") or []
        if problems:
            raise FormatConflictError(
                f"{probe.root}: the compressed-tensors tensors disagree with each other or with the config: "
                + "; ".join(problems[:3])
                + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
            )
        if not d.get("modules") and not d.get("sparse_modules"):
            raise CheckpointError(
                f"{probe.root}: the config says compressed-tensors, but no tensor is quantized or sparse "
                "(no weight_packed, weight_scale or bitmask): refusing to load it as dense"
            )

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .qlinear import CTLinear

        state = self.state(ctx)
        specs = state.signature if isinstance(state.signature, list) else _read(ctx.probe)[2]
        by_name: dict[str, ModuleSpec] = {s.name: s for s in specs}
        mode = "dequantized" if ctx.backend == "dequantized" else "reference"

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            spec = by_name.get(name)
            if spec is None:
                return None  # dense (ignored modules, lm_head): filled from the checkpoint's .weight
            if spec.out_features != linear.out_features or spec.in_features not in (None, linear.in_features):
                raise CheckpointError(
                    f"{name}: compressed-tensors tensors are [{spec.out_features}, {spec.in_features}], the model "
                    f"expects [{linear.out_features}, {linear.in_features}]"
                )
            src = ctx.source
            tensors = {s: src.get(full) for s, full in spec.tensors.items() if s != "bias"}
            _check_weight_shape(name, tensors, linear, spec)
            bias = src.get(spec.tensors["bias"]) if "bias" in spec.tensors else None
            layer = CTLinear(
                spec.storage,
                spec.weights,
                tensors,
                bias,
                in_features=linear.in_features,
                out_features=linear.out_features,
                input_args=spec.input_activations,
                mode=mode,
                compute_dtype=ctx.dtype,
            )
            return self.fast_convert(ctx, name, layer)

        return factory

    def prepare(self, ctx: LoadContext) -> None:
        """The KV-cache scales of a ``kv_cache_scheme`` (read and checked here)."""
        super().prepare(ctx)
        cfg = _config(ctx.probe)
        ctx.state[KV_KEY] = None
        if cfg.kv_cache is None:
            return
        if cfg.kv_cache.dynamic or cfg.kv_cache.strategy != "tensor":
            raise UnsupportedFormatError(
                f"{ctx.probe.root}: kv_cache_scheme {cfg.kv_cache.describe()}: anyquant applies static per-tensor "
                "KV-cache scales (k_scale/v_scale) only"
            )
        scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for prefix in sorted(ctx.probe.modules_with("k_scale")):
            k, v = ctx.source.get(f"{prefix}.k_scale"), ctx.source.get(f"{prefix}.v_scale")
            for name, t in (("k_scale", k), ("v_scale", v)):
                if (
                    t.numel() != 1
                    or not t.is_floating_point()
                    or not bool((t > 0).all())
                    or not bool(t.isfinite().all())
                ):
                    raise CheckpointError(f"{prefix}.{name} is {t.flatten()[:4].tolist()}: expected one positive scale")
            scales[prefix] = (k.reshape(()).float(), v.reshape(()).float())
        if not scales:
            raise CheckpointError(f"{ctx.probe.root}: the config has a kv_cache_scheme, but no k_scale/v_scale tensors")
        ctx.state[KV_KEY] = (cfg.kv_cache, scales)

    def finish(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        """A ``kv_cache_scheme``'s quantization on each attention
        layer of the native decoder (transformers' classes have no place for it: refused)."""
        from .qlinear import KVQuant

        loaded = super().finish(loaded, ctx)
        kv = ctx.state.get(KV_KEY)
        if kv is None:
            return loaded
        args, scales = kv
        done = 0
        for name, module in loaded.module.named_modules():
            if name in scales and hasattr(module, "kv_quant"):
                module.kv_quant = KVQuant(args, *scales[name])
                done += 1
        if done != len(scales):
            raise UnsupportedFormatError(
                f"{ctx.probe.root}: the kv_cache_scheme ({args.describe()}) is applied by anyquant's native decoder "
                f"only; this model built {loaded.info.get('runtime')!r} and {done} of {len(scales)} layers took it"
            )
        loaded.info = {**loaded.info, "kv_cache_scheme": f"{args.describe()}, {done} layers (k_scale/v_scale)"}
        return loaded

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        _, sparse, specs = _read(probe)
        view = sparse_view(probe, sparse)
        rows, covered = [], set()
        for s in specs:
            nbytes = sum(view.tensors[n].nbytes for n in s.tensors.values())
            covered.add(s.name)
            gs = s.weights.group_size if s.weights.strategy in ("group", "tensor_group") else None
            in_f = s.in_features or 0
            kind = f"ct-{s.storage}" + (f"+{sparse[s.name].layout}" if s.name in sparse else "")
            rows.append(ModuleInfo(s.name, kind, (s.out_features, in_f), float(s.bits), gs or -1, nbytes))
        for sp in sparse.values():
            if sp.name in covered:
                continue
            covered.add(sp.name)
            bits = float(SAFETENSORS_DTYPE_BITS.get(sp.dtype, 0))
            shape = (sp.out_features, sp.in_features)
            rows.append(ModuleInfo(sp.name, f"ct-{sp.layout}", shape, bits, None, sp.nbytes, extra={"dtype": sp.dtype}))
        return rows + dense_rows(probe, skip=covered)


def _check_weight_shape(name: str, tensors: dict[str, torch.Tensor], linear: nn.Linear, spec: ModuleSpec) -> None:
    """``weight_shape`` (packed layers) must name the layer's own ``[out, in]``, and ``weight_packed`` hold exactly
    the int32 words compressed-tensors packs that many values into."""
    from .dequant import packed_columns

    ws = tensors.pop("weight_shape", None)
    if ws is None:
        return
    values = [int(v) for v in ws.reshape(-1).tolist()]
    if values != [linear.out_features, linear.in_features]:
        raise CheckpointError(
            f"{name}: weight_shape says {values}, the model's layer is [{linear.out_features}, {linear.in_features}]"
        )
    packed = tensors.get("weight_packed")
    if spec.storage == "packed-int" and packed is not None:
        words = packed_columns(linear.in_features, spec.bits)
        if packed.shape[-1] != words:
            raise CheckpointError(
                f"{name}: weight_packed has {packed.shape[-1]} int32 columns; {linear.in_features} values of "
                f"{spec.bits} bits pack into {words}"
            )
