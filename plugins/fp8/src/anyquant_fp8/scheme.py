"""The FP8 checkpoint's layout from its headers: which modules are FP8, their block size, and what disagrees.

transformers' FineGrainedFP8 format (``quant_method: "fp8"``): every quantized linear stores ``weight`` as
float8_e4m3fn ``[out, in]`` and ``weight_scale_inv`` float32, either ``[ceil(out/bh), ceil(in/bw)]`` for
``weight_block_size: [bh, bw]`` or one value (``weight_block_size: null``). NVIDIA ModelOpt's FP8 exports
(``quant_method: "modelopt"`` or ``hf_quant_config.json``, :mod:`anyquant_fp8.modelopt`) store ``weight_scale`` (the
multiplier, per tensor / per output channel / per 128x128 block) and, for ``FP8``, a static ``input_scale``.
transformers' ``fbgemm_fp8`` (:mod:`anyquant_fp8.fbgemm`) stores ``weight`` float8_e4m3fn ``[out, in]`` and
``weight_scale`` float32 ``[out, 1]``, its inputs quantized per row under ``activation_scale_ub``.
Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from anyquant.plugin import ConfigError, Probe, UnsupportedFormatError

from .fbgemm import EXPERT_TENSORS, FbgemmConfig, read_fbgemm_config
from .modelopt import ALGOS, ModelOptConfig, is_modelopt, read_modelopt_config

__all__ = ["FP8Module", "FP8Scheme", "read_scheme"]

DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


@dataclass(frozen=True)
class FP8Module:
    name: str
    out_features: int
    in_features: int
    has_bias: bool
    #: ModelOpt FP8: the linear's static per-tensor ``input_scale`` (NVFP4: its input global scale's inverse)
    has_input_scale: bool = False
    #: ModelOpt ``MIXED_PRECISION``: this linear's own ``quant_algo`` (``FP8`` or ``NVFP4``); else ``None``
    algo: str | None = None


@dataclass
class FP8Scheme:
    block: tuple[int, int] | None
    activation_scheme: str
    #: the dtype transformers dequantizes to (the model's: config.json ``dtype``/``torch_dtype``)
    dtype: str
    modules: list[FP8Module] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: the weight's multiplier tensor: ``weight_scale_inv`` (``quant_method: fp8``) or ``weight_scale`` (ModelOpt)
    scale_name: str = "weight_scale_inv"
    #: ModelOpt's config (``None``: transformers' ``quant_method: fp8``)
    modelopt: ModelOptConfig | None = None
    #: ModelOpt FP8 KV cache: the attention modules with their ``k_scale``/``v_scale`` tensor names
    kv_scales: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: transformers' ``fbgemm_fp8`` config (``None``: another method)
    fbgemm: FbgemmConfig | None = None

    @property
    def variant(self) -> str:
        if self.fbgemm is not None:
            return "fbgemm-fp8"
        if self.modelopt is not None:
            return self.modelopt.variant
        return "block" if self.block else "tensor"

    @property
    def input_quant(self) -> str | None:
        """How activations are quantized before each quantized linear: ``"static"`` (FP8 per tensor, the stored
        ``input_scale``), ``"token"`` (FP8, dynamic per token), ``"nvfp4"`` (NVFP4 per 16, global scale
        ``1 / input_scale``), ``"fbgemm"`` (FP8, dynamic per row under ``activation_scale_ub``: fbgemm's
        ``quantize_fp8_per_row``) or ``None``."""
        if self.fbgemm is not None:
            return "fbgemm"
        return self.modelopt.input_quant if self.modelopt is not None else None

    def describe(self) -> str:
        if self.fbgemm is not None:
            return self.fbgemm.describe()
        if self.modelopt is not None and self.modelopt.scales == "nvfp4":
            m = self.modelopt
            return (
                f"{m.producer} quant_algo {m.algo} from {m.source}: U8 FP4 E2M1 weights (two a byte), F8_E4M3 "
                f"weight_scale per {m.group_size} inputs, F32 weight_scale_2; NVFP4 inputs (F32 input_scale)"
            )
        if self.modelopt is not None and self.modelopt.scales == "mixed":
            m = self.modelopt
            counts = {a: sum(1 for x in self.modules if x.algo == a) for a in ("NVFP4", "FP8")}
            return (
                f"{m.producer} quant_algo {m.algo} from {m.source}: quantized_layers names {len(m.layers)} linears, "
                f"{counts['NVFP4']} stored NVFP4 (U8 FP4 E2M1 pairs, F8_E4M3 weight_scale per 16, F32 weight_scale_2, "
                f"NVFP4 inputs) and {counts['FP8']} FP8 (F8_E4M3, one weight_scale, static input_scale)"
            )
        if self.modelopt is not None:
            m = self.modelopt
            acts = {"static": "static per-tensor FP8 input_scale", "token": "dynamic per-token FP8 inputs"}.get(
                m.input_quant or "", "16-bit inputs"
            )
            weights = {"tensor": "one weight_scale per tensor", "channel": "weight_scale per output channel"}.get(
                m.scales, "weight_scale per 128x128 block"
            )
            kv = ", FP8 KV cache (k_scale/v_scale)" if m.kv_algo else ""
            return f"{m.producer} quant_algo {m.algo} from {m.source}: {weights}, {acts}{kv}"
        if self.block:
            return f"{self.block[0]}x{self.block[1]} blocks, {self.activation_scheme} activations"
        return f"one scale per tensor, {self.activation_scheme} activations"


def _block(qc: Mapping[str, Any]) -> tuple[int, int] | None:
    raw = qc.get("weight_block_size")
    if raw is None:
        return None
    if (
        not isinstance(raw, Sequence)
        or isinstance(raw, str)
        or len(raw) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 16 for v in raw)
    ):
        raise ConfigError(f"quantization_config.weight_block_size is {raw!r}; expected [rows, cols] or null")
    return int(raw[0]), int(raw[1])


def read_scheme(probe: Probe) -> FP8Scheme:
    if probe.quant_method == "fbgemm_fp8":
        return read_fbgemm_scheme(probe)
    if is_modelopt(probe):
        return read_modelopt_scheme(probe)
    qc = probe.quantization_config or {}
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedFormatError(f"quantization_config.fmt is {fmt!r}: anyquant reads FP8 e4m3 weights")
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise ConfigError(f"quantization_config.activation_scheme is {act!r}; expected 'dynamic' or 'static'")
    raw_dtype = (probe.config or {}).get("dtype") or (probe.config or {}).get("torch_dtype") or "bfloat16"
    dtype = DTYPES.get(str(raw_dtype), "bfloat16")
    scheme = FP8Scheme(_block(qc), act, dtype)
    t = probe.tensors
    for prefix in sorted(probe.modules_with("weight_scale_inv")):
        w, s = t.get(f"{prefix}.weight"), t[f"{prefix}.weight_scale_inv"]
        if w is None:
            scheme.problems.append(f"{prefix}: weight_scale_inv without weight")
            continue
        if w.dtype != "F8_E4M3" or len(w.shape) != 2:
            scheme.problems.append(f"{prefix}.weight is {w.dtype}{list(w.shape)}; expected F8_E4M3 [out, in]")
            continue
        if s.dtype not in ("F32", "BF16", "F16"):
            scheme.problems.append(f"{prefix}.weight_scale_inv is {s.dtype}; expected F32")
            continue
        out, inp = w.shape
        if scheme.block is None:
            want: tuple[tuple[int, ...], ...] = ((), (1,), (1, 1))
        else:
            want = ((math.ceil(out / scheme.block[0]), math.ceil(inp / scheme.block[1])),)
        if tuple(s.shape) not in want:
            what = f"{scheme.block[0]}x{scheme.block[1]} blocks" if scheme.block else "one scale per tensor"
            scheme.problems.append(
                f"{prefix}.weight_scale_inv is {list(s.shape)}; {what} of [{out}, {inp}] need {list(want[0])}"
            )
            continue
        scheme.modules.append(FP8Module(prefix, out, inp, f"{prefix}.bias" in t))
    stray = [
        n
        for n, ti in t.items()
        if ti.dtype == "F8_E4M3" and n.rpartition(".")[0] not in probe.modules_with("weight_scale_inv")
    ]
    if stray:
        scheme.problems.append(f"{len(stray)} FP8 tensors without a weight_scale_inv (e.g. {stray[0]})")
    if probe.quant_method == "fp8" and not scheme.modules and not scheme.problems:
        scheme.problems.append("the config says fp8, but no tensor is FP8 with a weight_scale_inv")
    return scheme


def _modelopt_scale_shapes(scales: str, out: int, inp: int) -> tuple[tuple[int, ...], ...]:
    if scales == "tensor":
        return ((), (1,))
    if scales == "channel":
        return ((out,), (out, 1))
    rows, cols = math.ceil(out / 128), math.ceil(inp / 128)
    return ((rows, 1, cols, 1), (rows, cols))  # as ModelOpt exports it, and as vLLM squeezes it


def _one_f32(t: Mapping[str, Any], name: str, problems: list[str]) -> bool:
    """``name`` is one F32 value (``[]`` or ``[1]``); else a problem, ``False``."""
    ti = t.get(name)
    if ti is None:
        problems.append(f"{name} is missing")
        return False
    if ti.dtype != "F32" or tuple(ti.shape) not in ((), (1,)):
        problems.append(f"{name} is {ti.dtype}{list(ti.shape)}; expected one F32 value")
        return False
    return True


def _nvfp4_module(m: ModelOptConfig, prefix: str, t: Mapping[str, Any], problems: list[str]) -> FP8Module | None:
    """One NVFP4 linear as ModelOpt exports it (``weight`` U8 ``[out, in/2]``, ``weight_scale`` F8_E4M3
    ``[out, in/16]``, ``weight_scale_2`` and ``input_scale`` one F32 each), or ``None`` with its problem."""
    w, s = t[f"{prefix}.weight"], t[f"{prefix}.weight_scale"]
    group = m.group_size or 16
    if w.dtype != "U8" or len(w.shape) != 2:
        problems.append(f"{prefix}.weight is {w.dtype}{list(w.shape)}; ModelOpt {m.algo} stores U8 [out, in/2]")
        return None
    if m.excluded(prefix):
        problems.append(f"{prefix} is FP4, but the config's exclude_modules keep it dense")
        return None
    out, inp = w.shape[0], 2 * w.shape[1]
    if inp % group:
        problems.append(f"{prefix}.weight holds {inp} inputs a row, not a multiple of the group size {group}")
        return None
    if s.dtype != "F8_E4M3" or tuple(s.shape) != (out, inp // group):
        problems.append(
            f"{prefix}.weight_scale is {s.dtype}{list(s.shape)}; ModelOpt {m.algo} of [{out}, {inp}] stores "
            f"F8_E4M3 [{out}, {inp // group}]"
        )
        return None
    if not _one_f32(t, f"{prefix}.weight_scale_2", problems):
        return None
    if not _one_f32(t, f"{prefix}.input_scale", problems):  # W4A4: the inputs' global scale
        problems[-1] += f" (ModelOpt {m.algo} quantizes the inputs with it)"
        return None
    return FP8Module(prefix, out, inp, f"{prefix}.bias" in t, True, "NVFP4" if m.algo == "MIXED_PRECISION" else None)


def read_modelopt_scheme(probe: Probe) -> FP8Scheme:
    """A ModelOpt FP8 checkpoint: every ``weight_scale`` module checked against the algorithm's layout, excluded
    modules dense, the static ``input_scale`` of ``FP8`` present, the KV-cache scales found; what disagrees in
    ``problems`` (a :class:`~anyquant.errors.FormatConflictError` at load)."""
    m = read_modelopt_config(probe)
    scheme = FP8Scheme(
        (128, 128) if m.scales == "block" else None,
        {"static": "static", "token": "dynamic", "nvfp4": "nvfp4", "mixed": "mixed"}.get(m.input_quant or "", "none"),
        "float32",  # the weight is float32(e4m3) * weight_scale: ModelOpt's FP8QTensor.dequantize, vLLM's GEMM
        scale_name="weight_scale",
        modelopt=m,
    )
    t = probe.tensors
    scaled = set(probe.modules_with("weight_scale"))
    leaves = set()
    for prefix in sorted(scaled):
        w, s = t.get(f"{prefix}.weight"), t[f"{prefix}.weight_scale"]
        if w is None:
            scheme.problems.append(f"{prefix}: weight_scale without weight")
            continue
        algo = m.layer_algo(prefix)
        if algo is None:  # MIXED_PRECISION: quantized_layers does not name it
            scheme.problems.append(f"{prefix} has a weight_scale, but the config's quantized_layers does not name it")
            continue
        _, scales, input_quant = ALGOS[algo]
        if scales == "nvfp4":
            module = _nvfp4_module(m, prefix, t, scheme.problems)
            if module is not None:
                leaves.add(prefix.rpartition(".")[2])
                scheme.modules.append(module)
            continue
        if w.dtype != "F8_E4M3" or len(w.shape) != 2:
            scheme.problems.append(
                f"{prefix}.weight is {w.dtype}{list(w.shape)}; ModelOpt {algo} stores F8_E4M3 [out, in]"
            )
            continue
        if m.excluded(prefix):
            scheme.problems.append(f"{prefix} is FP8, but the config's exclude_modules keep it dense")
            continue
        if s.dtype != "F32":
            scheme.problems.append(f"{prefix}.weight_scale is {s.dtype}; ModelOpt {algo} stores F32")
            continue
        out, inp = w.shape
        want = _modelopt_scale_shapes(scales, out, inp)
        if tuple(s.shape) not in want:
            scheme.problems.append(
                f"{prefix}.weight_scale is {list(s.shape)}; ModelOpt {algo} of [{out}, {inp}] stores {list(want[0])}"
            )
            continue
        has_input = f"{prefix}.input_scale" in t
        if input_quant == "static":
            si = t.get(f"{prefix}.input_scale")
            if si is None:
                scheme.problems.append(f"{prefix}: ModelOpt {algo} without its static input_scale")
                continue
            if si.dtype != "F32" or tuple(si.shape) not in ((), (1,)):
                scheme.problems.append(f"{prefix}.input_scale is {si.dtype}{list(si.shape)}; expected one F32 value")
                continue
        leaves.add(prefix.rpartition(".")[2])
        mixed = algo if m.algo == "MIXED_PRECISION" else None
        scheme.modules.append(
            FP8Module(prefix, out, inp, f"{prefix}.bias" in t, has_input and input_quant == "static", mixed)
        )
    fp4 = m.scales in ("nvfp4", "mixed")
    quantized = ("F8_E4M3", "U8") if fp4 else ("F8_E4M3",)
    stray = [n for n, ti in t.items() if ti.dtype in quantized and n.rpartition(".")[0] not in scaled]
    if stray:
        what = "FP8 or FP4" if fp4 else "FP8"
        scheme.problems.append(f"{len(stray)} {what} tensors without a weight_scale (e.g. {stray[0]})")
    # a linear of a quantized kind (same leaf name) left dense and not excluded: vLLM would expect it FP8
    dense = dense_left(t, leaves, m.excluded)
    if m.algo == "MIXED_PRECISION":  # a linear quantized_layers does not name is dense by definition; one it names
        dense = []  # must be stored quantized
        unstored = [n for n in m.layers if n not in scaled]
        if unstored:
            scheme.problems.append(
                f"{len(unstored)} linears named in quantized_layers have no weight_scale (e.g. {unstored[0]})"
            )
    if dense:
        scheme.problems.append(
            f"{len(dense)} linears are dense but not in exclude_modules (e.g. {dense[0]}): the config says they are FP8"
        )
    if not scheme.modules and not scheme.problems:
        what = "FP4" if m.scales == "nvfp4" else "FP8"
        scheme.problems.append(f"the config says ModelOpt {m.algo}, but no tensor is {what} with a weight_scale")
    if m.kv_algo:
        for prefix in sorted(probe.modules_with("k_scale")):
            attn = prefix.removesuffix(".k_proj")
            v = f"{attn}.v_proj.v_scale" if prefix.endswith(".k_proj") else f"{attn}.v_scale"
            if v not in t:
                scheme.problems.append(f"{prefix}.k_scale without {v}")
                continue
            for name in (f"{prefix}.k_scale", v):
                if t[name].dtype != "F32" or tuple(t[name].shape) not in ((), (1,)):
                    scheme.problems.append(f"{name} is {t[name].dtype}{list(t[name].shape)}; expected one F32 value")
            scheme.kv_scales[attn] = (f"{prefix}.k_scale", v)
        if not scheme.kv_scales:
            scheme.problems.append(f"kv_cache_quant_algo {m.kv_algo}, but no k_scale/v_scale tensors")
    return scheme


def _refuse_fbgemm_experts(probe: Probe, t: Mapping[str, Any]) -> None:
    experts = sorted(
        n
        for n in t
        if n.rpartition(".")[2] in (*EXPERT_TENSORS, *(f"{e}_scale" for e in EXPERT_TENSORS))
        and (t[n].dtype == "F8_E4M3" or n.endswith("_scale"))
    )
    if experts:
        raise UnsupportedFormatError(
            f"{probe.root}: fbgemm_fp8 MoE experts ({experts[0]}, {len(experts)} tensors: transformers' "
            "FbgemmFp8Llama4TextExperts, Llama-4's gate_up_proj/down_proj with per-row *_proj_scale) are not read by "
            "anyquant; it reads fbgemm_fp8's dense linears (FbgemmFp8Linear)"
        )


def read_fbgemm_scheme(probe: Probe) -> FP8Scheme:
    """An ``fbgemm_fp8`` checkpoint: each ``weight_scale`` module checked against ``FbgemmFp8Linear``'s layout and
    against ``modules_to_not_convert``; what disagrees in ``problems`` (a
    :class:`~anyquant.errors.FormatConflictError` at load)."""
    cfg = read_fbgemm_config(probe)
    scheme = FP8Scheme(None, "dynamic", "float32", scale_name="weight_scale", fbgemm=cfg)
    t = probe.tensors
    _refuse_fbgemm_experts(probe, t)
    scaled = set(probe.modules_with("weight_scale"))
    leaves = set()
    for prefix in sorted(scaled):
        w, s = t.get(f"{prefix}.weight"), t[f"{prefix}.weight_scale"]
        if w is None:
            scheme.problems.append(f"{prefix}: weight_scale without weight")
            continue
        if w.dtype != "F8_E4M3" or len(w.shape) != 2:
            scheme.problems.append(f"{prefix}.weight is {w.dtype}{list(w.shape)}; fbgemm_fp8 stores F8_E4M3 [out, in]")
            continue
        if cfg.excluded(prefix):
            scheme.problems.append(f"{prefix} is FP8, but the config's modules_to_not_convert keeps it dense")
            continue
        out, inp = w.shape
        if s.dtype != "F32" or tuple(s.shape) != (out, 1):
            scheme.problems.append(
                f"{prefix}.weight_scale is {s.dtype}{list(s.shape)}; fbgemm_fp8 of [{out}, {inp}] stores F32 [{out}, 1]"
            )
            continue
        leaves.add(prefix.rpartition(".")[2])
        scheme.modules.append(FP8Module(prefix, out, inp, f"{prefix}.bias" in t))
    stray = [n for n, ti in t.items() if ti.dtype == "F8_E4M3" and n.rpartition(".")[0] not in scaled]
    if stray:
        scheme.problems.append(f"{len(stray)} FP8 tensors without a weight_scale (e.g. {stray[0]})")
    # a linear of a quantized kind left dense and not in modules_to_not_convert: transformers would make it an
    # FbgemmFp8Linear and expect FP8 with a weight_scale
    dense = dense_left(t, leaves, cfg.excluded)
    if dense:
        scheme.problems.append(
            f"{len(dense)} linears are dense but not in modules_to_not_convert (e.g. {dense[0]}): transformers "
            "expects them FP8 with a weight_scale"
        )
    if not scheme.modules and not scheme.problems:
        scheme.problems.append("the config says fbgemm_fp8, but no tensor is F8_E4M3 with a weight_scale")
    return scheme


def dense_left(t: Mapping[str, Any], leaves: set[str], excluded: Callable[[str], bool]) -> list[str]:
    """The 16/32-bit 2-D linears of a quantized kind (a leaf name among ``leaves``) that ``excluded`` does not keep
    dense: a checkpoint whose method would have quantized them (ModelOpt's, transformers' fbgemm_fp8)."""
    return [
        n.removesuffix(".weight")
        for n, ti in t.items()
        if n.endswith(".weight")
        and ti.dtype in ("BF16", "F16", "F32")
        and len(ti.shape) == 2
        and n.removesuffix(".weight").rpartition(".")[2] in leaves
        and not excluded(n.removesuffix(".weight"))
    ]
